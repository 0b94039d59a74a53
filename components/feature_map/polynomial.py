"""Polynomial feature map with learnable coefficients (ATLAS, OmegaNet)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Literal

from miras.components.base import FeatureMap, Range, number

if TYPE_CHECKING:  # annotations only: sympy and torch are imported where used (components/base.py)
    import sympy as sp
    import torch


class PolynomialMap(FeatureMap):
    """Elementwise polynomial of degree p whose coefficients are learned (ATLAS's input gating).

    Equation: phi(x) = sum_{i=1..p} a_i x^i, a_i initialized to 1/i!   (ATLAS eq. 21)
    """

    kind: Literal["polynomial"] = "polynomial"
    degree: number(Range(1, 8, lo_closed=True, hi_closed=True), integer=True) = 2
    learnable: bool = True

    def output_dim(self, d: int) -> int:
        return d

    def trains_parameters(self) -> bool:
        return self.learnable

    def coefficient_symbols(self) -> list[sp.Symbol]:
        import sympy as sp

        return [sp.Symbol(f"a{i}", real=True) for i in range(1, self.degree + 1)]

    def expression(self) -> sp.Expr:
        from miras.derive.symbols import x

        return sum(a * x**i for i, a in enumerate(self.coefficient_symbols(), start=1))

    def initial_coefficients(self) -> torch.Tensor:
        """[degree]: a_i = 1/i!, the Taylor coefficients of exp(x) - 1."""
        import torch

        return torch.tensor([1 / math.factorial(i) for i in range(1, self.degree + 1)])

    def apply(self, x: torch.Tensor, coefficients: torch.Tensor | None = None) -> torch.Tensor:
        """`x`: [..., D]; `coefficients`: [degree] (defaults to the initial ones)."""
        a = self.initial_coefficients() if coefficients is None else coefficients
        a = a.to(x.dtype)
        return sum(a[i - 1] * x**i for i in range(1, self.degree + 1))

    def initial_params(self) -> dict[str, torch.Tensor]:
        """The coefficients, learned by the layer: `feature_map` [degree]."""
        return {"feature_map": self.initial_coefficients()}

    def features(self, x: torch.Tensor, params: dict, functions) -> torch.Tensor:
        return self.apply(x, params["feature_map"])
