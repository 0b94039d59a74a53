"""Gated MLP memory (Atlas++)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Literal

from miras.components.base import Memory, Range, number
from miras.components.memory.mlp import Activation, activation_functions

if TYPE_CHECKING:  # annotations only: sympy is imported where used (components/base.py)
    import sympy as sp


class GatedMLPMemory(Memory):
    """A gated MLP (SwiGLU-like) whose weights are the memory (ATLAS, Atlas++).

    Equation: M(x) = W_1 (act(W_2 x) * W_3 x)
    """

    kind: Literal["gated_mlp"] = "gated_mlp"
    expansion: number(Range(0, 64, hi_closed=True)) = 4.0  # hidden width / input width
    activation: Activation = "silu"

    def parameter_shapes(self, d_in: int, d_out: int) -> dict[str, tuple[int, ...]]:
        hidden = max(1, math.ceil(self.expansion * d_in))
        return {"W1": (d_out, hidden), "W2": (hidden, d_in), "W3": (hidden, d_in)}

    def emitted_functions(self) -> list[tuple[str, sp.Expr, str]]:
        return activation_functions(self.activation)

    def size_fields(self) -> dict[str, float]:
        return {"expansion": self.expansion}

    def network(self, names, linear, x, activation=None):
        a, b = linear("W2", x), linear("W3", x)
        h = activation(a) * b
        return linear("W1", h), (x, a, b, h)

    def gradient_factors(self, names, transposed, cache, grad_y, activation=None, grad=None):
        x, a, b, h = cache
        g_h = transposed("W1", grad_y)
        g_a = g_h * b * grad(a)
        g_b = g_h * activation(a)
        return {"W1": (grad_y, h), "W2": (g_a, x), "W3": (g_b, x)}
