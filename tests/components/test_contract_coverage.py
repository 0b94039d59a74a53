"""Every registered component kind has its contract class: each family of the catalogue
(`miras.components.CATALOGUE`) has a contract suite, and each kind in it a subclass of that
suite naming an instance of the kind (docs/architecture.md, "The layout").

The suites and the modules that hold their subclasses are listed here, so the answer does not
depend on which other test modules a run happened to import.
"""

from __future__ import annotations

from typing import Literal

from miras.components import CATALOGUE
from miras.components.base import Component, Memory
from miras.components.memory.nonparametric import NonparametricMemory
from miras.registry import registered
from tests.compiler.test_bias import BiasContract
from tests.compiler.test_retention import RetentionContract
from tests.components.test_component_contracts import (
    FeatureMapContract,
    MemoryContract,
    OptimizerContract,
)

# family -> (the contract suite, the class attribute its subclasses set to an instance)
SUITES: dict[str, tuple[type, str]] = {
    "memory": (MemoryContract, "memory"),
    "feature_map": (FeatureMapContract, "feature_map"),
    "bias": (BiasContract, "bias"),
    "retention": (RetentionContract, "retention"),
    "optimizer": (OptimizerContract, "optimizer"),
}
# Where the subclasses live: a suite's subclass elsewhere counts once its module is named here.
MODULES = {
    "tests.compiler.test_bias",
    "tests.compiler.test_retention",
    "tests.components.test_component_contracts",
}
# Kinds the suite does not fit, each with the test that holds it instead.
EXEMPT: dict[type, str] = {
    NonparametricMemory: (
        "tests/components/test_component_contracts.py::"
        "test_nonparametric_memory_is_a_closed_form (a closed form: no weights to step)"
    ),
}


def _subclasses(base: type) -> list[type]:
    found, todo = [], list(base.__subclasses__())
    while todo:
        cls = todo.pop()
        found.append(cls)
        todo.extend(cls.__subclasses__())
    return found


def covered(family: str) -> set[type]:
    """The component classes that the family's contract subclasses (in MODULES) name."""
    base, field = SUITES[family]
    return {
        type(getattr(cls, field))
        for cls in _subclasses(base)
        if cls.__module__ in MODULES and isinstance(getattr(cls, field, None), Component)
    }


def uncovered() -> dict[str, list[str]]:
    """family -> the registered kinds with no contract class and no exemption."""
    missing = {
        family: [
            kind for kind, cls in kinds.items() if cls not in covered(family) and cls not in EXEMPT
        ]
        for family, kinds in CATALOGUE.items()
    }
    return {family: kinds for family, kinds in missing.items() if kinds}


def test_every_family_has_a_contract_suite():
    assert set(SUITES) == set(CATALOGUE)


def test_every_registered_kind_has_a_contract_class():
    """A new component joins its family's suite by subclassing it; this names any left out."""
    assert uncovered() == {}, (
        f"no contract class for {uncovered()}: subclass the family's suite "
        f"({', '.join(f'{f}: {b.__name__}' for f, (b, _) in SUITES.items())}) in one of "
        f"{sorted(MODULES)}"
    )


def test_exemptions_are_registered_kinds():
    """An exemption outlives its kind only as a failure here."""
    registered_classes = {cls for kinds in CATALOGUE.values() for cls in kinds.values()}
    assert set(EXEMPT) <= registered_classes


class _Uncontracted(Memory):
    """A memory registered for the test below, with no contract class."""

    kind: Literal["uncontracted"] = "uncontracted"


def test_a_kind_registered_without_a_contract_class_is_named():
    """The counterpart: the check above is not vacuous."""
    assert "uncontracted" not in CATALOGUE["memory"]
    with registered(_Uncontracted):
        assert uncovered() == {"memory": ["uncontracted"]}
    assert uncovered() == {}
