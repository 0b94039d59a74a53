"""Bregman retention's derivation, the mirror step: stationarity of <u, W> + D_F(W, W_{t-1}) is
F'(w) = F'(w0) - u, so the step is (F')^{-1}(F'(w0) - u), inverted with sympy or, where it
cannot, solved by Newton's method (`inverse_slope`). `BregmanRetention.derive_step` runs it.

Sympy at import: the component's methods import this module where they derive (loading a spec
imports no sympy, components/base.py).
"""

from __future__ import annotations

import math
from typing import Any

import sympy as sp
from sympy.core.function import PoleError

from miras.derive import numerics
from miras.derive.formula import OVERFLOW, value_at
from miras.derive.printer import UnsupportedExpression, torch_code
from miras.derive.retention_solve import J, Step, equations
from miras.derive.symbols import sigmoid_rewrite, w
from miras.errors import DerivationError

z = sp.Symbol("z", real=True)  # the argument of (F')^{-1}, the value of F' (display only)


class inverse_slope(sp.Function):
    """(F')^{-1}(z), solved numerically (Bregman with `solver: newton`): the step of a
    potential sympy cannot invert. The torch source runs Newton's method; no printer knows it."""

    nargs = 1

    def _sympystr(self, printer):
        return "(F')^-1(" + printer._print(self.args[0]) + ")"

    def _latex(self, printer, exp=None):
        return r"(F')^{-1}\left(" + printer._print(self.args[0]) + r"\right)"


# Bregman: sample points inside each domain, to pick sympy's branch of (F')^{-1} and to check
# convexity (F'' > 0): the numerics' own, which every branch choice by domain reads.
SAMPLES = numerics.SAMPLES


def _exact(point: float) -> sp.Rational:
    """A sample point as an exact number: a Float substituted into exp(exp(...)) is evaluated
    on the spot by sympy, with no bound on the size of the result."""
    return sp.Rational(str(point))


def _value(expr: sp.Expr) -> complex | None:
    """A numeric value of a closed expression, None if it has none (nan, zoo, symbols) or a
    term of it leaves the float64 range (evaluated from the leaves up first: sp.N alone of
    exp(exp(exp(w**16))) at w = 1.7 builds a number with a 4000-digit exponent)."""
    if value_at(expr, {}) == OVERFLOW:
        return None
    try:
        value = complex(sp.N(expr, 30))
    except (TypeError, ValueError, OverflowError):
        return None
    return value if math.isfinite(value.real) and math.isfinite(value.imag) else None


def mirror_step(retention: Any) -> tuple[list[Step], sp.Expr]:
    """Stationarity is F'(w) = F'(w0) - u; invert F' with sympy (or Newton). `retention`: a
    `BregmanRetention`; returns (steps, step)."""
    F = retention.potential_expr()
    slope, curvature = sp.diff(F, w), sp.diff(F, w, 2)
    domain = retention.domain()
    for point in SAMPLES[domain]:  # a necessary check of strict convexity: F'' > 0
        value = _value(curvature.xreplace({w: _exact(point)}))  # exact: subs would evalf
        if value is None or abs(value.imag) > 1e-12 or value.real <= 0:
            shown = "undefined or beyond float64" if value is None else f"{value.real:.6g}"
            raise DerivationError(
                f"retention bregman: the potential F(w) = {F} is not strictly convex on its "
                f"domain ({domain}): F''(w) = {curvature} is {shown} at w = {point}"
            )
    _check_slope_is_onto(slope, domain)
    objective = retention.objective()
    reparameterization = retention.reparameterization()
    stationarity = sp.diff(objective.subs(reparameterization), w)
    target = sp.simplify(slope - stationarity)  # F'(w) = F'(w0) - u
    if target.has(w):
        raise DerivationError(
            f"retention bregman: stationarity {stationarity} = 0 is not F'(w) = z"
        )
    steps: list[Step] = [
        ("potential", sp.Eq(sp.Symbol("F"), F)),
        ("domain", domain),
        ("objective", sp.Eq(J, objective)),
        ("reparameterization", equations(reparameterization)),
        ("stationarity", sp.Eq(stationarity, 0)),
        ("mirror step", sp.Eq(slope, target)),
    ]
    if retention.solver == "newton":
        steps += [
            ("F''", sp.Eq(sp.Symbol("F''"), curvature)),
            (
                "newton",
                f"z = F'(w0) - u; bracket the root in s = {numerics.COORDINATE_TEXT[domain]} "
                "from w0; then w <- w - (F'(w) - z)/F''(w), bisecting in s where that step "
                "leaves the bracket or does not halve; until converged (step < 2 eps |w|), at "
                f"most {retention.newton_steps} iterations",
            ),
            ("gradient", "dw/dz = 1/F''(w) at the solution (implicit differentiation)"),
            ("step", sp.Eq(w, inverse_slope(target))),
        ]
        return steps, inverse_slope(target)
    inverse = _invert_slope(slope, domain)
    step = inverse.subs(z, target)
    try:
        torch_code(step)
    except UnsupportedExpression as err:
        raise DerivationError(
            f"retention bregman: sympy inverts F'(w) = {slope} as {inverse}, which the torch "
            f"printer cannot emit ({err}); set `retention.solver: newton` to solve "
            "F'(w) = F'(w0) - u with Newton steps instead"
        ) from None
    steps += [("inverse", sp.Eq(w, inverse)), ("step", sp.Eq(w, step))]
    return steps, step


