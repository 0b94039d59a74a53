"""The identity feature map."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from miras.components.base import FeatureMap

if TYPE_CHECKING:  # annotations only: sympy and torch are imported where used (components/base.py)
    import sympy as sp
    import torch


class IdentityMap(FeatureMap):
    """Keys and queries enter the memory as they are.

    Equation: phi(x) = x
    """

    kind: Literal["identity"] = "identity"

    def output_dim(self, d: int) -> int:
        return d

    def expression(self) -> sp.Expr:
        from miras.derive.symbols import x

        return x

    def apply(self, x: torch.Tensor, coefficients: torch.Tensor | None = None) -> torch.Tensor:
        return x
