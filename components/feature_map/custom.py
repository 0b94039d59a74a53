"""A feature map written as a formula in the spec."""

from __future__ import annotations

from typing import Literal

import sympy as sp
from pydantic import model_validator

from miras.components.base import FeatureMap
from miras.components.bias.custom import check_param_names, check_params_used
from miras.formula import parse_formula
from miras.symbols import x


class CustomMap(FeatureMap):
    """An elementwise feature map given as a formula in x with fixed parameters.

    Equation: phi(x)_j = f(x_j)
    """

    kind: Literal["custom"] = "custom"
    formula: str
    params: dict[str, float] = {}

    @model_validator(mode="after")
    def _parse(self) -> CustomMap:
        check_param_names(self.params)
        self.expression()  # raises FormulaError (a ValueError) naming what is wrong
        symbolic = {"x": x, **{n: sp.Symbol(n) for n in self.params}}
        check_params_used(self.params, parse_formula(self.formula, symbolic), "formula")
        return self

    def output_dim(self, d: int) -> int:
        return d

    def expression(self) -> sp.Expr:
        symbols = {"x": x, **{n: sp.Float(val) for n, val in self.params.items()}}
        return parse_formula(self.formula, symbols)
