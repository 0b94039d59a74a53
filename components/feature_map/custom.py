"""A feature map written as a formula in the spec."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import model_validator

from miras.components.base import FeatureMap, Range, number
from miras.components.bias.custom import check_param_names, check_params_used

if TYPE_CHECKING:  # annotations only: sympy is imported where used (components/base.py)
    import sympy as sp


class CustomMap(FeatureMap):
    """An elementwise feature map given as a formula in x with fixed parameters.

    Equation: phi(x)_j = f(x_j)
    """

    kind: Literal["custom"] = "custom"
    formula: str
    # Parameter name -> a fixed finite number (a feature map takes no gates).
    params: dict[str, number(Range())] = {}

    @model_validator(mode="after")
    def _parse(self) -> CustomMap:
        import sympy as sp

        from miras.derive.formula import parse_formula
        from miras.derive.symbols import x

        check_param_names(self.params)
        phi = self.expression()  # raises FormulaError (a ValueError) naming what is wrong
        symbolic = {"x": x, **{n: sp.Symbol(n) for n in self.params}}
        check_params_used(self.params, parse_formula(self.formula, symbolic), "formula")
        check_map(phi)
        return self

    def user_parameters(self) -> dict:
        return self.params

    def output_dim(self, d: int) -> int:
        return d

    def expression(self) -> sp.Expr:
        import sympy as sp

        from miras.derive.formula import parse_formula
        from miras.derive.symbols import x

        symbols = {"x": x, **{n: sp.Float(val) for n, val in self.params.items()}}
        return parse_formula(self.formula, symbols)

    def features(self, x, params: dict, functions):
        """The compiled rule emits phi as `feature_map` (torch, elementwise)."""
        return functions.feature_map(x)

    def emitted_functions(self) -> list[tuple[str, sp.Expr, str]]:
        return [("feature_map", self.expression(), "")]


def check_map(phi: sp.Expr) -> None:
    """Refuse a constant map (every key the same feature) and one that is not finite and real,
    or not differentiable, at some input."""
    import sympy as sp

    from miras.derive.formula import not_finite, value_at
    from miras.derive.symbols import x

    if not phi.has(x):
        raise ValueError(
            "the feature map does not use x, so every key and query maps to the same vector; "
            "write it in x, e.g. x or exp(x)"
        )
    slope = sp.diff(phi, x)
    # Key and query channels are any real numbers, 0 included (the window's padding): phi and
    # its derivative (training differentiates phi) must be finite and real at each of these.
    for point in (0, sp.Rational(-1, 2), sp.Rational(1, 2), -2, 2):
        for what, expr in (("phi(x)", phi), ("the derivative phi'(x)", slope)):
            why = not_finite(value_at(expr, {x: point}))
            if why is not None:
                raise ValueError(
                    f"{what} is {why} at x = {point}; keys and queries take any real value, 0 "
                    "included, so phi and its derivative must be finite and real everywhere "
                    "(e.g. abs(x)**0.5 -> (x**2 + 1e-6)**0.25, log(x) -> log(1 + x**2))"
                )
