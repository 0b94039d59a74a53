"""miras.registry: a component class of one's own joins the catalogue and specs accept its kind,
until it is taken out again; bad classes are refused with what to fix."""

from __future__ import annotations

from typing import Literal

import pytest

from miras.components import CATALOGUE, MEMORIES, MLPMemory
from miras.components.base import Component
from miras.errors import SpecError
from miras.registry import register, registered, unregister
from miras.spec import load_spec


class WideMLP(MLPMemory):
    """An MLP memory under a kind of its own."""

    kind: Literal["wide_mlp"] = "wide_mlp"


def test_a_registered_kind_is_accepted_then_refused_again():
    with pytest.raises(SpecError, match="unknown memory kind 'wide_mlp'"):
        load_spec({"name": "w", "memory": "wide_mlp"})
    with registered(WideMLP):
        assert MEMORIES["wide_mlp"] is WideMLP
        spec = load_spec({"name": "w", "memory": {"kind": "wide_mlp", "depth": 3}})
        assert type(spec.memory) is WideMLP and spec.memory.depth == 3
        with pytest.raises(SpecError, match=r"allowed kinds: .*nonparametric, wide_mlp"):
            load_spec({"name": "w", "memory": "wide_mpl"})
    assert "wide_mlp" not in CATALOGUE["memory"]
    with pytest.raises(SpecError, match="unknown memory kind 'wide_mlp'"):
        load_spec({"name": "w", "memory": "wide_mlp"})


def test_a_taken_kind_is_refused():
    class OtherMLP(MLPMemory):
        kind: Literal["mlp"] = "mlp"

    with pytest.raises(ValueError, match="memory kind 'mlp' is taken by MLPMemory; taken kinds"):
        register(OtherMLP)
    with pytest.raises(ValueError, match="OtherMLP is not the registered memory 'mlp'"):
        unregister(OtherMLP)
    assert MEMORIES["mlp"] is MLPMemory


def test_a_class_that_is_not_a_kind_is_refused():
    with pytest.raises(ValueError, match="expected a Component subclass, got <class 'int'>"):
        register(int)

    class Loose(Component):
        kind: Literal["loose"] = "loose"

    with pytest.raises(ValueError, match="Loose has no family"):
        register(Loose)

    class Unnamed(MLPMemory):
        kind: str = "unnamed"

    with pytest.raises(ValueError, match=r"Unnamed.kind must be one Literal string"):
        register(Unnamed)
