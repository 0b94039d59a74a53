"""A bias written as a formula in the spec."""

from __future__ import annotations

from typing import Any, Literal

import sympy as sp
from pydantic import model_validator

from miras.components.base import POSITIVE, Bias, gate_or
from miras.formula import parse_formula
from miras.symbols import ChannelSum, e, gate_symbol, v, y

RESERVED = frozenset({"e", "y", "v", "x", "w", "w0", "u", "pi", "True"})


def check_param_names(params: dict[str, Any]) -> None:
    for name in params:
        if not name.isidentifier() or name.startswith("_"):
            raise ValueError(f"parameter name {name!r} must be a plain identifier")
        if name in RESERVED:
            raise ValueError(
                f"parameter name {name!r} is reserved; reserved names: {', '.join(sorted(RESERVED))}"
            )


def check_params_used(params: dict[str, Any], expr: sp.Expr, field: str) -> None:
    """A declared parameter that the formula never names is almost always a typo."""
    named = {s.name for s in expr.free_symbols}
    unused = [name for name in params if name not in named]
    if unused:
        raise ValueError(
            f"parameter name {', '.join(map(repr, unused))} is declared in params but not used "
            f"in {field}; use it in the formula or remove it"
        )


class CustomBias(Bias):
    """A loss written as a formula in e = y - v, y, v and declared parameters.

    Equation: L = sum_j f(e_j, y_j, v_j) for an elementwise formula; sum(.) and norm(.) over the value channels otherwise
    """

    kind: Literal["custom"] = "custom"
    loss: str
    # Parameter name -> a positive number, or "gate" for a data-dependent one.
    params: dict[str, gate_or(POSITIVE)] = {}

    @model_validator(mode="after")
    def _parse(self) -> CustomBias:
        check_param_names(self.params)
        expr = self.expression()  # raises FormulaError (a ValueError) naming what is wrong
        check_params_used(self.params, expr, "loss")
        return self

    def gates(self) -> list[str]:
        return [name for name, value in self.params.items() if value == "gate"]

    def scalars(self) -> dict[str, sp.Symbol]:
        return {name: gate_symbol(name) for name in self.params}

    def fixed(self) -> dict[str, float]:
        return {n: value for n, value in self.params.items() if value != "gate"}

    def expression(self) -> sp.Expr:
        symbols = {"e": e, "y": y, "v": v, **self.scalars()}
        expr = parse_formula(self.loss, symbols, channel_sums=True)
        if not expr.has(ChannelSum):
            return ChannelSum(expr)  # an elementwise formula is summed over the channels
        outside = expr.replace(ChannelSum, lambda arg: sp.Integer(0)).free_symbols
        stray = sorted(s.name for s in outside & {e, y, v})
        if stray:
            raise ValueError(
                f"loss: {', '.join(stray)} appear outside sum(...)/norm(...); a loss that uses "
                "sum() or norm() is a whole-vector loss, so every channel term must sit inside one"
            )
        return expr
