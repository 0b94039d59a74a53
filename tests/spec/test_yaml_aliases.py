"""The YAML layer (miras/spec/validation.py) bounds the work of reading a file: aliases are counted
on the composed node graph, never expanded, and deep nesting is refused with a SpecError."""

from __future__ import annotations

import time

import pytest

from miras.errors import SpecError
from miras.search.study import StudyError, load_study
from miras.spec import load_spec
from miras.spec.validation import MAX_YAML_DEPTH, MAX_YAML_NODES

SPEC = "name: bomb\nmemory: matrix\nbias: l2\nretention: none\noptimizer: {kind: gd, lr: gate}\n"


def alias_bomb(levels: int, use: str = "description") -> str:
    """`a_i: &a_i [*a_(i-1)] * 10` for i = 1..levels, used once: 10**levels nodes expanded."""
    lines = ['a0: &a0 "lol"']
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, levels + 1)]
    return "\n".join(lines) + f"\n{use}: *a{levels}\n"


def refused(load, text: str, error=SpecError) -> tuple[str, float]:
    start = time.perf_counter()
    with pytest.raises(error) as info:
        load(text)
    return str(info.value), time.perf_counter() - start


@pytest.mark.parametrize("levels", [7, 9])
def test_an_alias_bomb_in_a_spec_is_refused_quickly(levels):
    # Before: the duplicate-key walk expanded every alias (7 levels: 6 s, 470 MB; 9 hung).
    message, seconds = refused(load_spec, SPEC + alias_bomb(levels))
    assert f"at most {MAX_YAML_NODES}" in message and "aliases" in message
    assert "a4:" in message  # the first field that is too large on its own: 11111 nodes
    assert seconds < 1.0


def test_an_alias_bomb_in_a_study_is_refused_quickly():
    study = "name: s\nspec: specs/deltanet.yaml\n" + alias_bomb(9, use="search")
    message, seconds = refused(load_study, study, StudyError)
    assert f"at most {MAX_YAML_NODES}" in message
    assert seconds < 1.0


def test_aliases_that_stay_small_are_read():
    # An anchor reused a few times is ordinary YAML: read, and the duplicate-key walk still
    # reports a key written twice inside the anchored mapping (once, at its first path).
    text = SPEC.replace("bias: l2\n", "") + "x: &b {kind: l2, kind: l2}\nbias: *b\n"
    message, _ = refused(load_spec, text)
    assert "x.kind: the key appears twice" in message
    assert "bias.kind" not in message  # the same node again, through the alias
    spec = load_spec(SPEC.replace("bias: l2", "bias: &b l2") + "description: *b\n")
    assert spec.description == "l2"


def test_a_self_referencing_alias_is_counted_once():
    message, seconds = refused(load_spec, SPEC + "description: &a [*a]\n")
    assert "description: expected text" in message and seconds < 1.0


@pytest.mark.parametrize("depth", [MAX_YAML_DEPTH + 1, 3000])
def test_deep_nesting_is_refused(depth):
    # 3000 levels made PyYAML's recursive composer raise a raw RecursionError.
    message, seconds = refused(load_spec, SPEC + "description: " + "[" * depth + "]" * depth)
    assert f"at most {MAX_YAML_DEPTH} levels" in message and seconds < 1.0
