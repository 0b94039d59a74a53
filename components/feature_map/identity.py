"""The identity feature map."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import sympy as sp

from miras.components.base import FeatureMap
from miras.symbols import x

if TYPE_CHECKING:
    import torch  # annotations only; imported where used (loading a spec needs no torch)


class IdentityMap(FeatureMap):
    """Keys and queries enter the memory as they are.

    Equation: phi(x) = x
    """

    kind: Literal["identity"] = "identity"

    def output_dim(self, d: int) -> int:
        return d

    def expression(self) -> sp.Expr:
        return x

    def apply(self, x: torch.Tensor, coefficients: torch.Tensor | None = None) -> torch.Tensor:
        return x
