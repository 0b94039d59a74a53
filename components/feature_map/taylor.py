"""The second-order Taylor tensor map: memory capacity O(d^2)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Literal

from miras.components.base import FeatureMap

if TYPE_CHECKING:
    import torch  # annotations only; imported where used (loading a spec needs no torch)


class TaylorMap(FeatureMap):
    """Tensor feature map [1, x, x (x) x / sqrt 2]: <phi(a), phi(b)> = 1 + a.b + (a.b)^2 / 2.

    Equation: phi(x) = [1, x, vec(x x^T) / sqrt(2)], kept as the upper triangle (dim 1 + d + d(d+1)/2 = C(d+2, 2))
    """

    kind: Literal["taylor"] = "taylor"

    def output_dim(self, d: int) -> int:
        return 1 + d + d * (d + 1) // 2

    def apply(self, x: torch.Tensor, coefficients: torch.Tensor | None = None) -> torch.Tensor:
        """`x`: [..., D] -> [..., 1 + D + D(D+1)/2]. Off-diagonal products appear once, so
        they carry weight 1 and the diagonal 1/sqrt 2, which keeps the inner product above."""
        import torch

        d = x.shape[-1]
        rows, cols = torch.triu_indices(d, d, device=x.device)
        ones = torch.ones(rows.shape, dtype=x.dtype, device=x.device)
        weight = torch.where(rows == cols, ones / math.sqrt(2), ones)
        quadratic = x[..., rows] * x[..., cols] * weight
        return torch.cat([torch.ones_like(x[..., :1]), x, quadratic], dim=-1)
