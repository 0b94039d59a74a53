"""Replicated trials: each configuration over several seeds, the mean as its value, a 95% t
interval and Welch's test against the best in the report, and no seed run twice or skipped
when a study resumes or a stale trial is retried."""

from __future__ import annotations

import math
import random

import optuna
import pytest
import torch
from optuna.distributions import CategoricalDistribution, FloatDistribution
from optuna.trial import TrialState, create_trial
from scipy import stats

from miras.search import load_study, open_storage, open_study, search
from miras.search.objective import run_trial
from miras.search.report import (
    export_text,
    leaderboard,
    pick_trial,
    significance_data,
    write_report,
)
from miras.search.study import resolve_directions
from miras.stats import welch_p
from tests.search_support import TINY


def replicated(number: int, seeds: list[float]):
    trial = create_trial(
        state=TrialState.COMPLETE,
        values=[sum(seeds) / len(seeds)],
        user_attrs={
            "replicates": [
                {"seed": s, "metrics": {"accuracy": v}, "seconds": 1.0} for s, v in enumerate(seeds)
            ]
        },
    )
    trial.number = number
    return trial


CONSTRUCTED = {
    0: [0.90, 0.92, 0.91],  # the best mean
    1: [0.89, 0.93, 0.90],  # within the noise of the best
    2: [0.60, 0.62, 0.61],  # far below it
    3: [0.70, 0.95, 0.40],  # below on average, but too noisy to tell
}


def test_interval_and_significance_from_the_stored_seeds():
    trials = [replicated(n, seeds) for n, seeds in CONSTRUCTED.items()]
    board = leaderboard(trials, ["accuracy"], ["maximize"]).set_index("trial")
    for number, seeds in CONSTRUCTED.items():
        n = len(seeds)
        mean = sum(seeds) / n
        sd = math.sqrt(sum((v - mean) ** 2 for v in seeds) / (n - 1))
        half = stats.t.ppf(0.975, n - 1) * sd / math.sqrt(n)
        row = board.loc[number]
        assert row["accuracy"] == pytest.approx(mean) and row["seeds"] == n
        # The t quantiles are tabulated to six decimals: the half-width to 1e-6 relative.
        assert row["accuracy"] - row["accuracy_low"] == pytest.approx(half, rel=1e-6)
        assert row["accuracy_high"] - row["accuracy"] == pytest.approx(half, rel=1e-6)
        if number != 0:
            welch = stats.ttest_ind(seeds, CONSTRUCTED[0], equal_var=False).pvalue
            assert row["p_vs_best"] == pytest.approx(welch, rel=1e-9)
    assert math.isnan(board.loc[0, "p_vs_best"])
    assert board["differs"].to_dict() == {0: False, 1: False, 2: True, 3: False}
    assert board["rank"].to_dict() == {0: 1, 1: 2, 3: 3, 2: 4}
    # Minimizing, trial 2 is the best and everything else differs from it but trial 3.
    tests = significance_data(trials, "accuracy", "minimize").set_index("trial")
    assert tests["differs"].to_dict() == {0: True, 1: True, 2: False, 3: False}


def test_welch_p_matches_scipy_and_handles_no_spread():
    rng = random.Random(3)
    for _ in range(50):
        a = [rng.gauss(0, rng.uniform(0.1, 2)) for _ in range(rng.randint(2, 9))]
        b = [rng.gauss(rng.uniform(-2, 2), rng.uniform(0.1, 2)) for _ in range(rng.randint(2, 9))]
        expected = stats.ttest_ind(a, b, equal_var=False).pvalue
        assert welch_p(a, b) == pytest.approx(expected, rel=1e-9, abs=1e-300)
    assert welch_p([0.5, 0.5], [0.7, 0.7]) == 0.0
    assert welch_p([0.7, 0.7], [0.7, 0.7]) == 1.0
    with pytest.raises(ValueError, match="at least 2 values per side"):
        welch_p([0.5], [0.5, 0.6])


def tiny(**changes) -> dict:
    train = {**TINY["train"], "steps": 10}
    return {**TINY, "name": "rep", "train": train, "replicates": 2, **changes}


