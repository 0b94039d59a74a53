"""Memory architectures at run time: forward M_W(x) and the explicit backward dL/dW.

Parameters are a dict name -> tensor `[*batch, out, in]`; inputs `[*batch, in]`. Batch axes
broadcast, so one state `[B, H, 1, out, in]` can read many tokens `[B, H, N, in]`, and per-token
states `[B, H, N, out, in]` read one token each. The backward is assembled from derived pieces
(the bias gradient dL/dy arrives as `grad_y`; activation derivatives are emitted by the
compiler) as batched products; it never calls autograd. Tests check it against torch.func.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from miras.components.base import Memory

Params = dict[str, torch.Tensor]
LAYER_NORM_EPS = 1e-5


def _shared(weight: torch.Tensor, x: torch.Tensor) -> bool:
    """One weight for a run of tokens: weight [*b, 1, out, in] against x [*b, N, in]."""
    return weight.dim() == x.dim() + 1 and weight.shape[-3] == 1 and x.dim() >= 2


def _apply(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """weight [*b, out, in] @ x [*b, in] -> [*b, out], broadcasting the batch axes."""
    if _shared(weight, x):  # one matmul [N, in] @ [in, out], not N copies of the weight
        return x @ weight.squeeze(-3).transpose(-1, -2)
    return (weight @ x.unsqueeze(-1)).squeeze(-1)


def _apply_transposed(weight: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """weight^T [*b, in, out] @ g [*b, out] -> [*b, in]."""
    if _shared(weight, g):
        return g @ weight.squeeze(-3)
    return (g.unsqueeze(-2) @ weight).squeeze(-2)


def _outer(g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """g [*b, out] x^T [*b, in] -> [*b, out, in]."""
    return g.unsqueeze(-1) * x.unsqueeze(-2)


def _layer_norm(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """LN without affine over the last axis; returns (normalized, 1/std)."""
    centered = z - z.mean(-1, keepdim=True)
    inv_std = torch.rsqrt(centered.pow(2).mean(-1, keepdim=True) + LAYER_NORM_EPS)
    return centered * inv_std, inv_std


def _layer_norm_backward(n: torch.Tensor, inv_std: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """d/dz of LN(z) applied to g: (g - mean(g) - n mean(g n)) / std."""
    return inv_std * (g - g.mean(-1, keepdim=True) - n * (g * n).mean(-1, keepdim=True))


@dataclass(frozen=True)
class MemoryModel:
    """The run-time form of a memory architecture."""

    memory: Memory
    activation: Callable[[torch.Tensor], torch.Tensor] | None = None
    activation_grad: Callable[[torch.Tensor], torch.Tensor] | None = None

    def shapes(self, d_in: int, d_out: int) -> dict[str, tuple[int, ...]]:
        return self.memory.parameter_shapes(d_in, d_out)

    def forward(self, params: Params, x: torch.Tensor) -> torch.Tensor:
        return self._forward(params, x)[0]

    def backward(self, params: Params, x: torch.Tensor, grad_y: torch.Tensor) -> Params:
        """dL/dW for every parameter, given dL/dy at y = M_W(x). Shapes follow the broadcast
        of params and x: per token when either is per token."""
        kind = self.memory.kind
        if kind == "matrix":
            return {"W": _outer(grad_y, x)}
        _, cache = self._forward(params, x)
        if kind == "mlp":
            return self._mlp_backward(params, cache, grad_y)
        if kind == "gated_mlp":
            return self._gated_backward(params, cache, grad_y)
        raise ValueError(f"memory {kind!r} has no gradient step (it is a closed form)")

    # Forward passes keep what the backward needs.
    def _forward(self, params: Params, x: torch.Tensor):
        kind = self.memory.kind
        if kind == "matrix":
            return _apply(params["W"], x), None
        if kind == "mlp":
            return self._mlp_forward(params, x)
        if kind == "gated_mlp":
            a, b = _apply(params["W2"], x), _apply(params["W3"], x)
            h = self.activation(a) * b
            return _apply(params["W1"], h), (x, a, b, h)
        raise ValueError(f"memory {kind!r} has no parametric forward")

    def _mlp_forward(self, params: Params, x: torch.Tensor):
        names = list(params)  # input side first: W_depth, ..., W_1
        inputs, pre = [x], []
        h = x
        for i, name in enumerate(names):
            z = _apply(params[name], h)
            pre.append(z)
            if i < len(names) - 1:
                h = self.activation(z)
                inputs.append(h)
        out, norm = z, None
        if self.memory.residual_norm:
            n, inv_std = _layer_norm(z)
            norm = (n, inv_std)
            out = x + n
        return out, (inputs, pre, norm)

    def _mlp_backward(self, params: Params, cache, grad_y: torch.Tensor) -> Params:
        inputs, pre, norm = cache
        names = list(params)
        g = grad_y if norm is None else _layer_norm_backward(*norm, grad_y)
        grads: Params = {}
        for i in reversed(range(len(names))):
            grads[names[i]] = _outer(g, inputs[i])
            if i > 0:
                g = _apply_transposed(params[names[i]], g) * self.activation_grad(pre[i - 1])
        return {name: grads[name] for name in names}

    def _gated_backward(self, params: Params, cache, grad_y: torch.Tensor) -> Params:
        x, a, b, h = cache
        g_h = _apply_transposed(params["W1"], grad_y)
        g_a = g_h * b * self.activation_grad(a)
        g_b = g_h * self.activation(a)
        return {"W1": _outer(grad_y, h), "W2": _outer(g_a, x), "W3": _outer(g_b, x)}
