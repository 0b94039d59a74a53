"""Deep (MLP) memory: Titans' neural long-term memory and MIRAS's residual form."""

from __future__ import annotations

import math
from typing import Literal

import sympy as sp

from miras.components.base import POSITIVE, Memory, Range, number
from miras.symbols import sigmoid, x

Activation = Literal["gelu", "silu", "relu", "tanh"]

# Each activation as a formula in x; the compiler derives and emits its derivative, which the
# explicit backward of the memory uses.
ACTIVATIONS: dict[str, sp.Expr] = {
    "gelu": x * (1 + sp.erf(x / sp.sqrt(2))) / 2,
    "silu": x * sigmoid(x),
    "relu": sp.Max(x, 0),
    "tanh": sp.tanh(x),
}


class MLPMemory(Memory):
    """An MLP of `depth` layers whose weights are the memory (Titans section 3.1).

    Equation: M(x) = W_1 act(W_2 x) (depth 2); MIRAS form M(x) = x + LN(W_1 act(W_2 x))
    """

    kind: Literal["mlp"] = "mlp"
    depth: number(Range(1, 8, lo_closed=True, hi_closed=True), integer=True) = 2
    expansion: number(POSITIVE) = 4.0
    activation: Activation = "gelu"
    residual_norm: bool = False  # MIRAS's x + LN(MLP(x)); needs Dv = Dphi

    def parameter_shapes(self, d_in: int, d_out: int) -> dict[str, tuple[int, ...]]:
        """Weights from input to output: W_{depth}, ..., W_1, each [out, in]."""
        hidden = max(1, math.ceil(self.expansion * d_in))
        widths = [d_in] + [hidden] * (self.depth - 1) + [d_out]
        layers = list(zip(widths[1:], widths[:-1], strict=True))
        return {f"W{self.depth - i}": shape for i, shape in enumerate(layers)}
