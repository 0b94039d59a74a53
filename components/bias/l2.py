"""Squared-error bias: the delta rule (DeltaNet, Titans)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from miras.components.base import Bias

if TYPE_CHECKING:  # annotations only: sympy and torch are imported where used (components/base.py)
    import sympy as sp
    import torch


class L2Bias(Bias):
    """l2 regression: half the squared error between prediction and value.

    Equation: L(M(k), v) = 1/2 ||M(k) - v||_2^2   (MIRAS eq. 7; the delta rule)
    """

    kind: Literal["l2"] = "l2"

    def expression(self) -> sp.Expr:
        from miras.derive.symbols import ChannelSum, e

        return ChannelSum(e**2 / 2)

    def reference_loss(self, y, v, **scalars) -> torch.Tensor:
        return 0.5 * ((y - v) ** 2).sum(-1)

    def constant_slope(self) -> tuple[float | None, str]:
        """d2L/dy^2 = 1 (L = e^2 / 2 per channel), known without sympy."""
        return 1.0, ""
