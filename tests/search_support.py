"""Shared pieces of the search tests: a tiny study, worker processes, storage inspection and
the kill-a-worker scenario (run on SQLite in test_search.py and on PostgreSQL in
test_search_postgres.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import yaml
from optuna.trial import TrialState

ROOT = Path(__file__).resolve().parents[1]
FINISHED = (TrialState.COMPLETE, TrialState.PRUNED)

# A trial trains a 1-layer, d_model 16 model for a few steps on MQAR at T = 32: about a second
# on one thread. Heartbeats every second; a silent trial is failed after 3 s.
TINY = {
    "name": "tiny",
    "task": {"name": "mqar", "options": {"seq_len": 32, "num_pairs": 4, "vocab_size": 32}},
    "spec": {
        "memory": "matrix",
        "bias": {"choices": ["l2", "dot"]},
        "retention": "none",
        "model": {"d_model": 16, "n_layers": 1, "n_heads": 1, "chunk_size": {"choices": [16, 32]}},
    },
    "train": {
        "steps": 20,
        "batch_size": 16,
        "lr": {"float": [1.0e-3, 1.0e-2], "log": True},
        "warmup": 2,
        "eval_every": 5,
        "eval_batches": 1,
    },
    "objectives": ["accuracy"],
    "pruner": {"kind": "median", "startup_trials": 2},
    "trials": 3,
    "heartbeat": {"interval": 1, "grace": 3},
}


def write_study(folder: Path, name: str = "tiny", **changes) -> Path:
    data = {**TINY, "name": name, **changes}
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def start_worker(study: Path, storage: str, trials: int, *extra: str) -> subprocess.Popen:
    """`miras search` in its own process (as on another machine), one torch thread.

    Started with -c, as the `miras` console script runs, not with -m: under -m, CPython (3.11,
    3.12) turns an exit after a caught KeyboardInterrupt into a death by SIGINT whenever the
    interrupt passed through a string exec (dataclasses, emitted code), so Ctrl-C would not
    exit with the CLI's 130."""
    main = "import sys; from miras.cli import app; sys.argv[0] = 'miras'; app()"
    command = [sys.executable, "-c", main, "search", str(study), "--storage", storage]
    command += ["--trials", str(trials), "--threads", "1", *extra]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        command,
        cwd=study.parent,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def trials_of(storage: str, name: str) -> list[optuna.trial.FrozenTrial]:
    from miras.search.storage import open_storage  # picks the PostgreSQL driver that is installed

    rdb = open_storage(storage, interval=60, grace=120)
    return optuna.load_study(study_name=name, storage=rdb).get_trials(deepcopy=False)


def wait_for_running_trial(storage: str, name: str, pid: int, timeout: float = 120):
    """The trial that process `pid` is running (its `worker` attribute ends in :pid)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            for t in trials_of(storage, name):
                worker = t.user_attrs.get("worker", "")
                if t.state == TrialState.RUNNING and worker.endswith(f":{pid}") and t.params:
                    return t
        except KeyError:  # the study is not created yet
            pass
        time.sleep(0.05)
    raise AssertionError(f"process {pid} ran no trial within {timeout} s")


def kill_scenario(study: Path, storage: str, trials: int) -> None:
    """Worker A is killed with SIGKILL mid-trial; worker B then completes the study. The
    killed trial is failed, retried with its parameters, and no finished trial is lost."""
    from miras.search import search

    a = start_worker(study, storage, trials)
    try:
        victim = wait_for_running_trial(storage, "tiny", a.pid)
        before = {t.number: t.values for t in trials_of(storage, "tiny") if t.state in FINISHED}
        os.kill(a.pid, signal.SIGKILL)
        a.wait(timeout=30)
    finally:
        if a.poll() is None:
            a.kill()
    summary = search(study, storage=storage, trials=trials, threads=1)
    after = trials_of(storage, "tiny")
    by_number = {t.number: t for t in after}
    finished = [t for t in after if t.state in FINISHED]
    assert summary.counts.finished == trials == len(finished)
    assert by_number[victim.number].state == TrialState.FAIL
    retries = [t for t in finished if t.system_attrs.get("failed_trial") == victim.number]
    assert len(retries) == 1, "the killed trial is retried exactly once"
    killed = by_number[victim.number]
    assert killed.params and {k: retries[0].params[k] for k in killed.params} == killed.params
    for number, values in before.items():  # every finished trial is still there, unchanged
        assert by_number[number].state in FINISHED and by_number[number].values == values
    assert not [t for t in after if t.state in (TrialState.RUNNING, TrialState.WAITING)]


def search_grid(folder: Path, spec: dict, trials: int) -> list[optuna.trial.FrozenTrial]:
    """`spec`'s choices searched on a grid through the search API (5 training steps a trial,
    no pruner) until `trials` trials complete; the stored trials."""
    from miras.search import search

    train = {"steps": 5, "batch_size": 8, "lr": 3.0e-3, "warmup": 1, "eval_every": 5,
             "eval_batches": 1}  # fmt: skip
    study = write_study(
        folder, spec=spec, train=train, sampler="grid", pruner="none", trials=trials
    )
    storage = f"sqlite:///{folder / 's.db'}"
    summary = search(study, storage=storage, threads=1)
    assert summary.counts.complete == trials
    return trials_of(storage, "tiny")