# The ends of each domain, approached from inside.
ENDS = {
    "real": ((-sp.oo, "+"), (sp.oo, "-")),
    "positive": ((0, "+"), (sp.oo, "-")),
    "unit_interval": ((0, "+"), (1, "-")),
}


def _check_slope_is_onto(slope: sp.Expr, domain: str) -> None:
    """F' must run from -oo to oo over the domain (F of Legendre type): otherwise F'(w0) - u
    leaves F's range for some u, where the objective has no minimizer (F = exp(w): F' > 0, and
    u > exp(w0) sends w to -oo). A limit sympy cannot find is not held against F."""
    (lo, lo_dir), (hi, hi_dir) = ENDS[domain]
    for end, direction, want in ((lo, lo_dir, -sp.oo), (hi, hi_dir, sp.oo)):
        try:
            limit = sp.limit(slope, w, end, direction)
        except (NotImplementedError, ValueError, PoleError):
            continue
        if limit.is_number and limit.is_finite:
            raise DerivationError(
                f"retention bregman: F'(w) = {slope} tends to {limit} at w -> {end}, not to "
                f"{want}: F'(w0) - u leaves the range of F' for some u, where the objective has "
                "no minimizer; use a potential whose F' runs from -oo to oo on its domain"
            )


def _invert_slope(slope: sp.Expr, domain: str) -> sp.Expr:
    """(F')^{-1}(z) in closed form, named with sigmoid where sympy wrote the logistic out.

    F is strictly convex, so F' is one-to-one and the inverse is unique on F's range; of the
    branches sympy returns, keep those that give back w at sample points w_k of the domain:
    candidate(F'(w_k)) = w_k (`miras.derive.numerics.select_branches`, the branch choice by
    domain that the separable derivation's several roots go through too)."""
    advice = "set `retention.solver: newton` to solve F'(w) = F'(w0) - u with Newton steps instead"
    try:
        candidates = sp.solve(sp.Eq(slope, z), w)
    except NotImplementedError as err:
        reason = str(err).splitlines()[-1] if str(err) else "no algorithm"
        raise DerivationError(
            f"retention bregman: sympy cannot invert F'(w) = {slope} in closed form "
            f"({reason}); {advice}"
        ) from None

    def branch(candidate: sp.Expr):
        return lambda p: _value(candidate.subs(z, slope.xreplace({w: _exact(p)})))

    kept = numerics.select_branches(
        [branch(c) for c in candidates], domain, expected=lambda p: p, tolerance=1e-9
    )
    valid = [candidates[i] for i in kept]
    if not valid:
        if candidates:
            found = (
                f"none of its solutions for w ({', '.join(map(str, candidates))}) is a real "
                "inverse at every sample point"
            )
        else:
            found = "sympy found no closed-form solution for w"
        raise DerivationError(
            f"retention bregman: sympy cannot invert F'(w) = {slope} on the whole domain "
            f"({domain}): {found}; {advice}"
        )
    # Several valid branches agree on the domain: keep the simplest.
    return sigmoid_rewrite(min(valid, key=sp.count_ops))
