"""Sweeps inside a trial (`train: {lr: {sweep: [...]}}`): the grid, its validation, the point
chosen on validation and reported on the test split, the per-(point, seed) records a retried
trial resumes from, and the pruner fed by the first run only."""

from __future__ import annotations

import optuna
import pytest
import torch
from optuna.distributions import CategoricalDistribution
from optuna.trial import TrialState, create_trial

from miras.search import StudyError, load_study, open_storage, open_study, search
from miras.search import objective as objective_module
from miras.search.objective import run_trial
from miras.search.report import leaderboard
from miras.search.space import grid, parse
from miras.search.study import resolve_directions
from miras.stats import confidence_interval
from tests.search_support import TINY

FIXED_SPEC = {**TINY["spec"], "bias": {"choices": ["l2"]}, "model": {**TINY["spec"]["model"]}}
FIXED_SPEC["model"]["chunk_size"] = 16


def swept(name: str = "sweep", **changes):
    train = {**TINY["train"], "lr": {"sweep": [1.0e-3, 3.0e-3, 1.0e-2]}, "steps": 10}
    data = {**TINY, "name": name, "spec": FIXED_SPEC, "train": train, "replicates": 2}
    return {**data, "pruner": "none", **changes}


def test_several_sweeps_form_their_product_in_template_order():
    node, problems = parse(
        {"lr": {"sweep": [1, 2]}, "steps": 5, "weight_decay": {"sweep": [0.0, 0.1]}}, "train"
    )
    assert not problems
    assert grid(node) == [
        {"lr": 1, "weight_decay": 0.0},
        {"lr": 1, "weight_decay": 0.1},
        {"lr": 2, "weight_decay": 0.0},
        {"lr": 2, "weight_decay": 0.1},
    ]
    study = load_study(swept(train={**swept()["train"], "weight_decay": {"sweep": [0, 0.1]}}))
    assert len(study.sweep_points) == 6 and study.sweeps
    assert not load_study(TINY).sweeps and load_study(TINY).sweep_points == [{}]


def test_a_bad_sweep_names_every_problem_with_its_path():
    train = {
        **TINY["train"],
        "lr": {"sweep": [1.0e-3, "fast", 1.0e-3]},
        "weight_decay": {"sweep": []},
        "grad_clip": {"sweep": [{"choices": [1, 2]}], "extra": 1},
        "seed": {"sweep": [0, 1]},
    }
    spec = {**FIXED_SPEC, "retention": {"sweep": ["none", "l2"]}}
    with pytest.raises(StudyError) as caught:
        load_study(swept(train=train, spec=spec))
    paths = {p.path: p.message for p in caught.value.problems}
    assert "appears twice" in paths["train.lr.sweep[2]"]
    assert "train.lr.sweep[1]" in paths  # not a number: checked like a fixed lr
    assert "non-empty list" in paths["train.weight_decay.sweep"]
    assert "fixed value" in paths["train.grad_clip.sweep[0]"]
    assert "unknown key of a sweep" in paths["train.grad_clip.extra"]
    assert "replicates" in paths["train.seed"]
    assert "train: settings only" in paths["spec.retention"]


def test_a_sweep_grid_holds_at_most_64_points():
    train = {
        **TINY["train"],
        "lr": {"sweep": [1e-4 * (i + 1) for i in range(9)]},
        "weight_decay": {"sweep": [0.01 * i for i in range(8)]},
    }
    with pytest.raises(StudyError) as caught:
        load_study(swept(train=train))
    (problem,) = caught.value.problems
    assert problem.path == "train" and "72 points (lr 9 x weight_decay 8)" in problem.message
    assert "at most 64" in problem.message


# Validation and test values per (lr, seed) that tell the two splits apart: lr 3e-3 has the
# best validation mean, lr 1e-2 the best test mean; lr 1e-3 and 3e-3 tie on validation in
# TIED (the earlier point wins).
VALID = {(1e-3, 0): 0.50, (1e-3, 1): 0.60, (3e-3, 0): 0.80, (3e-3, 1): 0.70}
VALID |= {(1e-2, 0): 0.40, (1e-2, 1): 0.30}
TEST = {(1e-3, 0): 0.45, (1e-3, 1): 0.55, (3e-3, 0): 0.71, (3e-3, 1): 0.69}
TEST |= {(1e-2, 0): 0.99, (1e-2, 1): 0.98}


