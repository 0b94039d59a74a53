"""Does a sweep bracket its selection? The logspace sweep form (`{logspace: [lo, hi, n],
extend, max_extend}`) and its validation; the edge mark of a trial whose selected point lies at
the lowest or highest value of a numeric sweep; `extend: true`, which runs the values past
that edge until the selection is bracketed or `max_extend` is reached, resumably; and the
mark in the leaderboard, the summary table and the report."""

from __future__ import annotations

import pytest
from search_support import TINY

from miras.search import StudyError, load_study
from miras.search.space import grid, logspace_value, parse

FIXED_SPEC = {**TINY["spec"], "bias": {"choices": ["l2"]}, "model": {**TINY["spec"]["model"]}}
FIXED_SPEC["model"]["chunk_size"] = 16


def study_with(lr, name: str = "edges", replicates: int = 2, **train):
    """The tiny study, its spec fixed, with `lr` as the train section's lr (a sweep)."""
    settings = {**TINY["train"], "steps": 10, "lr": lr, **train}
    data = {**TINY, "name": name, "spec": FIXED_SPEC, "train": settings}
    return {**data, "replicates": replicates, "pruner": "none"}


def problems_of(data) -> dict[str, str]:
    with pytest.raises(StudyError) as caught:
        load_study(data)
    return {p.path: p.message for p in caught.value.problems}


# ---------------------------------------------------------------------------------------------
# The logspace form


def test_a_logspace_gives_n_values_from_lo_to_hi_on_a_log_scale():
    node, problems = parse({"lr": {"sweep": {"logspace": [1.0e-4, 1.0e-2, 4]}}}, "train")
    assert not problems
    values = [point["lr"] for point in grid(node)]
    # 1e-4 x 100 ** (i / 3): the ends exactly as written, the ratio 100 ** (1/3) = 4.6416.
    assert values[0] == 1.0e-4 and values[3] == 1.0e-2
    assert values[1:3] == pytest.approx([4.6415888e-4, 2.1544347e-3], rel=1e-7)
    sweep = node.fields["lr"]
    assert (sweep.extend, sweep.max_extend, sweep.logspace) == (False, 0, (1.0e-4, 1.0e-2, 4))
    # Past the ends the same ratio goes on: one step below lo, one above hi.
    assert sweep.value_at(-1) == pytest.approx(1.0e-4 / 100 ** (1 / 3), rel=1e-12)
    assert sweep.value_at(4) == pytest.approx(1.0e-2 * 100 ** (1 / 3), rel=1e-12)
    assert logspace_value((1.0, 8.0, 4), 1) == pytest.approx(2.0, rel=1e-12)


def test_extend_defaults_to_three_points_and_a_list_sweep_still_works():
    study = load_study(study_with({"sweep": {"logspace": [1.0e-3, 1.0e-2, 3], "extend": True}}))
    sweep = study.train_space.fields["lr"]
    assert sweep.extend and sweep.max_extend == 3
    assert [p["lr"] for p in study.sweep_points] == pytest.approx([1e-3, 10**-2.5, 1e-2])
    bounded = {"logspace": [1.0e-3, 1.0e-2, 3], "extend": True, "max_extend": 10}
    assert load_study(study_with({"sweep": bounded})).train_space.fields["lr"].max_extend == 10
    off = load_study(study_with({"sweep": {"logspace": [1.0e-3, 1.0e-2, 3], "extend": False}}))
    assert not off.train_space.fields["lr"].extend
    listed = load_study(study_with({"sweep": [1.0e-3, 3.0e-3]}))
    assert listed.sweep_points == [{"lr": 1.0e-3}, {"lr": 3.0e-3}]
    assert not listed.train_space.fields["lr"].extend


def test_bad_logspace_values_are_named_with_their_path_and_the_allowed_values():
    paths = problems_of(
        study_with(
            {"sweep": {"logspace": [0, 1.0e-2, 1.5], "extend": "yes", "max_extend": 11}},
            weight_decay={"sweep": {"logspace": [0.1, 0.01, 3], "extnd": True}},
            grad_clip={"sweep": {"logspace": ["1e-3", 1.0, 2]}},
        )
    )
    assert paths["train.lr.sweep.logspace[0]"] == (
        "expected the lowest value, a number > 0 (a log scale), got 0"
    )
    assert paths["train.lr.sweep.logspace[2]"] == (
        "expected how many values, an integer from 2 to 64, got 1.5"
    )
    assert paths["train.lr.sweep.extend"] == "expected true or false, got 'yes'"
    assert paths["train.lr.sweep.max_extend"] == "expected an integer from 1 to 10, got 11"
    assert paths["train.weight_decay.sweep.logspace[1]"] == (
        "expected the highest value, a number > lo = 0.1, got 0.01"
    )
    assert paths["train.weight_decay.sweep.extnd"] == (
        "unknown key of a logspace sweep; allowed: logspace, extend, max_extend "
        "(did you mean 'extend'?)"
    )
    assert "YAML reads 1e-3 as text" in paths["train.grad_clip.sweep.logspace[0]"]


