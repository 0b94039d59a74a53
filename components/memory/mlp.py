"""Deep (MLP) memory: Titans' neural long-term memory and MIRAS's residual form."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Literal

from miras.components.base import Memory, Range, number

if TYPE_CHECKING:  # annotations only: sympy is imported where used (components/base.py)
    import sympy as sp

Activation = Literal["gelu", "silu", "relu", "tanh"]


def activation_functions(name: Activation) -> list[tuple[str, sp.Expr, str]]:
    """`activation` as a formula in x and its derivative `activation_grad`, derived: the
    compiler emits both, and the memory's explicit backward uses the derivative."""
    import sympy as sp

    from miras.derive.symbols import sigmoid, x

    formulas = {
        "gelu": x * (1 + sp.erf(x / sp.sqrt(2))) / 2,
        "silu": x * sigmoid(x),
        "relu": sp.Max(x, 0),
        "tanh": sp.tanh(x),
    }
    f = formulas[name]
    return [("activation", f, f"{name}(x)"), ("activation_grad", sp.diff(f, x), f"d {name}/dx")]


class MLPMemory(Memory):
    """An MLP of `depth` layers whose weights are the memory (Titans section 3.1).

    Equation: M(x) = W_1 act(W_2 x) (depth 2); MIRAS form M(x) = x + LN(W_1 act(W_2 x))
    """

    kind: Literal["mlp"] = "mlp"
    depth: number(Range(1, 8, lo_closed=True, hi_closed=True), integer=True) = 2
    expansion: number(Range(0, 64, hi_closed=True)) = 4.0  # hidden width / input width
    activation: Activation = "gelu"
    residual_norm: bool = False  # MIRAS's x + LN(MLP(x)); needs Dv = Dphi

    def parameter_shapes(self, d_in: int, d_out: int) -> dict[str, tuple[int, ...]]:
        """Weights from input to output: W_{depth}, ..., W_1, each [out, in]."""
        hidden = max(1, math.ceil(self.expansion * d_in))
        widths = [d_in] + [hidden] * (self.depth - 1) + [d_out]
        layers = list(zip(widths[1:], widths[:-1], strict=True))
        return {f"W{self.depth - i}": shape for i, shape in enumerate(layers)}

    def emitted_functions(self) -> list[tuple[str, sp.Expr, str]]:
        return activation_functions(self.activation)

    def size_fields(self) -> dict[str, float | int]:
        return {"expansion": self.expansion, "depth": self.depth}

    def residual_field(self) -> str | None:
        return "residual_norm" if self.residual_norm else None

    def network(self, names, linear, x, activation=None):
        """Input side first: W_depth, ..., W_1; keeps each layer's input and pre-activation
        (and the LN's pieces) for `gradient_factors`."""
        from miras.components.memory.linalg import layer_norm

        inputs, pre = [x], []
        h = x
        for i, name in enumerate(names):
            z = linear(name, h)
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

    def gradient_factors(self, names, transposed, cache, grad_y, activation=None, grad=None):
        """Back through the layers from dL/dy (and the LN), W_1 first: each layer's error and
        input."""
        from miras.components.memory.linalg import layer_norm_backward

        inputs, pre, norm = cache
        g = grad_y if norm is None else layer_norm_backward(*norm, grad_y)
        factors: dict = {}
        for i in reversed(range(len(names))):
            factors[names[i]] = (g, inputs[i])
            if i > 0:
                g = transposed(names[i], g) * grad(pre[i - 1])
        return {name: factors[name] for name in names}
