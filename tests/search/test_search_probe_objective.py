"""Probes as study objectives: a study over the bare rule runs end to end with no training, each
trial's value is the probe's own number on the trial's spec, and bad probe objectives are
reported with their paths."""

from __future__ import annotations

import optuna
import pytest
from optuna.trial import TrialState

from miras.probes import capacity
from miras.rule import compile as compile_rule
from miras.search import StudyError, load_study, search
from miras.search.report import leaderboard
from miras.search.study import resolve_directions
from miras.spec import load_spec
from tests.search_support import TINY

CAPACITY = {"d_k": 4, "trials": 4, "seeds": 2, "pair_counts": [2, 4, 8]}


def probe_study(**changes) -> dict:
    spec = {**TINY["spec"], "memory": {"choices": ["matrix", "nonparametric"]}, "bias": "l2"}
    spec["retention"] = {"choices": ["none", "l2"]}
    return {
        **TINY,
        "name": "probe",
        "spec": spec,
        "objectives": [{"probe": "capacity", "options": CAPACITY}, "state_bytes", "params"],
        "pruner": "none",
        "trials": 5,
        **changes,
    }


def test_a_probe_study_runs_end_to_end_without_training(tmp_path):
    storage = f"sqlite:///{tmp_path / 'probe.db'}"
    summary = search(probe_study(replicates=2), storage=storage)
    assert summary.counts.finished == 5
    trials = optuna.load_study(study_name="probe", storage=storage).get_trials()
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    assert complete, "some trial sampled a matrix memory"
    for t in complete:
        spec = load_spec(t.user_attrs["spec"])
        rule = compile_rule(spec)
        records = t.user_attrs["replicates"]
        assert [r["seed"] for r in records] == [0, 1]
        for record in records:
            # Replicate seed s moves the probe's tuning seed to s * (seeds + 1).
            direct = capacity(rule, **CAPACITY, seed=record["seed"] * 3)
            expected = sum(p.mean for p in direct.points) / len(direct.points)
            assert record["metrics"]["capacity"] == pytest.approx(expected, rel=1e-12)
        assert t.values[0] == pytest.approx(sum(r["metrics"]["capacity"] for r in records) / 2)
        assert "throughput" not in t.user_attrs["metrics"], "nothing was trained"
        assert not t.intermediate_values
    for t in trials:
        if t.state == TrialState.PRUNED:
            assert t.params["memory"] == "nonparametric"
            assert "parametric memory" in t.user_attrs["reason"]
    definition = resolve_directions(load_study(probe_study()))
    assert definition.directions == ["minimize", "minimize", "minimize"]
    board = leaderboard(trials, definition.metrics, definition.directions)
    assert {"capacity_low", "capacity_high", "seeds", "pareto", "p_vs_best"} <= set(board)
    sized = board[board["state"] == "complete"]  # a size is the same on every seed
    assert (sized["state_bytes_low"] == sized["state_bytes"]).all()
    assert (sized["state_bytes_high"] == sized["state_bytes"]).all()


def test_bad_probe_objectives_are_named():
    with pytest.raises(StudyError) as caught:
        load_study(probe_study(objectives=[{"probe": "capacty"}]))
    assert "objectives[0].probe: unknown probe 'capacty'" in str(caught.value)
    assert "did you mean 'capacity'" in str(caught.value)
    with pytest.raises(StudyError) as caught:
        load_study(probe_study(objectives=[{"probe": "recency", "options": {"lenght": 8}}]))
    assert "objectives[0].options.lenght: probe recency takes no option 'lenght'" in str(
        caught.value
    )
    with pytest.raises(StudyError) as caught:
        load_study(probe_study(objectives=[{"probe": "capacity"}, {"probe": "capacity"}]))
    assert "a metric appears twice" in str(caught.value)
    named = load_study(
        probe_study(objectives=[{"probe": "capacity"}, {"probe": "capacity", "name": "cap2"}])
    )
    assert named.metrics == ["capacity", "cap2"]
    with pytest.raises(StudyError, match="only a probe objective takes options"):
        load_study(probe_study(objectives=[{"metric": "accuracy", "options": {"d_k": 4}}]))
    with pytest.raises(StudyError, match="is a recall error: minimize"):
        load_study(probe_study(objectives=[{"probe": "capacity", "direction": "maximize"}]))