@pytest.mark.parametrize(
    ("lr", "path", "words"),
    [
        ({"sweep": {"logspace": [1.0e-3, 1.0e-2]}}, "train.lr.sweep.logspace", "[lo, hi, n]"),
        ({"sweep": {"logspace": [1.0e-3, 1.0e-2, 1]}}, "train.lr.sweep.logspace[2]", "from 2"),
        ({"sweep": {"logspace": [1.0e-3, 1.0e-2, True]}}, "train.lr.sweep.logspace[2]", "got True"),
        ({"sweep": {"logspace": [1.0e-3, 1.0e-2, 65]}}, "train.lr.sweep.logspace[2]", "to 64"),
        ({"sweep": {"logspace": [-1.0, 1.0, 3]}}, "train.lr.sweep.logspace[0]", "> 0"),
        ({"sweep": {"logspace": [1.0, 1.0, 3]}}, "train.lr.sweep.logspace[1]", "> lo = 1.0"),
        ({"sweep": {"extend": True}}, "train.lr.sweep", "needs logspace: [lo, hi, n]"),
        (
            {"sweep": {"logspace": [1.0e-3, 1.0e-2, 3], "max_extend": 2}},
            "train.lr.sweep.max_extend",
            "only with extend: true",
        ),
        (
            {"sweep": {"logspace": [1.0e-3, 1.0e-2, 3], "extend": True, "max_extend": 0}},
            "train.lr.sweep.max_extend",
            "an integer from 1 to 10, got 0",
        ),
        (
            {"sweep": [1.0e-3, 1.0e-2], "extend": True},
            "train.lr.extend",
            "extend goes inside a logspace sweep: {sweep: {logspace: [lo, hi, n], extend: true}}",
        ),
        ({"sweep": {}}, "train.lr.sweep", "needs logspace"),
        ({"sweep": 3}, "train.lr.sweep", "a non-empty list of values or {logspace: [lo, hi, n]}"),
    ],
)
def test_each_bad_sweep_form_is_one_named_problem(lr, path, words):
    paths = problems_of(study_with(lr))
    assert list(paths) == [path] and words in paths[path]


def test_the_problem_names_the_file(tmp_path):
    import yaml

    file = tmp_path / "edges.yaml"
    file.write_text(yaml.safe_dump(study_with({"sweep": {"logspace": [0, 1.0, 3]}})))
    with pytest.raises(StudyError) as caught:
        load_study(file)
    assert str(caught.value).startswith(f"{file}: 1 problem in the study")
    assert "train.lr.sweep.logspace[0]" in str(caught.value)


def test_a_logspace_sweeps_real_valued_settings_only():
    paths = problems_of(study_with(1.0e-3, steps={"sweep": {"logspace": [10, 1000, 3]}}))
    assert paths == {
        "train.steps.sweep.logspace": "a logspace gives real numbers, and steps is not one; "
        "give its values as a list ({sweep: [...]})"
    }
    # early_stop is `float | None`: a real number, so a logspace may sweep it.
    assert load_study(study_with(1.0e-3, early_stop={"sweep": {"logspace": [0.5, 0.9, 3]}}))


def test_a_logspace_of_an_unknown_setting_is_named_at_its_ends():
    # The probes check a logspace at its ends, which bracket every value between (as a
    # range's bounds do).
    paths = problems_of(study_with(1.0e-3, lr2={"sweep": {"logspace": [1.0e-3, 1.0e-2, 3]}}))
    assert list(paths) == ["train.lr2.sweep.logspace[0]", "train.lr2.sweep.logspace[1]"]
    assert "unknown setting 'lr2'" in paths["train.lr2.sweep.logspace[0]"]


def test_extension_points_count_toward_the_grid_limit():
    lr = {"sweep": {"logspace": [1.0e-4, 1.0e-2, 8], "extend": True, "max_extend": 10}}
    paths = problems_of(
        study_with(lr, weight_decay={"sweep": [0.0, 0.01, 0.1, 0.2, 0.3, 0.4, 0.5]})
    )
    assert paths["train"] == (
        "the sweeps make 56 points (lr 8 x weight_decay 7), and up to 10 more past their edges "
        "(extend); at most 64, each trained on every seed"
    )
    lr["sweep"]["max_extend"] = 8
    weights = {"sweep": [0.0, 0.01, 0.1, 0.2, 0.3, 0.4, 0.5]}
    assert load_study(study_with(lr, weight_decay=weights)), "56 + 8 = 64 points fit"
