"""`miras.spec_parts.SpecParts`: the spec as the analyses below `miras.spec` read it.

The Protocol stands for `Spec` in the signatures of the modules a spec's components reach
(the affine analysis, the derivation's renderer, the exact optimizer's hooks), so that they
import nothing of `miras.spec`. No type checker runs in the tests, so these check that a
loaded spec offers every member the Protocol names, each component of the base class the
Protocol states.
"""

from __future__ import annotations

import typing
from pathlib import Path

import pytest

import miras.spec_parts
from miras.components import base
from miras.spec import Spec, Window, load_spec
from miras.spec_parts import SpecParts, WindowParts

SPECS = Path(__file__).resolve().parents[2] / "specs"


def _members(protocol: type) -> dict[str, object]:
    """The members a Protocol declares (its own, not `Protocol`'s machinery)."""
    return {name: value for name, value in vars(protocol).items() if not name.startswith("_")}


def _returns(prop: property) -> object:
    """The return annotation of a Protocol's property, its TYPE_CHECKING names resolved."""
    names = {**vars(miras.spec_parts), **vars(base)}
    return typing.get_type_hints(prop.fget, globalns=names)["return"]


def _is_component(annotation: object) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, base.Component)


@pytest.mark.parametrize("name", ["titans", "moneta", "mesanet"])
def test_a_spec_offers_every_part_the_protocol_names(name):
    spec = load_spec(SPECS / f"{name}.yaml")
    for member, declared in _members(SpecParts).items():
        if isinstance(declared, property):  # a field of the spec
            assert member in Spec.model_fields, member
            expected = _returns(declared)
            if _is_component(expected):  # of its kind's base class
                assert isinstance(getattr(spec, member), expected), (member, expected)
        else:  # a method of the spec
            assert callable(getattr(spec, member)), member
    parts = _members(SpecParts).items()
    components = {m for m, d in parts if isinstance(d, property) and _is_component(_returns(d))}
    assert components == set(spec.components())  # all five, each as its base class


def test_the_window_offers_its_size_and_weight():
    assert set(_members(WindowParts)) <= set(Window.model_fields)
    window = load_spec({"name": "w", "window": {"c": 8, "gamma": "gate"}}).window
    assert isinstance(window.c, int) and int in typing.get_args(_returns(WindowParts.c))
    gamma = typing.get_args(_returns(WindowParts.gamma))
    assert window.gamma == "gate" and typing.Literal["gate"] in gamma