class FakeRuns:
    """sweep_run with known numbers: counts its calls and which one may prune."""

    def __init__(self, valid=VALID, test=TEST):
        self.valid, self.test = valid, test
        self.calls: list[tuple[float, int, bool]] = []

    def __call__(self, study, task, trial, spec, args, prunes):
        key = (args["lr"], args["seed"])
        self.calls.append((*key, prunes))
        measures = {"params": 10.0, "throughput": 1.0}
        valid = {"accuracy": self.valid[key], "loss": 1.0, **measures}
        test = {"accuracy": self.test[key], "accuracy_n8": self.test[key] - 0.1, **measures}
        return valid, test


def test_the_point_is_chosen_on_validation_and_reported_on_test(monkeypatch):
    runs = FakeRuns()
    monkeypatch.setattr(objective_module, "sweep_run", runs)
    definition = resolve_directions(load_study(swept()))
    trial = optuna.create_study(direction="maximize").ask()
    value = run_trial(definition, definition.make_task(), trial)
    assert [(lr, seed) for lr, seed, _ in runs.calls] == list(VALID)
    assert trial.user_attrs["selected"] == {"point": 1, "values": {"lr": 3e-3}, "valid": 0.75}
    assert value == pytest.approx((0.71 + 0.69) / 2), "the test mean at lr 3e-3, not 0.985"
    records = trial.user_attrs["replicates"]
    assert [r["metrics"]["accuracy"] for r in records] == [0.71, 0.69]
    assert trial.user_attrs["metrics"]["accuracy_n8"] == pytest.approx((0.61 + 0.59) / 2)
    assert trial.user_attrs["metrics"]["valid_accuracy"] == pytest.approx(0.75)
    assert trial.user_attrs["metrics"]["state_bytes"] > 0
    assert trial.user_attrs["train"]["lr"] == 3e-3
    sweep = trial.user_attrs["sweep"]
    assert [(r["point"], r["seed"]) for r in sweep] == [(p, s) for p in range(3) for s in (0, 1)]
    assert sweep[5]["valid"]["accuracy"] == 0.30 and sweep[5]["test"]["accuracy"] == 0.98
    # The interval is over the seeds of the test metric at the selected point.
    frozen = optuna.trial.create_trial(
        state=TrialState.COMPLETE, values=[value], user_attrs=trial.user_attrs
    )
    frozen.number = 0
    row = leaderboard([frozen], ["accuracy"], ["maximize"]).iloc[0]
    _, low, high = confidence_interval([0.71, 0.69])
    assert row["accuracy_low"] == pytest.approx(low)
    assert row["accuracy_high"] == pytest.approx(high)
    assert row["train.lr"] == 3e-3


def test_a_tie_on_validation_goes_to_the_earlier_point(monkeypatch):
    tied = {**VALID, (3e-3, 0): 0.50, (3e-3, 1): 0.60}
    monkeypatch.setattr(objective_module, "sweep_run", FakeRuns(valid=tied))
    definition = resolve_directions(load_study(swept()))
    trial = optuna.create_study(direction="maximize").ask()
    assert run_trial(definition, definition.make_task(), trial) == pytest.approx(0.5)
    assert trial.user_attrs["selected"]["point"] == 0


def test_a_minimized_objective_selects_the_lowest_validation_mean(monkeypatch):
    monkeypatch.setattr(objective_module, "sweep_run", FakeRuns())
    definition = resolve_directions(
        load_study(swept(objectives=[{"metric": "accuracy", "direction": "minimize"}]))
    )
    trial = optuna.create_study(direction="minimize").ask()
    assert run_trial(definition, definition.make_task(), trial) == pytest.approx(0.985)
    assert trial.user_attrs["selected"]["point"] == 2


