"""Batched products the memories' forward and explicit backward share (torch; imported by the
memory components' methods, not at catalogue load).

A weight is [*b, out, in] and an input [*b, in]; batch axes broadcast, and one weight
[*b, 1, out, in] against a run of tokens [*b, N, in] is one matmul, not N copies."""

from __future__ import annotations

import torch

LAYER_NORM_EPS = 1e-5


def _shared(weight: torch.Tensor, x: torch.Tensor) -> bool:
    """One weight for a run of tokens: weight [*b, 1, out, in] against x [*b, N, in]."""
    return x.dim() >= 2 and weight.dim() == x.dim() + 1 and weight.shape[-3] == 1


def apply(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """weight [*b, out, in] @ x [*b, in] -> [*b, out], broadcasting the batch axes."""
    if _shared(weight, x):  # one matmul [N, in] @ [in, out], not N copies of the weight
        return x @ weight.squeeze(-3).transpose(-1, -2)
    return (weight @ x.unsqueeze(-1)).squeeze(-1)


def apply_transposed(weight: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """weight^T [*b, in, out] @ g [*b, out] -> [*b, in]."""
    if _shared(weight, g):
        return g @ weight.squeeze(-3)
    return (g.unsqueeze(-2) @ weight).squeeze(-2)


def applied(params: dict[str, torch.Tensor]):
    """`linear(name, h)` for a memory's `network`: `apply(params[name], h)`."""
    return lambda name, h: apply(params[name], h)


def transposed(params: dict[str, torch.Tensor]):
    """`transposed(name, g)` for a memory's `gradient_factors`: `apply_transposed(params[name],
    g)`."""
    return lambda name, g: apply_transposed(params[name], g)


def outer(g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """g [*b, out] x^T [*b, in] -> [*b, out, in]."""
    return g.unsqueeze(-1) * x.unsqueeze(-2)


def layer_norm(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """LN without affine over the last axis; returns (normalized, 1/std)."""
    centered = z - z.mean(-1, keepdim=True)
    inv_std = torch.rsqrt(centered.pow(2).mean(-1, keepdim=True) + LAYER_NORM_EPS)
    return centered * inv_std, inv_std


def layer_norm_backward(n: torch.Tensor, inv_std: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """d/dz of LN(z) applied to g: (g - mean(g) - n mean(g n)) / std."""
    return inv_std * (g - g.mean(-1, keepdim=True) - n * (g * n).mean(-1, keepdim=True))
