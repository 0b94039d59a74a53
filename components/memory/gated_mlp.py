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

    def forward(self, params: dict, x, activation=None):
        from miras.components.memory.linalg import apply

        a, b = apply(params["W2"], x), apply(params["W3"], x)
        h = activation(a) * b
        return apply(params["W1"], h), (a, b, h)

    def backward(self, params: dict, x, grad_y, activation=None, grad=None) -> dict:
        from miras.components.memory.linalg import apply_transposed, outer

        _, (a, b, h) = self.forward(params, x, activation)
        g_h = apply_transposed(params["W1"], grad_y)
        g_a = g_h * b * grad(a)
        g_b = g_h * activation(a)
        return {"W1": outer(grad_y, h), "W2": outer(g_a, x), "W3": outer(g_b, x)}
