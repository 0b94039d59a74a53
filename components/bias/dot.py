"""Dot-product bias: Hebbian memories (linear attention, RetNet, DLA)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import sympy as sp

from miras.components.base import Bias
from miras.symbols import ChannelSum, v, y

if TYPE_CHECKING:
    import torch  # annotations only; imported where used (loading a spec needs no torch)


class DotBias(Bias):
    """Dot-product similarity: reward predictions aligned with the value.

    Equation: L(M(k), v) = -<M(k), v>   (MIRAS eq. 6; its gradient gives the Hebbian update)
    """

    kind: Literal["dot"] = "dot"

    def expression(self) -> sp.Expr:
        return ChannelSum(-y * v)

    def reference_loss(self, y, v, **scalars) -> torch.Tensor:
        return -(y * v).sum(-1)
