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

    def forward(self, params: dict, x, activation=None):
        """Input side first: W_depth, ..., W_1; keeps each layer's input and pre-activation
        (and the LN's pieces) for `backward`."""
        from miras.components.memory.linalg import apply, layer_norm

        names = list(params)
        inputs, pre = [x], []
        h = x
        for i, name in enumerate(names):
            z = apply(params[name], h)
            pre.append(z)
            if i < len(names) - 1:
                h = activation(z)
                inputs.append(h)
        out, norm = z, None
        if self.residual_norm:
            n, inv_std = layer_norm(z)
            norm = (n, inv_std)
            out = x + n
        return out, (inputs, pre, norm)

    def backward(self, params: dict, x, grad_y, activation=None, grad=None) -> dict:
        """Back through the layers from dL/dy (and the LN), W_1 first."""
        from miras.components.memory.linalg import apply_transposed, layer_norm_backward, outer

        _, (inputs, pre, norm) = self.forward(params, x, activation)
        names = list(params)
        g = grad_y if norm is None else layer_norm_backward(*norm, grad_y)
        grads: dict = {}
        for i in reversed(range(len(names))):
            grads[names[i]] = outer(g, inputs[i])
            if i > 0:
                g = apply_transposed(params[names[i]], g) * grad(pre[i - 1])
        return {name: grads[name] for name in names}
