"""studies/delta_family.yaml: fla's delta family as baselines (issue 39). Its options are the
shipped specs of the same labels, field for field, and a cut-down run of the study (a few
steps, one seed) finishes every configuration with each trial's spec the shipped one; the full
budget is the file's (its header: the command and the measured time)."""

from __future__ import annotations

import optuna
import pytest
import yaml
from optuna.trial import TrialState

from miras.search import load_study, search
from miras.spec import load_spec
from tests.search_support import ROOT

STUDY = ROOT / "studies" / "delta_family.yaml"
BASELINES = ["gated_deltanet", "kda", "gdn2", "precond_gdn", "ttt_linear", "titans_linear"]

pytestmark = pytest.mark.usefixtures("one_thread")


def rule_fields(spec) -> dict:
    """The rule's part of a spec's normal form: without its name, description and model."""
    normal = load_spec(spec).normalized()
    return {k: v for k, v in normal.items() if k not in ("name", "description", "model")}


def test_each_option_is_the_shipped_spec_of_its_label():
    options = yaml.safe_load(STUDY.read_text())["spec"]["choices"]
    assert [o["label"] for o in options] == BASELINES
    for option in options:
        fields = {k: v for k, v in option.items() if k != "label"}
        shipped = ROOT / "specs" / f"{option['label']}.yaml"
        assert rule_fields({**fields, "name": option["label"]}) == rule_fields(shipped), shipped


def test_a_quick_run_trains_every_baseline(tmp_path):
    """Six steps, one seed: each of the six configurations once (the grid), every trial
    complete with a finite accuracy, its parameter named `spec`, its spec the shipped one."""
    raw = yaml.safe_load(STUDY.read_text())
    raw["train"] |= {"steps": 6, "warmup": 1, "eval_every": 3, "batch_size": 8, "eval_batches": 1}
    raw["replicates"] = 1
    assert load_study(raw).grid_size == len(BASELINES)
    storage = f"sqlite:///{tmp_path / 'delta_family.db'}"
    summary = search(raw, storage=storage)
    assert summary.counts.complete == len(BASELINES), summary.counts
    trials = optuna.load_study(study_name="delta_family", storage=storage).get_trials()
    assert sorted(t.params["spec"] for t in trials) == sorted(BASELINES)
    for t in trials:
        assert t.state == TrialState.COMPLETE and 0 <= t.values[0] <= 1
        shipped = ROOT / "specs" / f"{t.params['spec']}.yaml"
        assert rule_fields(t.user_attrs["spec"]) == rule_fields(shipped)
