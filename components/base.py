"""The abstract base of each kind of component, and the typed fields they share.

A component is a frozen pydantic model: its fields are the spec's parameters (validated before
anything runs), its methods state the math in sympy. A field that may be a data-dependent gate
takes either the word "gate" (the layer supplies it per token) or a fixed number.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

import sympy as sp
import torch
from pydantic import BaseModel, ConfigDict, PlainValidator, WithJsonSchema

from miras.formula import did_you_mean
from miras.symbols import gate_symbol


@dataclass(frozen=True)
class Range:
    """An interval of allowed values, printed the way the math writes it: (0, 1]."""

    lo: float = -math.inf
    hi: float = math.inf
    lo_closed: bool = False
    hi_closed: bool = False

    def __contains__(self, value: float) -> bool:
        above = value >= self.lo if self.lo_closed else value > self.lo
        below = value <= self.hi if self.hi_closed else value < self.hi
        return above and below

    def __str__(self) -> str:
        left = "[" if self.lo_closed else "("
        right = "]" if self.hi_closed else ")"
        lo = "-inf" if self.lo == -math.inf else f"{self.lo:g}"
        hi = "inf" if self.hi == math.inf else f"{self.hi:g}"
        return f"{left}{lo}, {hi}{right}"


POSITIVE = Range(0, math.inf)
UNIT = Range(0, 1, hi_closed=True)  # a decay factor a_t in (0, 1]
HALF_OPEN_UNIT = Range(0, 1, lo_closed=True)  # a momentum factor theta_t in [0, 1)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def gate_or(allowed: Range) -> Any:
    """A field that is "gate" (data-dependent, per token) or a fixed number in `allowed`."""

    def check(value: Any) -> str | float:
        if value == "gate":
            return "gate"
        if not _is_number(value):
            hint = did_you_mean(value, ["gate"]) if isinstance(value, str) else ""
            raise ValueError(f"expected 'gate' or a number in {allowed}, got {value!r}{hint}")
        if value not in allowed or math.isnan(value):
            raise ValueError(f"expected a number in {allowed} or 'gate', got {value!r}")
        return float(value)

    schema = {"anyOf": [{"const": "gate"}, {"type": "number"}]}
    return Annotated[Literal["gate"] | float, PlainValidator(check), WithJsonSchema(schema)]


def number(allowed: Range, integer: bool = False) -> Any:
    """A fixed number (an integer if asked) in `allowed`."""
    what = "an integer" if integer else "a number"

    def check(value: Any) -> float | int:
        if not _is_number(value) or (integer and float(value) != int(value)):
            raise ValueError(f"expected {what} in {allowed}, got {value!r}")
        if value not in allowed or math.isnan(value):
            raise ValueError(f"expected {what} in {allowed}, got {value!r}")
        return int(value) if integer else float(value)

    schema = {"type": "integer" if integer else "number"}
    return Annotated[int if integer else float, PlainValidator(check), WithJsonSchema(schema)]


class Component(BaseModel):
    """Common ground of every component: typed parameters, gates, a catalogue entry."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: str
    family: ClassVar[str] = ""
    # Fields that may be data-dependent gates, with the range a fixed value must lie in.
    gateable: ClassVar[dict[str, Range]] = {}

    @classmethod
    def summary(cls) -> str:
        """The one-line description (first docstring line)."""
        return (cls.__doc__ or "").strip().splitlines()[0]

    @classmethod
    def equation(cls) -> str:
        """The paper equation, from the docstring's `Equation:` line."""
        for line in (cls.__doc__ or "").splitlines():
            if line.strip().startswith("Equation:"):
                return line.strip()[len("Equation:") :].strip()
        return ""

    def spec_equation(self) -> str:
        """The equation for this spec's values, where they change it (lq: its q); `equation()`
        is the catalogue's, with the paper's values."""
        return self.equation()

    def gates(self) -> list[str]:
        """Names of the fields set to "gate": the rule takes them per token."""
        return [name for name in self.gateable if getattr(self, name) == "gate"]

    def scalars(self) -> dict[str, sp.Symbol]:
        """The sympy symbol of every gateable field (gate or fixed)."""
        return {name: gate_symbol(name) for name in self.gateable}

    def fixed(self) -> dict[str, float]:
        """Values of the gateable fields fixed in the spec."""
        return {n: getattr(self, n) for n in self.gateable if getattr(self, n) != "gate"}

    def parameters(self) -> dict[str, Any]:
        """The spec's parameters of this component, without `kind`."""
        return {k: v for k, v in self.model_dump().items() if k != "kind"}


class Bias(Component):
    """Attentional bias L(y, v): the inner loss the memory minimizes (MIRAS section 3)."""

    family: ClassVar[str] = "bias"

    def expression(self) -> sp.Expr:
        """L over one vector: `ChannelSum(f(e, y, v))` plus, optionally, terms in channel sums
        (e.g. a norm). Uses `miras.symbols` `e`, `y`, `v` and the component's scalars."""
        raise NotImplementedError

    def reference_loss(self, y: torch.Tensor, v: torch.Tensor, **scalars: Any) -> torch.Tensor:
        """A hand-written torch L, summed over the last (value) axis: `[..., Dv] -> [...]`.
        An independent oracle for the derived gradient."""
        raise NotImplementedError


class Retention(Component):
    """Retention gate: the regularizers of MIRAS's Learning-Retaining objective."""

    family: ClassVar[str] = "retention"

    def objective(self) -> sp.Expr:
        """One entry of <u, W> + (1/eta) D(W, W_{t-1}) + (1/alpha) G(W), in `miras.symbols`
        w, w0, u, eta, alpha and the component's gates."""
        raise NotImplementedError

    def reparameterization(self) -> dict[sp.Symbol, sp.Expr]:
        """eta and alpha as expressions in the gates."""
        raise NotImplementedError

    def domain(self) -> str:
        """Where the state lives: "real", "positive" (KL) or "unit_interval" (binary entropy)."""
        return "real"


class Optimizer(Component):
    """Memory optimizer: how the inner gradient becomes the update u_t."""

    family: ClassVar[str] = "optimizer"


class FeatureMap(Component):
    """Feature map phi applied to keys and queries before the memory (ATLAS section 3)."""

    family: ClassVar[str] = "feature_map"

    def output_dim(self, d: int) -> int:
        """Dphi for input width d."""
        raise NotImplementedError


class Memory(Component):
    """Memory architecture M_W (MIRAS section 3: associative memory)."""

    family: ClassVar[str] = "memory"
