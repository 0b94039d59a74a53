"""One validation layer: a spec, a study and a task's options report the same mistake in the
same words (miras.spec.validation): unknown fields, wrong literals, wrong types, YAML syntax errors,
keys written twice and names that are not slugs."""

from __future__ import annotations

import re

import pytest

from miras.errors import SpecError
from miras.search import StudyError, load_study
from miras.spec import load_spec
from miras.tasks import make_task
from tests.search_support import TINY


def spec_problems(source) -> list[str]:
    with pytest.raises(SpecError) as info:
        load_spec(source)
    return [str(p) for p in info.value.problems]


def study_problems(source) -> list[str]:
    with pytest.raises(StudyError) as info:
        load_study(source)
    return [str(p) for p in info.value.problems]


def task_message(name: str, **options) -> str:
    with pytest.raises(ValueError) as info:
        make_task(name, **options)
    return str(info.value)


def test_an_unknown_field_names_the_allowed_ones_and_a_near_miss():
    shape = r"unknown (field|option) '{}'; allowed \1s: [a-z_, ]+ \(did you mean '{}'\?\)"
    (spec,) = spec_problems({"name": "x", "biass": "l2"})
    assert re.fullmatch("biass: " + shape.format("biass", "bias"), spec)
    (study,) = study_problems({**TINY, "trails": 3})
    assert re.fullmatch("trails: " + shape.format("trails", "trials"), study)
    task = task_message("mqar", num_pair=3)
    assert re.fullmatch(
        "task 'mqar': option 'num_pair': " + shape.format("num_pair", "num_pairs"), task
    )


def test_a_wrong_literal_names_the_allowed_values():
    (spec,) = spec_problems({"name": "x", "model": {"variant": "lmn"}})
    assert spec == (
        "model.variant: expected one of lmm, mal, mag, mac, attention, swa, got 'lmn' "
        "(did you mean 'lmm'?)"
    )
    (study,) = study_problems({**TINY, "sampler": "tpee"})
    assert (
        study
        == "sampler.kind: expected one of tpe, nsga2, random, grid, got 'tpee' (did you mean 'tpe'?)"
    )
    task = task_message("mad", train_labels="answer")
    assert task == (
        "task 'mad': option 'train_labels': expected one of next_token, answers, got 'answer' "
        "(did you mean 'answers'?)"
    )


def test_a_wrong_type_says_what_was_expected_and_what_came():
    (spec,) = spec_problems({"name": "x", "model": {"d_model": "big"}})
    assert spec == "model.d_model: expected an integer in [1, 65536], got 'big'"  # its range too
    (study,) = study_problems({**TINY, "trials": "many"})
    assert study == "trials: expected an integer, got 'many'"
    assert task_message("mqar", seq_len="long") == (
        "task 'mqar': option 'seq_len': expected an integer, got 'long'"
    )


def test_a_bound_reads_the_same_in_a_study_and_a_task():
    (study,) = study_problems({**TINY, "trials": 0})
    assert study == "trials: expected an integer >= 1, got 0"
    assert task_message("mqar", num_pairs=0) == (
        "task 'mqar': option 'num_pairs': expected an integer >= 1, got 0"
    )


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        pytest.param("name: x\nbias: [1,\n", "invalid YAML at line 3, column 1", id="syntax"),
        pytest.param(
            "name: x\ntrials: 2\nname: y\n",
            "name: the key appears twice (first at line 1, again at line 3)",
            id="duplicate-key",
        ),
        pytest.param("", "is empty; expected a mapping of fields (name, description", id="empty"),
        pytest.param("- a\n", "the top level must be a mapping of fields (name, ", id="a-list"),
    ],
)
def test_yaml_mistakes_read_the_same_in_a_spec_and_a_study(text, problem):
    (spec,) = spec_problems(text)
    (study,) = study_problems(text)
    assert problem in spec and problem in study
    assert spec.replace("spec", "DOC").split("(")[0] == study.replace("study", "DOC").split("(")[0]


def test_a_key_twice_inside_a_list_item_is_named_with_its_index():
    text = "name: s\nobjectives:\n  - metric: accuracy\n    metric: loss\n"
    (study,) = study_problems(text)
    assert study == "objectives[0].metric: the key appears twice (first at line 3, again at line 4)"


def test_the_same_slug_rule_for_spec_and_study_names():
    (spec,) = spec_problems({"name": "has space"})
    (study,) = study_problems({**TINY, "name": "has space"})
    expected = "name: expected a slug of letters, digits, '-' and '_', got 'has space'"
    assert spec == study == expected


def test_a_missing_file_reads_the_same():
    assert spec_problems("does/not/exist.yaml") == study_problems("does/not/exist.yaml")
    assert spec_problems("does/not/exist.yaml") == ["no such file"]