def test_only_the_first_point_and_seed_report_to_the_pruner(monkeypatch):
    runs = FakeRuns()
    monkeypatch.setattr(objective_module, "sweep_run", runs)
    definition = resolve_directions(load_study(swept()))
    run_trial(definition, definition.make_task(), optuna.create_study().ask())
    assert [prunes for *_, prunes in runs.calls] == [True] + [False] * 5


def test_a_diverged_point_is_not_selected(monkeypatch):
    runs = FakeRuns()

    def diverging(study, task, trial, spec, args, prunes):
        if args["lr"] == 3e-3 and args["seed"] == 1:
            raise objective_module.SeedDiverged("training loss is nan at step 3")
        return runs(study, task, trial, spec, args, prunes)

    monkeypatch.setattr(objective_module, "sweep_run", diverging)
    definition = resolve_directions(load_study(swept()))
    trial = optuna.create_study(direction="maximize").ask()
    assert run_trial(definition, definition.make_task(), trial) == pytest.approx(0.5)
    assert trial.user_attrs["selected"]["point"] == 0
    assert trial.user_attrs["reason"] == "1 of 3 sweep points diverged"
    assert "diverged" in trial.user_attrs["sweep"][3]["valid"]


def test_a_retried_trial_runs_only_the_points_it_lacks(tmp_path, monkeypatch):
    """A killed worker's trial kept three (point, seed) runs; its retry runs the other three."""
    storage = f"sqlite:///{tmp_path / 'sweep.db'}"
    definition = load_study(swept())
    rdb = open_storage(storage, 1, 3)
    handle = open_study(definition, rdb, "sweep")
    kept = []
    for (lr, seed), point in zip(list(VALID)[:3], (0, 0, 1), strict=True):
        record = {"point": point, "values": {"lr": lr}, "seed": seed}
        record["valid"] = {"accuracy": VALID[lr, seed], "params": 10.0}
        record["test"] = {"accuracy": TEST[lr, seed], "params": 10.0}
        kept.append({**record, "seconds": 1.0})
    handle.add_trial(
        create_trial(
            state=TrialState.FAIL,
            params={"bias": "l2"},
            distributions={"bias": CategoricalDistribution(["l2"])},
            user_attrs={"sweep": kept},
        )
    )
    rdb.get_heartbeat_stale_trial_callback()(handle, handle.get_trials()[0])
    runs = FakeRuns()
    monkeypatch.setattr(objective_module, "sweep_run", runs)
    search(swept(), storage=storage, trials=1)
    assert [(lr, seed) for lr, seed, _ in runs.calls] == list(VALID)[3:], "only the missing"
    retry = [t for t in handle.get_trials() if t.system_attrs.get("failed_trial") == 0]
    assert len(retry) == 1 and retry[0].state == TrialState.COMPLETE
    assert retry[0].user_attrs["sweep"][:3] == kept
    assert retry[0].values == [pytest.approx(0.70)]


def test_a_tiny_sweep_trains_scores_the_test_split_and_stops_early():
    """Real training: each (point, seed) run is scored on validation and on the test split
    (MQAR's test grid: one slice per pair count), early stopping on by default."""
    options = {**TINY["task"]["options"], "test_grid": [[32, 2], [32, 4]]}
    data = swept(task={"name": "mqar", "options": options}, replicates=1)
    data["train"] = {**data["train"], "lr": {"sweep": [1.0e-3, 1.0e-2]}}
    definition = resolve_directions(load_study(data))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        trial = optuna.create_study(direction="maximize").ask()
        value = run_trial(definition, definition.make_task(), trial)
    finally:
        torch.set_num_threads(threads)
    runs = trial.user_attrs["sweep"]
    assert [(r["point"], r["seed"]) for r in runs] == [(0, 0), (1, 0)]
    for run in runs:
        assert {"accuracy", "loss"} <= set(run["valid"]) and "accuracy_n2" not in run["valid"]
        assert {"accuracy", "accuracy_n2", "accuracy_n4"} <= set(run["test"])
        assert run["test"]["params"] == run["valid"]["params"]
    chosen = trial.user_attrs["selected"]["point"]
    assert value == pytest.approx(runs[chosen]["test"]["accuracy"])
    assert trial.user_attrs["train"]["early_stop"] == 0.99
