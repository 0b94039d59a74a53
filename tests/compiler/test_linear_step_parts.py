"""The Protocols `miras.derive.linear_step` reads a spec by (`StepParts`, `StepRetention`,
`StepOptimizer`).

The component bases ask that module for an optimizer's proved update, so it names neither
`miras.spec` nor `miras.components.base`, not even for annotations. No type checker runs in the
tests, so these check that every component of the catalogue, and a spec, offer each member the
Protocols name.
"""

from __future__ import annotations

import pytest

from miras.components import CATALOGUE
from miras.derive.protocols import StepOptimizer, StepParts, StepRetention
from miras.spec import Spec


def _members(protocol: type) -> set[str]:
    """The members a Protocol declares (its own, not `Protocol`'s machinery)."""
    return {name for name in vars(protocol) if not name.startswith("_")}


@pytest.mark.parametrize(
    ("family", "protocol"), [("retention", StepRetention), ("optimizer", StepOptimizer)]
)
def test_every_component_offers_what_the_analysis_reads(family, protocol):
    assert CATALOGUE[family]
    for kind, cls in CATALOGUE[family].items():
        missing = sorted(m for m in _members(protocol) if not _offers(cls, m))
        assert not missing, f"{family} {kind} lacks {missing}"


def _offers(cls: type, member: str) -> bool:
    """A pydantic field (the kind) or a class attribute or method."""
    return member in cls.model_fields or hasattr(cls, member)


def test_a_spec_offers_the_two_components():
    assert _members(StepParts) == {"retention", "optimizer"} <= set(Spec.model_fields)
