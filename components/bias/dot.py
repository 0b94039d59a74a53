"""Dot-product bias: Hebbian memories (linear attention, RetNet, DLA)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from miras.components.base import Bias

if TYPE_CHECKING:  # annotations only: sympy and torch are imported where used (components/base.py)
    import sympy as sp
    import torch


class DotBias(Bias):
    """Dot-product similarity: reward predictions aligned with the value.

    Equation: L(M(k), v) = -<M(k), v>   (MIRAS eq. 6; its gradient gives the Hebbian update)
    """

    kind: Literal["dot"] = "dot"

    def expression(self) -> sp.Expr:
        from miras.derive.symbols import ChannelSum, v, y

        return ChannelSum(-y * v)

    def reference_loss(self, y, v, **scalars) -> torch.Tensor:
        return -(y * v).sum(-1)

    def constant_slope(self) -> tuple[float | None, str]:
        """d2L/dy^2 = 0 (L = -y v is linear in y), known without sympy."""
        return 0.0, ""