def test_a_replicated_study_stores_each_seed_and_resumes_without_duplicates(tmp_path):
    storage = f"sqlite:///{tmp_path / 'rep.db'}"
    search(tiny(), storage=storage, trials=2)
    first = {
        t.number: t.user_attrs["replicates"]
        for t in optuna.load_study(study_name="rep", storage=storage).get_trials()
    }
    summary = search(tiny(), storage=storage, trials=3)  # resume: one more trial
    assert summary.counts.finished == 3
    handle = optuna.load_study(study_name="rep", storage=storage)
    trials = handle.get_trials()
    for t in trials:
        # A trial the pruner stopped during its first seed finished no seed.
        records = t.user_attrs.get("replicates", [])
        expected = [0, 1] if t.state == TrialState.COMPLETE else []
        assert [r["seed"] for r in records] == expected, "train.seed + r, each once"
        if t.number in first:
            assert records == first[t.number], "a resumed study leaves finished trials alone"
        if t.state == TrialState.COMPLETE:
            seeds = [r["metrics"]["accuracy"] for r in records]
            assert t.values == [pytest.approx(sum(seeds) / 2)]
            assert t.user_attrs["metrics"]["accuracy"] == pytest.approx(sum(seeds) / 2)
            assert sorted(t.intermediate_values) == [5, 10]
    best = pick_trial(trials, ["maximize"])
    assert best.values[0] == max(t.values[0] for t in trials if t.state == TrialState.COMPLETE)
    header = export_text(best, load_study(tiny()), "rep", "best.yaml")
    assert "# Means over seeds 0, 1; the run trains seed 0 (--seed S)." in header
    report = write_report(handle, load_study(tiny()), tmp_path / "report")
    assert "seeds" in report.leaderboard and "accuracy_low" in report.leaderboard
    # The pruner starts after 2 finished trials: the first two are complete.
    assert [t.state for t in trials[:2]] == [TrialState.COMPLETE] * 2
    assert report.figures[0] == "accuracy: mean and 95% interval over the seeds"


def test_a_retried_trial_runs_only_the_seeds_it_lacks(tmp_path):
    """A stale trial's retry (the callback the storage installs, RetryHeartbeatStaleTrialCallback)
    inherits the seeds recorded before the worker died; only the missing seed trains."""
    storage = f"sqlite:///{tmp_path / 'retry.db'}"
    definition = load_study(tiny(name="retry"))
    rdb = open_storage(storage, 1, 3)
    handle = open_study(definition, rdb, "retry")
    done = {"loss": 9.0, "accuracy": 0.125, "throughput": 1.0, "params": 1.0}  # a marker
    params = {"bias": "l2", "model.chunk_size": 16, "train.lr": 0.005}
    distributions = {
        "bias": CategoricalDistribution(["l2", "dot"]),
        "model.chunk_size": CategoricalDistribution([16, 32]),
        "train.lr": FloatDistribution(1e-3, 1e-2, log=True),
    }
    handle.add_trial(
        create_trial(
            state=TrialState.FAIL,
            params=params,
            distributions=distributions,
            user_attrs={"replicates": [{"seed": 0, "metrics": done, "seconds": 1.0}]},
        )
    )
    rdb.get_heartbeat_stale_trial_callback()(handle, handle.get_trials()[0])
    search(tiny(name="retry"), storage=storage, trials=1)
    retry = [t for t in handle.get_trials() if t.system_attrs.get("failed_trial") == 0]
    assert len(retry) == 1 and retry[0].state == TrialState.COMPLETE
    records = retry[0].user_attrs["replicates"]
    assert [r["seed"] for r in records] == [0, 1]
    assert records[0]["metrics"] == done, "seed 0 was not run again"
    assert records[1]["metrics"]["accuracy"] != done["accuracy"]
    assert retry[0].values == [pytest.approx((0.125 + records[1]["metrics"]["accuracy"]) / 2)]


def test_only_the_first_seed_reports_to_the_pruner():
    definition = resolve_directions(load_study(tiny(replicates=3)))
    trial = optuna.create_study(direction="maximize").ask()
    reported = []
    trial.report = lambda value, step: reported.append((step, value))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as a search worker trains: tiny models are fastest on one
    try:
        value = run_trial(definition, definition.make_task(), trial)
    finally:
        torch.set_num_threads(threads)
    records = trial.user_attrs["replicates"]
    assert [r["seed"] for r in records] == [0, 1, 2]
    first = records[0]["metrics"]["accuracy"]
    assert [step for step, _ in reported] == [5, 10] and reported[-1][1] == first
    assert value == pytest.approx(sum(r["metrics"]["accuracy"] for r in records) / 3)
