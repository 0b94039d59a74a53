"""`miras.derive.protocols.SpecParts`: the spec as the analyses below `miras.spec` read it.

The Protocol stands for `Spec` in the signatures of the modules a spec's components reach
(the affine analysis, the derivation's renderer, the exact optimizer's hooks), so that they
import nothing of `miras.spec`; each of its components is named by its family's Protocol
(`BiasParts`, ...). No type checker runs in the tests, so these check that a loaded spec
offers every member the Protocol names, each component every member of its family's Protocol,
and that every component of the catalogue does too.
"""

from __future__ import annotations

import typing
from pathlib import Path

import pytest

import miras.derive.protocols
from miras.components import CATALOGUE
from miras.derive.protocols import ComponentParts, SpecParts, WindowParts
from miras.spec import Spec, Window, load_spec

SPECS = Path(__file__).resolve().parents[2] / "specs"


def _members(protocol: type) -> dict[str, object]:
    """The members a Protocol declares (its own, not `Protocol`'s machinery)."""
    return {name: value for name, value in vars(protocol).items() if not name.startswith("_")}


def _returns(prop: property) -> object:
    """The return annotation of a Protocol's property, its TYPE_CHECKING names resolved."""
    return typing.get_type_hints(prop.fget, globalns=vars(miras.derive.protocols))["return"]


def _is_component(annotation: object) -> bool:
    return isinstance(annotation, type) and ComponentParts in annotation.__mro__


def _all_members(protocol: type) -> set[str]:
    """The members a component Protocol declares, its own and its bases'."""
    bases = [c for c in protocol.__mro__ if c is not typing.Protocol and c.__module__ != "typing"]
    return {m for c in bases if c is not object for m in _members(c)}


def _lacks(component: object, protocol: type) -> list[str]:
    return sorted(m for m in _all_members(protocol) if not hasattr(component, m))


@pytest.mark.parametrize("name", ["titans", "moneta", "mesanet"])
def test_a_spec_offers_every_part_the_protocol_names(name):
    spec = load_spec(SPECS / f"{name}.yaml")
    for member, declared in _members(SpecParts).items():
        if isinstance(declared, property):  # a field of the spec
            assert member in Spec.model_fields, member
            expected = _returns(declared)
            if _is_component(expected):  # every member of its family's Protocol
                assert not _lacks(getattr(spec, member), expected), (member, expected)
        else:  # a method of the spec
            assert callable(getattr(spec, member)), member
    parts = _members(SpecParts).items()
    components = {m for m, d in parts if isinstance(d, property) and _is_component(_returns(d))}
    assert components == set(spec.components())  # all five, each by its Protocol


def test_the_window_offers_its_size_and_weight():
    assert set(_members(WindowParts)) <= set(Window.model_fields)
    window = load_spec({"name": "w", "window": {"c": 8, "gamma": "gate"}}).window
    assert isinstance(window.c, int) and int in typing.get_args(_returns(WindowParts.c))
    gamma = typing.get_args(_returns(WindowParts.gamma))
    assert window.gamma == "gate" and typing.Literal["gate"] in gamma


@pytest.mark.parametrize("family", sorted(CATALOGUE))
def test_every_component_offers_what_its_family_protocol_names(family):
    """Each registered kind, by its class: a pydantic field (the kind) or a class attribute or
    method for every member of the Protocol its family is named by in `SpecParts`."""
    protocol = _returns(vars(SpecParts)[family])
    assert _is_component(protocol), family
    for kind, cls in CATALOGUE[family].items():
        missing = [m for m in _lacks(cls, protocol) if m not in cls.model_fields]
        assert not missing, f"{family} {kind} lacks {missing}"
