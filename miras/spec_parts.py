"""`SpecParts`: a spec as the modules below `miras.spec` read it, by what it offers.

`miras.spec` holds the components, and the components call analyses of the compiler while a
spec is validated and compiled (a custom bias's slope: `miras.compiler.affine`; the Bregman
and f-divergence retentions: `miras.compiler.retention_derive`). So those analyses, the
derivation's renderer (`miras.compiler.describe`) and the hooks of a component that read the
whole spec (the exact optimizer's `spec_problems` and `whole_step_lines`) name the spec by this
Protocol, never by `miras.spec.Spec`, not even for annotations: the imports then run one way,
spec -> components -> analyses -> IR. A `Spec` is a `SpecParts`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, Protocol

if TYPE_CHECKING:  # the component bases import nothing of the spec or the analyses above them
    from miras.components.base import Bias, FeatureMap, Memory, Optimizer, Retention


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
    def memory(self) -> Memory: ...
    @property
    def feature_map(self) -> FeatureMap: ...
    @property
    def bias(self) -> Bias: ...
    @property
    def retention(self) -> Retention: ...
    @property
    def optimizer(self) -> Optimizer: ...
    @property
    def window(self) -> WindowParts: ...
    def digest(self) -> str: ...


__all__ = ["SpecParts", "WindowParts"]
