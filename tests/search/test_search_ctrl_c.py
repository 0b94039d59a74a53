"""A Ctrl-C that Python drops still stops the search worker (miras.search.run._CtrlC).

Python ignores an exception raised while it runs a `__del__` or a weakref callback ("Exception
ignored in ..."); SQLAlchemy's class registry runs such callbacks, and a Ctrl-C that landed in
one let the trial run to the end and the worker exit 0 (seen in CI)."""

from __future__ import annotations

import signal
import sys

import optuna
import pytest
from optuna.trial import TrialState
from search_support import write_study

from miras.search import load_study
from miras.search import run as search_run


class _InterruptedWhileCollected:
    """Sends SIGINT to this process from `__del__`, and keeps running there long enough for
    Python to call the handler inside it, where the KeyboardInterrupt is dropped."""

    def __del__(self):
        signal.raise_signal(signal.SIGINT)
        for _ in range(1000):
            pass


# The dropped KeyboardInterrupt is reported as unraisable: that is the case under test.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_dropped_ctrl_c_marks_the_trial_and_stops_the_worker(tmp_path, monkeypatch):
    storage = f"sqlite:///{tmp_path / 'ctrl_c.db'}"
    study = load_study(write_study(tmp_path))
    ran = []

    def trial_with_a_dropped_interrupt(study, task, trial):
        _InterruptedWhileCollected()  # collected at once: SIGINT arrives inside __del__
        ran.append(trial.number)
        return 0.5

    monkeypatch.setattr(search_run, "run_trial", trial_with_a_dropped_interrupt)
    options = search_run.WorkerOptions(study.model_dump(mode="json"), storage, "tiny", trials=3)
    with pytest.raises(KeyboardInterrupt):
        search_run.run_worker(options)
    assert ran == [0], "the trial ran on to its end: the KeyboardInterrupt was dropped"
    (trial,) = optuna.load_study(study_name="tiny", storage=storage).get_trials()
    assert trial.state == TrialState.FAIL
    assert trial.user_attrs["reason"] == "interrupted (Ctrl-C)"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored


class _RaisesWhileCollected:
    def __init__(self, error: BaseException):
        self.error = error

    def __del__(self):
        raise self.error


def test_a_dropped_ctrl_c_prints_no_traceback_and_other_errors_still_do(monkeypatch):
    # Python hands an exception raised in a __del__ to sys.unraisablehook, which prints
    # "Exception ignored in ..." with a traceback; the worker's own Ctrl-C is not printed.
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", lambda unraisable: seen.append(unraisable))
    with search_run._CtrlC():
        _RaisesWhileCollected(KeyboardInterrupt())
        _RaisesWhileCollected(RuntimeError("kept"))
    assert [type(u.exc_value) for u in seen] == [RuntimeError]
    assert sys.unraisablehook is not search_run._CtrlC._drop_ctrl_c
    _RaisesWhileCollected(KeyboardInterrupt())  # outside: reported as before
    assert [type(u.exc_value) for u in seen] == [RuntimeError, KeyboardInterrupt]
