"""The grid sampler (miras.search.grid_sampler, `sampler: grid`): the size of a template's grid,
conditional parameters counted per option, float ranges and over-budget trials refused, and every
configuration tried once, by an Optuna study and by `miras search`."""

from __future__ import annotations

import optuna
import pytest
import yaml

from miras.search import StudyError, load_study, search
from miras.search.space import sample
from miras.search.storage import SearchError, make_sampler
from tests.search_support import TINY, trials_of

# The 2 x 2 space of the tiny study (bias x chunk_size), with a fixed learning rate.
TWO_BY_TWO = {**TINY, "train": {**TINY["train"], "lr": 3.0e-3}, "sampler": "grid"}
TWO_BY_TWO.pop("trials")


def _study(**changes):
    return load_study({**TWO_BY_TWO, **changes})


def _configurations(study, trials: int) -> list[tuple]:
    """What `trials` trials of the study's sampler draw, on in-memory storage (no training)."""
    handle = optuna.create_study(sampler=make_sampler(study, seed=0))
    drawn = []

    def objective(trial):
        spec, train = sample(study.spec_space, trial), sample(study.train_space, trial)
        drawn.append((spec["bias"], spec["model"]["chunk_size"], train["lr"]))
        return 0.0

    handle.optimize(objective, n_trials=trials)
    return drawn


def test_the_trials_default_to_the_grid_and_each_configuration_is_tried_once():
    study = _study()
    assert study.grid_size == 4 and study.trials == 4
    drawn = _configurations(study, study.trials)
    expected = {(bias, chunk, 3.0e-3) for bias in ("l2", "dot") for chunk in (16, 32)}
    assert sorted(drawn) == sorted(expected)


def test_a_parameter_of_one_option_is_gridded_under_that_option_only():
    """bias l2, or lp with p 1.5 or 3: three configurations, not 2 x 2, each drawn once."""
    lp = {"kind": "lp", "p": {"choices": [1.5, 3.0]}}
    study = _study(spec={**TINY["spec"], "bias": {"choices": ["l2", lp]}, "model": _one_chunk()})
    assert study.grid_size == 3 and study.trials == 3
    drawn = _configurations(study, 3)
    labels = sorted(b if isinstance(b, str) else f"{b['kind']}{b['p']}" for b, _, _ in drawn)
    assert labels == ["l2", "lp1.5", "lp3.0"]


def _one_chunk():
    return {**TINY["spec"]["model"], "chunk_size": 16}


@pytest.mark.parametrize(
    ("bounds", "size"), [({"int": [1, 3]}, 3), ({"int": [16, 48], "step": 16}, 3)]
)
def test_an_int_range_is_gridded_value_by_value(bounds, size):
    study = _study(
        spec={**TINY["spec"], "bias": "l2", "model": {**_one_chunk(), "d_model": bounds}}
    )
    assert study.grid_size == size == study.trials


def test_a_float_range_is_refused_with_its_field_named():
    train = {**TINY["train"], "lr": {"float": [1.0e-3, 1.0e-2], "log": True}}
    with pytest.raises(StudyError) as caught:
        _study(train=train)
    (problem,) = caught.value.problems
    assert problem.path == "train.lr"
    assert "float range" in problem.message and "choices" in problem.message


def test_trials_beyond_the_grid_are_refused_and_fewer_are_kept():
    with pytest.raises(StudyError) as caught:
        _study(trials=5)
    (problem,) = caught.value.problems
    assert problem.path == "trials" and "4 configurations" in problem.message
    assert _study(trials=3).trials == 3


def test_miras_search_on_a_grid_runs_every_configuration(tmp_path):
    path = tmp_path / "tiny.yaml"  # not write_study: its trials would override the grid's
    path.write_text(yaml.safe_dump(TWO_BY_TWO, sort_keys=False))
    storage = f"sqlite:///{tmp_path / 'grid.db'}"
    summary = search(path, storage=storage, threads=1)
    assert summary.counts.finished == 4
    found = {(t.params["bias"], t.params["model.chunk_size"]) for t in trials_of(storage, "tiny")}
    assert found == {("l2", 16), ("l2", 32), ("dot", 16), ("dot", 32)}


def test_a_trials_override_beyond_the_grid_is_refused(tmp_path):
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(TWO_BY_TWO, sort_keys=False))
    with pytest.raises(SearchError, match="the grid has 4 configurations"):
        search(path, storage=f"sqlite:///{tmp_path / 'grid.db'}", trials=5, threads=1)
    assert not (tmp_path / "grid.db").exists()  # refused before any storage is made
