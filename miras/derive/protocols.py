"""The Protocols the modules below the spec name things by, and `GateDefaults`.

`miras.derive` sits below the components (they call its analyses while a spec validates, and
`miras.components.base` asks it for an optimizer's proved update) and below `miras.spec`, so
nothing in it names a component class or `Spec`, not even in an annotation: what it reads of a
spec or a component it names by a Protocol of this one file. A `Spec` is a `SpecParts` (and a
`StepParts`); a component of the catalogue is the Protocol of its family (`BiasParts`,
`RetentionParts`, ...). No type checker runs in the tests, so `tests/spec/test_spec_parts.py`
and `tests/compiler/test_linear_step_parts.py` hold every shipped component and a spec to the
members these name. The imports then run one way, annotations included: spec -> components ->
derive -> IR (docs/architecture.md, "The layers").

`GateDefaults` is a plain record, here for the same reason: the component bases declare it and
the IR's gate records (`miras.ir.GateInfo.defaults`) carry it without importing each other.

A leaf: it imports nothing of miras at run time, and sympy and torch only for annotations.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

if TYPE_CHECKING:  # annotations only
    import sympy as sp
    import torch

    from miras.derive.ranges import Range


@dataclass(frozen=True)
class GateDefaults:
    """How the code outside a component treats one of its gates, besides its range (the
    component's `gateable`); the component declares it in `gate_defaults`, by the gate's name.

    `start`: the natural-space value a model layer's learned gate starts at
    (`miras.models.layer.GateMaps`), a number or a function of the head index (a per-head
    schedule). `ceiling`: the upper end the layer keeps the gate below, inside a range open
    above (None: the range's own). `probe_values`: the candidates the probes' grid search tries
    (`miras.probes.gate_grid`; None: none, so a probe asks for them)."""

    start: float | Callable[[int], float] = 1.0
    ceiling: float | None = None
    probe_values: tuple[float, ...] | None = None

    def start_at(self, head: int) -> float:
        """The start of head `head`."""
        return self.start(head) if callable(self.start) else self.start


# What the linear-step analysis (`miras.derive.linear_step`) reads of a spec: the component
# bases ask it for an optimizer's proved update (`Optimizer.linear_form`). A `Spec` is a
# `StepParts`, a `Retention` a `StepRetention`, an `Optimizer` a `StepOptimizer`.


class StepRetention(Protocol):
    """A retention component, as far as its step's linearity and its state's reading go (the
    JSON of its fields keys the proof's cache)."""

    @property
    def kind(self) -> str: ...
    @property
    def gateable(self) -> Mapping[str, Range]: ...
    @property
    def simplex_rows(self) -> bool: ...
    def read_norm(self) -> float | None: ...
    def domain(self) -> str: ...
    def solved_by_newton(self) -> bool: ...
    def model_dump_json(self) -> str: ...


class StepOptimizer(Protocol):
    """An optimizer component, as far as its stated update goes (the JSON of its fields keys
    the proof's cache)."""

    @property
    def kind(self) -> str: ...
    @property
    def gateable(self) -> Mapping[str, Range]: ...
    @property
    def stateful(self) -> bool: ...
    def update_expressions(self) -> tuple[sp.Expr, sp.Expr | None] | None: ...
    def model_dump_json(self) -> str: ...


class StepParts(Protocol):
    """The two components whose composed step the analysis proves linear."""

    @property
    def retention(self) -> StepRetention: ...
    @property
    def optimizer(self) -> StepOptimizer: ...


# The five components as the analyses, the derivation's renderer and the piece checks read
# them: every member named is one the family's base class in `miras.components.base` states.


class ComponentParts(Protocol):
    """Any component: its kind, parameters, gates and fixed values, the spec's equation of it,
    and the JSON of its fields (the key a derivation is cached by, `memo.component_key`)."""

    @property
    def kind(self) -> str: ...
    def parameters(self) -> dict[str, Any]: ...
    def gates(self) -> list[str]: ...
    def fixed(self) -> dict[str, float]: ...
    def spec_equation(self) -> str: ...
    def model_dump_json(self) -> str: ...


class BiasParts(ComponentParts, Protocol):
    """An attentional bias: its loss in sympy, its name in messages, its torch oracle and its
    constant slope where it is quadratic."""

    def expression(self) -> sp.Expr: ...
    def label(self) -> str: ...
    def reference_loss(self, y: torch.Tensor, v: torch.Tensor, **scalars: Any) -> torch.Tensor: ...
    def constant_slope(self) -> tuple[float | None, str]: ...


class RetentionParts(ComponentParts, StepRetention, Protocol):
    """A retention gate: its Learning-Retaining objective, the derivation strategy, the state's
    domain and rows, its oracle read and its display lines."""

    def objective(self) -> sp.Expr: ...
    def reparameterization(self) -> dict[sp.Symbol, sp.Expr]: ...
    def derive_step(self) -> tuple[list, sp.Expr]: ...
    def derives_separably(self) -> bool: ...
    def retained_factor(self) -> str | None: ...
    def row_sum(self) -> float: ...
    def reference_read(self, state: Any) -> Any: ...
    def gradient_point_lines(self) -> list: ...
    def update_lines(self, step: Callable[[str], sp.Expr]) -> list: ...


class MemoryParts(ComponentParts, Protocol):
    """A memory: whether it is parametric and linear in its weights, its closed form, and its
    display lines."""

    @property
    def parametric(self) -> bool: ...
    @property
    def linear(self) -> bool: ...
    def closed_form(self) -> str | None: ...
    def whole_step_lines(self, spec: Any) -> list | None: ...
    def update_lines(self, window: WindowParts) -> list: ...


class OptimizerParts(ComponentParts, StepOptimizer, Protocol):
    """An optimizer: whether it preconditions, and its display lines."""

    @property
    def preconditioned(self) -> bool: ...
    def whole_step_lines(self, spec: Any) -> list | None: ...
    def update_lines(self) -> list: ...


class FeatureMapParts(ComponentParts, Protocol):
    """A feature map: what every component offers (the renderer prints it)."""


class WindowParts(Protocol):
    """The spec's window: its size c (an integer, or "global": the whole prefix) and its
    weight gamma (a number, or "gate": per token)."""

    @property
    def c(self) -> int | Literal["global"]: ...
    @property
    def gamma(self) -> float | Literal["gate"]: ...


class SpecParts(Protocol):
    """A validated spec: its name, its five components and window, and its digest."""

    @property
    def name(self) -> str: ...
    @property
    def memory(self) -> MemoryParts: ...
    @property
    def feature_map(self) -> FeatureMapParts: ...
    @property
    def bias(self) -> BiasParts: ...
    @property
    def retention(self) -> RetentionParts: ...
    @property
    def optimizer(self) -> OptimizerParts: ...
    @property
    def window(self) -> WindowParts: ...
    def digest(self) -> str: ...


__all__ = [
    "BiasParts",
    "ComponentParts",
    "FeatureMapParts",
    "GateDefaults",
    "MemoryParts",
    "OptimizerParts",
    "RetentionParts",
    "SpecParts",
    "StepOptimizer",
    "StepParts",
    "StepRetention",
    "WindowParts",
]
