"""studies/quickstart.yaml (`make demo`) and studies/quickstart_unmarked.yaml: the quickstart's
four options are the published rules its header names (three of them the shipped specs, RetNet
with its fixed decay), and the unmarked study is the quickstart without the query marker, for
two of its rules; a cut-down run (a few steps, one seed) trains every option."""

from __future__ import annotations

import optuna
import pytest
import yaml

from miras.search import load_study, search
from miras.spec import load_spec
from tests.search_support import ROOT

QUICKSTART = ROOT / "studies" / "quickstart.yaml"
UNMARKED = ROOT / "studies" / "quickstart_unmarked.yaml"
# label -> the shipped spec whose rule it is, with these fields replaced.
SHIPPED = {
    "deltanet": ("deltanet", {}),
    "linear_attention": ("linear_attention", {}),
    "retnet": ("retnet", {"retention": {"kind": "l2", "decay": 0.96875}}),  # 1 - 2^-5, fixed
    "gla": ("retnet", {}),  # the shipped retnet spec's gated decay is simple GLA's
}

pytestmark = pytest.mark.usefixtures("one_thread")


def rule_fields(spec) -> dict:
    """The rule's part of a spec's normal form: without its name, description and model."""
    normal = load_spec(spec).normalized()
    return {k: v for k, v in normal.items() if k not in ("name", "description", "model")}


def options(path) -> dict:
    raw = yaml.safe_load(path.read_text())
    return {
        o["label"]: {k: v for k, v in o.items() if k != "label"} for o in raw["spec"]["choices"]
    }


def test_each_option_is_the_published_rule_its_label_names():
    found = options(QUICKSTART)
    assert list(found) == list(SHIPPED)
    for label, (name, replaced) in SHIPPED.items():
        shipped = yaml.safe_load((ROOT / "specs" / f"{name}.yaml").read_text()) | replaced
        assert rule_fields({**found[label], "name": label}) == rule_fields(shipped), label
    assert len({str(o["model"]) for o in found.values()}) == 1  # one model for all four


def test_the_unmarked_study_is_the_quickstart_without_the_marker():
    marked, unmarked = (yaml.safe_load(p.read_text()) for p in (QUICKSTART, UNMARKED))
    assert marked["task"]["options"]["query_marker"] is True
    assert unmarked["task"]["options"] == {**marked["task"]["options"], "query_marker": False}
    for key in ("train", "replicates", "objectives", "sampler", "pruner"):
        assert unmarked[key] == marked[key], key
    both = options(QUICKSTART)
    assert options(UNMARKED) == {k: both[k] for k in ("deltanet", "linear_attention")}


def test_a_quick_run_trains_every_option(tmp_path):
    raw = yaml.safe_load(QUICKSTART.read_text())
    raw["train"] |= {"steps": 4, "warmup": 1, "eval_every": 2, "batch_size": 4, "eval_batches": 1}
    raw["replicates"] = 1
    assert load_study(raw).grid_size == len(SHIPPED)
    storage = f"sqlite:///{tmp_path / 'quickstart.db'}"
    summary = search(raw, storage=storage)
    assert summary.counts.complete == len(SHIPPED), summary.counts
    trials = optuna.load_study(study_name="quickstart", storage=storage).get_trials()
    assert sorted(t.params["spec"] for t in trials) == sorted(SHIPPED)
    assert all(0 <= t.user_attrs["metrics"]["accuracy"] <= 1 for t in trials)
