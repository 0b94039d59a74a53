"""The search: study validation, conditional sampling, the trial budget, report data, and tiny
real studies on SQLite (search, resume, report, export, a killed worker, Ctrl-C, bad input)."""

from __future__ import annotations

import contextlib
import math
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
from optuna.distributions import CategoricalDistribution, FloatDistribution
from optuna.trial import TrialState, create_trial
from typer.testing import CliRunner

from miras.cli import app
from miras.search import StudyError, load_study, search
from miras.search.objective import state_size
from miras.search.report import (
    component_data,
    history_data,
    importance_data,
    leaderboard,
    parallel_data,
    pareto_data,
    pick_trial,
)
from miras.search.run import Counts, count, rank
from miras.search.space import sample
from miras.spec import load_spec
from tests.search_support import (
    ROOT,
    TINY,
    kill_scenario,
    start_worker,
    trials_of,
    wait_for_running_trial,
    write_study,
)

optuna.logging.set_verbosity(optuna.logging.WARNING)
runner = CliRunner()


def problems_of(source) -> list[str]:
    with pytest.raises(StudyError) as info:
        load_study(source)
    return [str(p) for p in info.value.problems]


# --- definitions ------------------------------------------------------------------------------


@pytest.mark.parametrize("path", sorted((ROOT / "studies").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_study_loads(path):
    study = load_study(path)
    assert study.name == path.stem
    assert path.read_text().startswith("#") and "miras search" in path.read_text()  # the header


def test_defaults_follow_the_objectives():
    single = load_study(TINY)
    assert single.directions == ["maximize"] and single.sampler_def().kind == "tpe"
    multi = load_study({**TINY, "objectives": ["accuracy", "state_size"], "pruner": None})
    assert multi.directions == ["maximize", "minimize"]
    assert multi.sampler_def().kind == "nsga2" and multi.pruner_def().kind == "none"


def test_every_problem_at_once_with_paths_and_hints():
    bad = {
        **TINY,
        "sampler": "tpee",
        "trails": 3,
        "objectives": ["acuracy"],
        "spec": {
            "memory": "matrx",
            "bias": {"choices": ["l2", "lpp", {"kind": "lp", "p": {"float": [4.0, 2.0]}}]},
            "model": {"d_model": {"int": [0, 32]}},
        },
        "train": {"steps": 20, "lr": {"float": [1.0e-3, 1.0e-2], "log": True, "stepp": 2}},
    }
    found = problems_of(bad)
    text = "\n".join(found)
    assert (
        "sampler.kind: expected one of tpe, nsga2, random, grid, got 'tpee' (did you mean 'tpe'?)"
        in text
    )
    assert "unknown field 'trails'" in text and "did you mean 'trials'" in text
    # Template problems are reported together; the objective is checked once they are fixed.
    assert (
        "spec.bias.choices[1].kind: unknown bias kind 'lpp'" in text and "did you mean 'lp'" in text
    )
    assert "spec.bias.choices[2].p.float: expected low < high, got [4.0, 2.0]" in text
    assert "train.lr.stepp: unknown key of a range" in text
    assert "write 1.0e-3" in "\n".join(
        problems_of({**TINY, "train": {"lr": {"float": ["1e-4", 0.1]}}})
    )
    assert "did you mean 'step'" in text
    fixed = {**bad, "sampler": "tpe", "spec": {**bad["spec"], "bias": "l2", "memory": "matrix"}}
    fixed.pop("trails")
    fixed["train"] = TINY["train"]
    text = "\n".join(problems_of(fixed))
    assert "spec.model.d_model.int[0]: expected an integer in [1, 65536], got 0" in text
    assert "objectives[0].metric: task mqar does not report 'acuracy'" in text
    assert "did you mean 'accuracy'" in text


def test_malformed_yaml_and_wrong_top_level():
    assert "invalid YAML at line 3" in problems_of("name: x\nspec: [1,\n")[0]
    assert "the top level must be a mapping" in problems_of("- a\n- b\n")[0]
    assert problems_of("does/not/exist.yaml") == ["no such file"]


def test_searched_combinations_are_left_to_the_trials():
    """Nonparametric memory takes only the l2 bias, so (nonparametric, lp) is impossible, but
    (matrix, lp) is fine: validation must not flag lp, the trial prunes the bad pair."""
    study = load_study(
        {
            **TINY,
            "spec": {
                "memory": {"choices": ["nonparametric", "matrix"]},
                "bias": {"choices": ["l2", {"kind": "lp", "p": 3.0}]},
            },
        }
    )
    assert study.name == "tiny"
    # A fixed memory that no option fits is flagged: it can never work.
    found = problems_of(
        {**TINY, "spec": {"memory": "nonparametric", "bias": {"choices": ["l2", "lp"]}}}
    )
    assert any(p.startswith("spec.bias.choices[1].kind: nonparametric memory") for p in found)


def test_other_study_fields():
    found = problems_of({**TINY, "objectives": ["accuracy", "state_size"]})
    assert any("pruner.kind: a study with several objectives cannot prune" in p for p in found)
    found = problems_of({**TINY, "heartbeat": {"interval": 5, "grace": 5}})
    assert any(p.startswith("heartbeat: grace (5) must exceed interval (5)") for p in found)
    assert any("spec.name" in p for p in problems_of({**TINY, "spec": {"name": "x"}}))
    found = problems_of({**TINY, "task": {"name": "mqarr"}})
    assert found == [
        "task: unknown task 'mqarr'; allowed: mqar, forgetting_mqar, continuous_mqar, mad, "
        "niah, text, parity, modular_arithmetic, group_word (did you mean 'mqar'?)"
    ]


# --- sampling -------------------------------------------------------------------------------


def test_conditional_parameters_exist_only_on_their_branch():
    study = load_study(
        {
            **TINY,
            "spec": {
                "bias": {"choices": ["l2", {"kind": "lp", "p": {"float": [2.0, 4.0]}}]},
                "retention": {"choices": ["none", {"kind": "lq", "q": {"float": [2.0, 6.0]}}]},
                "window": {
                    "choices": [1, {"label": "omega", "c": {"int": [2, 4]}, "gamma": "gate"}]
                },
            },
        }
    )
    handle = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    seen = set()
    for _ in range(40):
        trial = handle.ask()
        spec = sample(study.spec_space, trial)
        params = trial.params
        assert ("bias.lp.p" in params) == (params["bias"] == "lp")
        assert ("retention.lq.q" in params) == (params["retention"] == "lq")
        assert ("window.omega.c" in params) == (params["window"] == "omega")
        if params["bias"] == "lp":
            assert spec["bias"] == {"kind": "lp", "p": params["bias.lp.p"]}
        if params["window"] == "omega":
            assert spec["window"] == {"c": params["window.omega.c"], "gamma": "gate"}  # no label
        else:
            assert spec["window"] == 1
        load_spec({"name": "x", **spec})
        seen.add((params["bias"], params["retention"], params["window"]))
        handle.tell(trial, 0.0)
    assert len(seen) == 8  # every branch combination was reached


# --- the budget -----------------------------------------------------------------------------


def _trial(number: int, state: TrialState, value: float | None = None, **params):
    distributions = {
        name: CategoricalDistribution(["l2", "dot", "lp"])
        if isinstance(v, str)
        else FloatDistribution(0.0, 1.0)
        for name, v in params.items()
    }
    trial = create_trial(
        state=state,
        value=value if state == TrialState.COMPLETE else None,
        params=params,
        distributions=distributions,
        intermediate_values={1: value}
        if state == TrialState.PRUNED and value is not None
        else None,
    )
    trial.number = number
    return trial


def test_rank_counts_live_trials_before_a_trial():
    trials = [
        _trial(0, TrialState.COMPLETE, 0.5),
        _trial(1, TrialState.FAIL),  # a killed trial ...
        _trial(2, TrialState.PRUNED),
        _trial(3, TrialState.RUNNING),
        _trial(4, TrialState.WAITING),  # ... and its retry
        _trial(5, TrialState.RUNNING),
    ]
    assert [rank(trials, n) for n in (3, 4, 5)] == [2, 3, 4]
    assert count(trials) == Counts(complete=1, pruned=1, failed=1, running=2, waiting=1)
    assert count(trials).finished == 2 and count(trials).live == 5


# --- report data ----------------------------------------------------------------------------


def _finished_study():
    """Six finished trials: bias and x as parameters, accuracy as the objective."""
    rows = [
        ("l2", 0.1, 0.5),
        ("dot", 0.2, 0.7),
        ("l2", 0.3, 0.6),
        ("lp", 0.4, 0.9),
        ("dot", 0.5, 0.2),
    ]
    trials = [
        _trial(i, TrialState.COMPLETE, acc, bias=b, x=x) for i, (b, x, acc) in enumerate(rows)
    ]
    trials.append(_trial(5, TrialState.PRUNED, 0.1, bias="l2", x=0.6))
    for t in trials:
        t.set_user_attr("spec", f"name: t{t.number}\n")
    return trials


def test_leaderboard_and_history():
    trials = _finished_study()
    board = leaderboard(trials, ["accuracy"], ["maximize"])
    assert board["trial"].tolist() == [3, 1, 2, 0, 4, 5]
    assert board["rank"].tolist() == [1, 2, 3, 4, 5, 6] and board["state"].iloc[-1] == "pruned"
    history = history_data(trials, "maximize")
    assert history["best"].tolist() == [0.5, 0.7, 0.7, 0.9, 0.9]
    assert history_data(trials, "minimize")["best"].tolist() == [0.5, 0.5, 0.5, 0.5, 0.2]
    assert pick_trial(trials, ["maximize"]).number == 3
    assert pick_trial(trials, ["minimize"]).number == 4


def test_the_leaderboard_csv_writes_a_retry_origin_as_a_trial_number(tmp_path):
    """`retry_of` is a trial number, or empty where the trial is no retry (not 1.0 and NaN)."""
    trials = _finished_study()
    trials[3].system_attrs["failed_trial"] = 1  # trial 3 re-ran trial 1's parameters
    board = leaderboard(trials, ["accuracy"], ["maximize"])
    board.to_csv(tmp_path / "leaderboard.csv", index=False)
    lines = (tmp_path / "leaderboard.csv").read_text().splitlines()
    column = lines[0].split(",").index("retry_of")
    assert [line.split(",")[column] for line in lines[1:]] == ["1", "", "", "", "", ""]


def test_parallel_component_importance_and_pareto_data():
    trials = _finished_study()
    dims = {d.name: d for d in parallel_data(trials, "accuracy")}
    assert list(dims) == ["bias", "x", "accuracy"]
    assert dims["bias"].values == [0.0, 1.0, 0.0, 2.0, 1.0] and dims["bias"].labels == [
        "l2",
        "dot",
        "lp",
    ]
    boxes = component_data(trials)
    assert list(boxes) == ["bias"]
    assert sorted(boxes["bias"].groupby("option")["value"].count().items()) == [
        ("dot", 2),
        ("l2", 2),
        ("lp", 1),
    ]
    importance = importance_data(trials, ["maximize"])
    assert set(importance["parameter"]) <= {"bias", "x"} and not importance.empty
    assert math.isclose(importance["importance"].sum(), 1.0)
    two = []
    for i, values in enumerate([(0.9, 100), (0.8, 50), (0.7, 80), (0.95, 400)]):
        two.append(create_trial(state=TrialState.COMPLETE, values=list(values)))
        two[-1].number = i
    front = pareto_data(two, ["accuracy", "state_size"], ["maximize", "minimize"])
    assert front["pareto"].tolist() == [True, True, False, True]


def test_state_size_of_memories_and_variants():
    def size(**fields):
        model = {"d_model": 32, "n_heads": 2, "n_layers": 2}
        model.update(fields.pop("model", {}))
        return state_size(load_spec({"name": "x", "model": model, **fields}), seq_len=128)

    assert size() == 2 * 2 * 16 * 16  # layers x heads x W [Dv, Dk]
    assert size(optimizer="momentum") == 2 * size()  # W and the momentum S
    assert size(window={"c": 4}) == size() + 2 * 3 * 2 * 16 * 2  # the last c - 1 keys and values
    assert size(model={"variant": "attention"}) == 2 * 128 * 2 * 32  # a full KV cache
    assert size(model={"variant": "swa", "swa_window": 16}) == 2 * 16 * 2 * 32


# --- tiny real studies on SQLite ------------------------------------------------------------


def invoke(*args, cwd: Path):
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(cwd)
        return runner.invoke(app, [str(a) for a in args])


@pytest.mark.slow  # worker processes, 30 s or more on 2 cores
def test_tiny_study_search_resume_report_export(tmp_path):
    from miras.training.recipe import train

    study = write_study(tmp_path)
    result = invoke("search", study, cwd=tmp_path)  # default: one thread
    assert result.exit_code == 0, result.output
    assert "study tiny: 3 finished" in result.stdout
    db = tmp_path / "runs" / "tiny.db"
    trials = trials_of(f"sqlite:///{db}", "tiny")
    finished = [t for t in trials if t.state in (TrialState.COMPLETE, TrialState.PRUNED)]
    assert len(finished) == 3 and len(trials) == 3
    for t in finished:
        assert t.user_attrs["train"]["steps"] == 20
        if t.state == TrialState.COMPLETE:
            assert set(t.user_attrs["metrics"]) >= {"loss", "accuracy", "state_size", "throughput"}
            assert load_spec(t.user_attrs["spec"]).name == f"tiny-t{t.number}"

    # The same command resumes: the study already holds 3; one more is asked for with --trials.
    again = invoke("search", study, "--threads", "1", "--trials", "4", cwd=tmp_path)
    assert again.exit_code == 0 and "study tiny: 4 finished" in again.stdout
    assert len(trials_of(f"sqlite:///{db}", "tiny")) == 4

    report = invoke("report", study, "-o", tmp_path / "report", cwd=tmp_path)
    assert report.exit_code == 0, report.output
    html = (tmp_path / "report" / "report.html").read_text()
    assert 'data-figures="' in html and "Plotly.newPlot" in html
    assert "cdn.plot.ly" not in html.split("</script>", 1)[1]  # plotly.js is inline, not linked
    csv = (tmp_path / "report" / "leaderboard.csv").read_text().splitlines()
    assert len(csv) == 1 + 4 and csv[0].startswith("rank,trial,state,accuracy")

    out = tmp_path / "best.yaml"
    exported = invoke("export", study, "--best", "-o", out, cwd=tmp_path)
    assert exported.exit_code == 0, exported.output
    text = out.read_text()
    assert text.startswith("# Trial ") and "miras train" in text
    spec = load_spec(out)
    assert spec.model.d_model == 16
    result = train(
        spec,
        study_task(),
        steps=3,
        batch_size=4,
        warmup=1,
        eval_every=3,
        eval_batches=1,
        progress=False,
    )
    assert math.isfinite(result.metrics["loss"])


def study_task():
    from miras.tasks import make_task

    return make_task("mqar", **TINY["task"]["options"])


def test_impossible_combination_is_pruned_with_its_reason(tmp_path):
    # nonparametric memory is softmax attention: the MAL hybrid needs a parametric memory.
    study = write_study(
        tmp_path,
        spec={
            "memory": "nonparametric",
            "model": {"d_model": 16, "n_layers": 1, "variant": {"choices": ["mal"]}},
        },
        trials=1,
    )
    summary = search(study, storage=f"sqlite:///{tmp_path / 's.db'}", threads=1)
    assert summary.counts.pruned == 1
    (trial,) = trials_of(f"sqlite:///{tmp_path / 's.db'}", "tiny")
    assert (
        trial.user_attrs["reason"].startswith("invalid: ")
        and "variant" in trial.user_attrs["reason"]
    )


def test_a_study_made_from_another_definition_is_not_resumed(tmp_path):
    study = write_study(tmp_path, trials=1)
    storage = f"sqlite:///{tmp_path / 's.db'}"
    search(study, storage=storage, threads=1)
    changed = write_study(tmp_path, objectives=["loss"], trials=1)
    result = invoke("search", changed, "--storage", storage, cwd=tmp_path)
    assert result.exit_code == 1 and "made from another definition" in result.stderr
    assert "--name" in result.stderr and "Traceback" not in result.output


def test_the_next_hint_after_a_named_search_reports_that_study(tmp_path):
    """`search --name X` stores study X; the printed `next:` command must name it, or it
    reports the YAML's name, which this storage does not hold."""
    study = write_study(tmp_path, objectives=["state_size"], trials=1)  # no training
    storage = f"sqlite:///{tmp_path / 's.db'}"
    result = invoke("search", study, "--storage", storage, "--name", "other", cwd=tmp_path)
    assert result.exit_code == 0, result.output
    (hint,) = [line for line in result.stdout.splitlines() if line.startswith("next:")]
    assert hint == f"next: miras report {study} --storage {storage} --name other"
    command = hint.removeprefix("next: miras ").split()
    report = invoke(*command, "-o", tmp_path / "report", cwd=tmp_path)
    assert report.exit_code == 0, report.output


@pytest.mark.slow  # worker processes, 30 s or more on 2 cores
def test_workers_flag_shares_one_sqlite_file(tmp_path):
    """`--workers 2`: two spawned processes on one SQLite file (WAL journal, lock waits)."""
    study = write_study(tmp_path, name="flag")
    worker = start_worker(study, f"sqlite:///{tmp_path / 'flag.db'}", 4, "--workers", "2")
    _, stderr = worker.communicate(timeout=300)
    assert worker.returncode == 0, stderr
    found = trials_of(f"sqlite:///{tmp_path / 'flag.db'}", "flag")
    finished = [t for t in found if t.state in (TrialState.COMPLETE, TrialState.PRUNED)]
    assert len(finished) == 4
    # Both processes ran trials. A worker that lost the race for the last slot leaves one more
    # trial, failed 'over budget' before it ran (so with no worker named): not counted.
    assert len({t.user_attrs["worker"] for t in finished}) == 2
    for t in found:
        if t not in finished:
            assert t.state == TrialState.FAIL
            assert t.user_attrs["reason"].startswith("over budget"), t.user_attrs


@pytest.mark.slow  # worker processes, 30 s or more on 2 cores
def test_killed_worker_on_sqlite(tmp_path):
    study = write_study(tmp_path, train={**TINY["train"], "steps": 60})
    kill_scenario(study, f"sqlite:///{tmp_path / 'kill.db'}", trials=3)


@pytest.mark.slow  # worker processes, 30 s or more on 2 cores
def test_ctrl_c_marks_the_running_trial_and_keeps_the_storage(tmp_path):
    study = write_study(tmp_path, train={**TINY["train"], "steps": 200})
    storage = f"sqlite:///{tmp_path / 'int.db'}"
    worker = start_worker(study, storage, 2)
    victim = wait_for_running_trial(storage, "tiny", worker.pid)
    worker.send_signal(signal.SIGINT)
    _, stderr = worker.communicate(timeout=60)
    assert worker.returncode == 130, stderr
    assert "interrupted" in stderr and "Traceback" not in stderr
    trial = {t.number: t for t in trials_of(storage, "tiny")}[victim.number]
    assert trial.state == TrialState.FAIL and trial.user_attrs["reason"] == "interrupted (Ctrl-C)"
    with sqlite3.connect(tmp_path / "int.db") as db:
        assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)


def test_a_worker_whose_parent_is_gone_interrupts_itself_as_sigterm_would(monkeypatch):
    """The watch compares os.getppid() with the pid it was given: a different one means the
    search process exited and the worker was adopted."""
    from miras.search import run

    watch = run._ParentWatch(parent=os.getppid() + 1_000_000, interval=0.01, patience=60)
    try:
        with pytest.raises(run.Terminated), run._Interrupts():
            watch.start()
            time.sleep(5)  # interrupted long before this ends
    finally:
        watch.stop()
        watch.thread.join(timeout=5)
    assert not watch.thread.is_alive()
    assert run._interrupt_reason(run.Terminated()) == "interrupted (SIGTERM)"
    assert run._interrupt_reason(KeyboardInterrupt()) == "interrupted (Ctrl-C)"
    monkeypatch.setattr(run, "_search_process", os.getppid() + 1_000_000)
    assert run._interrupt_reason(run.Terminated()) == "interrupted (the search process exited)"


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc (Linux)")
def test_the_parent_death_signal_is_set_on_linux():
    """PR_SET_PDEATHSIG, read back with PR_GET_PDEATHSIG in a child that sets it."""
    code = (
        "import ctypes, signal; from miras.search.run import _signal_on_parent_death as s; "
        "assert s(signal.SIGTERM); got = ctypes.c_int(); "
        "ctypes.CDLL(None).prctl(2, ctypes.byref(got), 0, 0, 0); print(got.value)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) == signal.SIGTERM


def _workers_of(pid: int) -> list[int]:
    """The spawned worker processes of `pid` (not multiprocessing's resource tracker)."""
    path = Path(f"/proc/{pid}/task/{pid}/children")
    children = [int(c) for c in path.read_text().split()] if path.exists() else []
    return [c for c in children if b"spawn_main" in _cmdline(c)]


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except FileNotFoundError:
        return b""


def _alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in status  # a zombie has exited


@pytest.mark.slow  # worker processes, about 40 s on 2 cores
@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads /proc (Linux)")
@pytest.mark.parametrize("kill", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_workers_end_with_the_search_process_and_their_trials_run_again(tmp_path, kill):
    """`miras search --workers 2` killed with SIGTERM (forwarded to the workers) or SIGKILL
    (the workers get the parent-death signal): no worker is left, each running trial is failed
    and queued again with its parameters, and a second run completes the study with them."""
    study = write_study(tmp_path, train={**TINY["train"], "steps": 60}, pruner="none")
    storage = f"sqlite:///{tmp_path / 'orphan.db'}"
    search_process = start_worker(study, storage, 2, "--workers", "2")
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while len(workers := _workers_of(search_process.pid)) < 2:
            assert time.monotonic() < deadline, "the workers did not start"
            time.sleep(0.1)
        for worker in workers:
            wait_for_running_trial(storage, "tiny", worker)
        running = [t for t in trials_of(storage, "tiny") if t.state == TrialState.RUNNING]
        search_process.send_signal(kill)
        # The workers share the search process's pipes: reading them to their end (every writer
        # gone) both keeps the workers from blocking on a full pipe and waits for them.
        try:
            _, stderr = search_process.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            raise AssertionError("the workers outlived the search process") from None
        deadline = time.monotonic() + 10  # closed pipes; the exit itself follows at once
        while [w for w in workers if _alive(w)] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [w for w in workers if _alive(w)], "workers left running"
    finally:
        if search_process.poll() is None:
            search_process.kill()
            search_process.communicate(timeout=30)
        for w in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(w, signal.SIGKILL)
    if kill == signal.SIGTERM:
        assert search_process.returncode == 143, stderr
        assert "interrupted (SIGTERM)" in stderr and "Traceback" not in stderr
        reasons = {"interrupted (SIGTERM)"}
    else:
        # The parent-death signal is SIGTERM; it can come while the dying process still holds
        # its pid (its other threads exit after), so the worker may not see it gone yet.
        assert search_process.returncode == -signal.SIGKILL
        reasons = {"interrupted (SIGTERM)", "interrupted (the search process exited)"}
    assert len(running) == 2
    trials = trials_of(storage, "tiny")
    by_number = {t.number: t for t in trials}
    for victim in running:
        assert by_number[victim.number].state == TrialState.FAIL
        assert by_number[victim.number].user_attrs.get("reason") in reasons, stderr[-2000:]
        (queued,) = [t for t in trials if t.system_attrs.get("failed_trial") == victim.number]
        assert queued.state == TrialState.WAITING and queued.params == victim.params

    summary = search(study, storage=storage, trials=2, threads=1)
    assert summary.counts.complete == 2 and summary.counts.retried == 2
    retries = [t for t in summary.trials if t.state == TrialState.COMPLETE]
    assert sorted(t.system_attrs["failed_trial"] for t in retries) == sorted(
        v.number for v in running
    )
    for retry in retries:
        assert retry.params == by_number[retry.system_attrs["failed_trial"]].params
    assert not [t for t in summary.trials if t.state in (TrialState.RUNNING, TrialState.WAITING)]


# --- bad input at the command line ----------------------------------------------------------


def test_bad_input_gets_one_clear_message(tmp_path):
    malformed = tmp_path / "malformed.yaml"
    malformed.write_text("name: x\nspec: {bias: l2\n")
    unknown = write_study(tmp_path, name="unknown", spec={"bias": {"choices": ["l2", "huberr"]}})
    cases = [
        (("search", malformed), "invalid YAML at line"),
        (("search", unknown), "spec.bias.choices[1].kind: unknown bias kind 'huberr'"),
        (
            (
                "search",
                write_study(tmp_path),
                "--storage",
                "postgresql://miras:secret@127.0.0.1:9/none",
            ),
            "storage: cannot open postgresql://miras:***@127.0.0.1:9/none",
        ),
        (
            ("search", write_study(tmp_path), "--storage", "nonsense"),
            "storage: cannot parse 'nonsense'",
        ),
        (("report", "nothing-here"), "storage: no such file runs/nothing-here.db"),
        (
            ("export", write_study(tmp_path), "-o", tmp_path / "x.yaml"),
            "give exactly one of --best",
        ),
    ]
    for args, message in cases:
        result = invoke(*args, cwd=tmp_path)
        assert result.exit_code in (1, 2), (args, result.output)
        assert message in result.stderr, (args, result.stderr)
        assert "Traceback" not in result.output and "secret" not in result.output
        assert result.stderr.count("error:") == 1


def test_report_of_a_study_without_complete_trials(tmp_path):
    from miras.search.report import write_report

    handle = optuna.create_study(direction="maximize", study_name="empty")
    handle.add_trial(_trial(0, TrialState.PRUNED, 0.1, bias="l2"))
    handle.add_trial(create_trial(state=TrialState.FAIL))
    report = write_report(handle, load_study(TINY), tmp_path)
    assert report.figures == [] and "no complete trial yet" in report.notes[0]
    assert len(report.leaderboard) == 1 and report.html.read_text().count("<h2>") == 1
