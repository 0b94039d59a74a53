"""A bias written as a formula in the spec."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Literal

from pydantic import model_validator

from miras.components.base import POSITIVE, Bias, gate_or

if TYPE_CHECKING:  # annotations only: sympy is imported where used (components/base.py)
    import sympy as sp

RESERVED = frozenset({"e", "y", "v", "x", "w", "w0", "u", "pi", "True"})


def check_param_names(params: dict[str, Any]) -> None:
    from miras.derive.formula import CONSTANTS, FUNCTIONS, SPECIAL_FUNCTIONS

    for name in params:
        if not name.isascii() or not name.isidentifier() or name.startswith("_"):
            raise ValueError(
                f"parameter name {name!r} must be a plain identifier (ASCII letters, digits "
                "and _, not starting with _ or a digit)"
            )
        if name in RESERVED:
            raise ValueError(
                f"parameter name {name!r} is reserved; reserved names: {', '.join(sorted(RESERVED))}"
            )
        if name in FUNCTIONS or name in SPECIAL_FUNCTIONS or name in CONSTANTS:
            raise ValueError(
                f"parameter name {name!r} is the name of a formula function or constant; "
                "choose another name"
            )


def check_params_used(params: dict[str, Any], expr: sp.Expr, field: str) -> None:
    """A declared parameter that the formula never names is almost always a typo."""
    named = {s.name for s in expr.free_symbols}
    unused = [name for name in params if name not in named]
    if unused:
        used = [name for name in params if name in named]
        uses = f" (it uses {', '.join(used)})" if used else ""
        raise ValueError(
            f"parameter name {', '.join(map(repr, unused))} is declared in params but not used "
            f"in {field}{uses}; use it in the formula or remove it"
        )


def check_loss(loss: sp.Expr, fixed: dict[str, float]) -> None:
    """Refuse a loss the memory cannot learn from: constant, without y, or one whose value or
    gradient is not a finite real number where errors occur (NaN in every backend)."""
    _check_loss(loss, tuple(sorted(fixed.items())))


@functools.lru_cache(maxsize=256)  # a spec is validated again on every load and copy
def _check_loss(loss: sp.Expr, fixed_items: tuple[tuple[str, float], ...]) -> None:
    import sympy as sp

    from miras.derive.formula import TOO_LARGE, not_finite, value_at
    from miras.derive.symbols import ChannelSum, channel_gradient, e, v, y

    fixed = dict(fixed_items)
    if not loss.free_symbols & {e, y, v}:
        raise ValueError(
            "the loss is a constant (it uses none of e, y, v), so its gradient is zero and the "
            "memory never learns; write it in the error e = y - v, e.g. e**2/2"
        )
    sums, _, gradient = channel_gradient(loss)
    terms = dict(sums)
    if gradient == 0:
        raise ValueError(
            "the loss does not change with the prediction y (its gradient dL/dy is zero), so "
            "the memory never learns; write it in the error e = y - v, e.g. e**2/2"
        )
    scalars = {s: sp.nsimplify(fixed.get(s.name, 1)) for s in loss.free_symbols - {e, y, v}}
    # Where a loss and its gradient must be finite and real. e = 0 exactly is common (a zero
    # memory read against zero values, the window's padding); errors of either sign and size
    # follow. v is a generic target (y = v + e) and every parameter that is a gate is 1.
    target = sp.Rational(1, 3)
    slopes = {}  # error -> dL/dy there (one channel)
    for err in (0, sp.Rational(-1, 2), sp.Rational(1, 2), -2, 2):
        point = {e: err, y: err + target, v: target, **scalars}
        channel = {s: value_at(term, point) for s, term in terms.items()}  # one channel
        where = "e = 0 (y = v, as for a zero memory and zero values)" if err == 0 else f"e = {err}"
        why = not_finite(value_at(loss.replace(ChannelSum, lambda f: f), point))
        if why is not None:
            fails = "overflow" if why == TOO_LARGE else "be NaN"
            raise ValueError(
                f"the loss is {why} at {where}, and would {fails} in training; " + _advice(why, err)
            )
        slopes[err] = value_at(gradient, {**point, **channel})
        why = not_finite(slopes[err])
        if why is not None:
            raise ValueError(
                f"the gradient dL/dy is {why} at {where}"
                + (
                    ", so the loss is not differentiable there"
                    if err == 0 and why != TOO_LARGE
                    else ""
                )
                + "; "
                + _advice(why, err)
            )
    _check_bounded_below(slopes)


def _check_bounded_below(slopes: dict) -> None:
    """Refuse a loss that falls, ever more steeply, as the error grows: dL/dy points back
    toward the error (e * dL/dy < 0) at e = +-2, steeper than at e = +-1/2. Gradient descent
    then pushes the error further out, faster the larger it is (-e**2: slope -2, NaN after
    about 600 tokens). A loss that falls no faster as the error grows (-e*v, the dot
    product's -y*v) only drifts, and is allowed."""
    import sympy as sp

    for near, far in ((sp.Rational(1, 2), 2), (sp.Rational(-1, 2), -2)):
        g_near, g_far = slopes[near], slopes[far]
        if not (g_near.is_number and g_far.is_number and g_near.is_real and g_far.is_real):
            continue  # a value sympy could not evaluate: nothing to hold against the loss
        if far * g_far < 0 and abs(g_far) > abs(g_near) + 1e-12:
            raise ValueError(
                f"the loss is not bounded below: it falls ever faster as the error grows "
                f"(dL/dy = {float(g_near):.4g} at e = {near}, {float(g_far):.4g} at e = {far}), "
                "so each update pushes the error further out and training diverges; write a "
                "loss that grows with |e| (e.g. e**2/2, abs(e), log(cosh(e)))"
            )


def _advice(why: str, err: sp.Expr) -> str:
    from miras.derive.formula import TOO_LARGE

    if why == TOO_LARGE:
        return (
            "nested exp/cosh/sinh or a large power overflows at moderate errors; bound the "
            "growth (log(cosh(e)) grows like |e|, e**2/2 like e**2)"
        )
    if why == "not real":
        return "a root or log of a negative error is not real: use abs(e), e.g. abs(e)**1.5"
    if err == 0:
        return (
            "floating point does not cancel 0/0 or 0*oo, so every term must be finite at "
            "e = 0; smooth it there, e.g. abs(e)**p -> (e**2 + 1e-6)**(p/2), "
            "sqrt(sum(e**2)) -> norm(e)"
        )
    return "every term must be finite for every error"


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
        check_loss(expr, self.fixed())
        return self

    def gates(self) -> list[str]:
        return [name for name, value in self.params.items() if value == "gate"]

    def user_parameters(self) -> dict:
        return self.params

    def label(self) -> str:
        return f"the custom bias {self.loss!r}"

    def scalars(self) -> dict[str, sp.Symbol]:
        from miras.derive.symbols import gate_symbol

        return {name: gate_symbol(name) for name in self.params}

    def fixed(self) -> dict[str, float]:
        return {n: value for n, value in self.params.items() if value != "gate"}

    def expression(self) -> sp.Expr:
        import sympy as sp

        from miras.derive.formula import parse_formula
        from miras.derive.symbols import ChannelSum, e, v, y

        symbols = {"e": e, "y": y, "v": v, **self.scalars()}
        expr = parse_formula(self.loss, symbols, channel_sums=True)
        if not expr.has(ChannelSum):
            return ChannelSum(expr)  # an elementwise formula is summed over the channels
        outside = expr.replace(ChannelSum, lambda arg: sp.Integer(0)).free_symbols
        stray = sorted(s.name for s in outside & {e, y, v})
        if stray:
            verb = "appears" if len(stray) == 1 else "appear"
            raise ValueError(
                f"{', '.join(stray)} {verb} outside sum(...)/norm(...); a loss that uses sum() "
                "or norm() is a whole-vector loss, so every channel term must sit inside one"
            )
        return expr

    def constant_slope(self) -> tuple[float | None, str]:
        """Derived: the compiler's affine analysis of the formula's gradient (sympy)."""
        from miras.derive.affine import slope_of
        from miras.derive.bias_derive import derive_bias

        slope, why = slope_of(self, derive_bias(self))
        if slope is None:
            return None, why
        if not slope.is_number:
            return None, f"d2L/dy^2 of {self.label()} is {slope}, not one number"
        return float(slope), ""
