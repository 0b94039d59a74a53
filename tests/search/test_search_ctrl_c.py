"""A Ctrl-C that Python drops still stops the search worker (miras.search.run._Interrupts), and
an interrupted trial is queued again with its parameters (SIGTERM in the worker's process).

Python ignores an exception raised while it runs a `__del__` or a weakref callback ("Exception
ignored in ..."); SQLAlchemy's class registry runs such callbacks, and a Ctrl-C that landed in
one let the trial run to the end and the worker exit 0 (seen in CI)."""

from __future__ import annotations

import signal
import sys

import optuna
import pytest
from optuna.trial import TrialState

from miras.search import load_study
from miras.search import run as search_run
from tests.search_support import write_study


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
    with search_run._Interrupts():
        _RaisesWhileCollected(KeyboardInterrupt())
        _RaisesWhileCollected(RuntimeError("kept"))
    assert [type(u.exc_value) for u in seen] == [RuntimeError]
    assert sys.unraisablehook is not search_run._Interrupts._drop_interrupt
    _RaisesWhileCollected(KeyboardInterrupt())  # outside: reported as before
    assert [type(u.exc_value) for u in seen] == [RuntimeError, KeyboardInterrupt]


def test_sigterm_marks_the_trial_queues_it_again_and_the_next_run_completes_it(
    tmp_path, monkeypatch
):
    """SIGTERM inside a sampled trial: the trial is failed 'interrupted (SIGTERM)', a WAITING
    copy with its parameters is queued (retry_of it), `Terminated` propagates, the handlers are
    restored, and a second run runs the queued copy first, to the budget."""
    storage = f"sqlite:///{tmp_path / 'term.db'}"
    study = load_study(write_study(tmp_path))

    def trial_killed_after_sampling(study, task, trial):
        trial.suggest_float("lr", 1.0e-3, 1.0e-2, log=True)
        trial.suggest_categorical("bias", ["l2", "dot"])
        signal.raise_signal(signal.SIGTERM)
        raise AssertionError("SIGTERM did not interrupt the trial")

    monkeypatch.setattr(search_run, "run_trial", trial_killed_after_sampling)
    options = search_run.WorkerOptions(study.model_dump(mode="json"), storage, "tiny", trials=2)
    with pytest.raises(search_run.Terminated):
        search_run.run_worker(options)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # restored
    killed, queued = optuna.load_study(study_name="tiny", storage=storage).get_trials()
    assert killed.state == TrialState.FAIL
    assert killed.user_attrs["reason"] == "interrupted (SIGTERM)"
    assert queued.state == TrialState.WAITING and queued.params == killed.params
    assert queued.system_attrs["failed_trial"] == killed.number
    assert "reason" not in queued.user_attrs

    monkeypatch.setattr(search_run, "run_trial", lambda study, task, trial: 0.5)
    counts = search_run.run_worker(options)
    assert counts.finished == 2 and counts.retried == 1
    trials = optuna.load_study(study_name="tiny", storage=storage).get_trials()
    retry = {t.number: t for t in trials}[queued.number]
    assert retry.state == TrialState.COMPLETE and retry.params == killed.params
