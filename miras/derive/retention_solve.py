"""What a retention's derivation is written with: the objective's display symbol, a unique
solve, and the default strategy, `separable` (solve dJ/dw = 0 per entry, then reparameterize).

Each retention component derives its own step (`Retention.derive_step`): a smooth objective
takes `separable` (the base's default), and a retention of another shape writes its strategy in
its own file (elastic_net's subgradient cases, kl's Lagrange multiplier, bregman's mirror step,
lq's accumulator and read) from these pieces. `miras.derive.retention_derive` runs the
component's strategy and emits the step. Sympy only; nothing here imports a component.
"""

from __future__ import annotations

import math
from typing import Any

import sympy as sp

from miras.derive import numerics
from miras.derive.formula import bounded_simplify
from miras.derive.symbols import u, w, w0
from miras.errors import DerivationError

J = sp.Symbol("J")  # the objective's value (display only, never printed to torch)
# One line of a derivation: (label, an equation or a note) -- `miras.ir.Step`, which this
# module does not import (the components import it, and the IR names components).
Step = tuple[str, "sp.Basic | str"]


def equations(mapping: dict[sp.Symbol, sp.Expr]) -> sp.Tuple:
    """A substitution as a tuple of equations, for a derivation's display."""
    return sp.Tuple(*(sp.Eq(k, v) for k, v in mapping.items()))


def _solutions(equation: sp.Expr, symbol: sp.Symbol, what: str) -> list[sp.Expr]:
    """sympy's solutions of `equation = 0` for `symbol`, at least one, or a DerivationError."""
    try:
        solutions = sp.solve(equation, symbol)
    except NotImplementedError as err:
        raise DerivationError(f"{what}: sympy cannot solve {equation} = 0 ({err})") from None
    if not solutions:
        raise DerivationError(f"{what}: sympy found no solution of {equation} = 0 for {symbol}")
    return solutions


def _several(equation: sp.Expr, symbol: sp.Symbol, what: str, solutions: list) -> str:
    listed = ", ".join(map(str, solutions))
    return (
        f"{what}: expected one solution of {equation} = 0 for {symbol}, sympy found "
        f"{len(solutions)}: {listed}"
    )


def solve_unique(equation: sp.Expr, symbol: sp.Symbol, what: str) -> sp.Expr:
    """The one solution of `equation = 0` for `symbol`, or a DerivationError."""
    solutions = _solutions(equation, symbol, what)
    if len(solutions) > 1:
        raise DerivationError(_several(equation, symbol, what, solutions))
    return solutions[0]


# Sample values of the symbols a solution reads besides w0 (the domain's own samples): u, and
# the others by their sympy assumptions (eta, alpha and gates are positive).
UPDATES = (-1.3, 0.4, 2.1, -0.2, 0.9)
POSITIVE_VALUES = (0.3, 0.7, 1.6, 2.5, 0.9)
REAL_VALUES = (-0.8, 0.5, 1.1, -1.7, 0.2)


def sample_points(expressions: list[sp.Expr], domain: str) -> list[dict[sp.Symbol, sp.Expr]]:
    """Points at which to evaluate `expressions`: each symbol they read cycles through its
    samples (w0 through the domain's, `miras.derive.numerics.SAMPLES`), as exact numbers."""
    symbols = sorted(set().union(*(e.free_symbols for e in expressions)), key=str)
    values = {
        s: numerics.SAMPLES[domain]
        if s == w0
        else UPDATES
        if s == u
        else POSITIVE_VALUES
        if s.is_positive
        else REAL_VALUES
        for s in symbols
    }
    count = max((len(v) for v in values.values()), default=1)
    return [{s: sp.Rational(str(v[i % len(v)])) for s, v in values.items()} for i in range(count)]


def _number(expr: sp.Expr) -> complex | None:
    """The value of a closed expression, None where it has none (nan, zoo, overflow)."""
    try:
        value = complex(sp.N(expr))
    except (TypeError, ValueError, OverflowError):
        return None
    finite = math.isfinite(value.real) and math.isfinite(value.imag)
    return value if finite else None


def solve_in_domain(equation: sp.Expr, symbol: sp.Symbol, domain: str, what: str) -> sp.Expr:
    """The solution of `equation = 0` for `symbol` that lies in the retention's `domain`: the
    one sympy finds, or of several the one whose value is in the domain at every sample point
    (`miras.derive.numerics.select_branches`, the branch choice Bregman's inverse makes too):
    a log barrier's stationarity u + (w - w0)/eta - b/w = 0 is quadratic, one root on each
    side of 0, and only one is positive. A DerivationError names the solutions otherwise."""
    solutions = _solutions(equation, symbol, what)
    if len(solutions) == 1:
        return solutions[0]
    points = sample_points(solutions, domain)

    def branch(solution: sp.Expr):
        return lambda point: _number(solution.xreplace(point))

    kept = numerics.select_branches([branch(s) for s in solutions], domain, points=points)
    if len(kept) == 1:
        return solutions[kept[0]]
    raise DerivationError(
        _several(equation, symbol, what, solutions)
        + f"; {len(kept)} of them lie in the domain ({domain}) at every sample point"
    )


def separable(retention: Any) -> tuple[list[Step], sp.Expr]:
    """A smooth objective, one entry at a time: solve dJ/dw = 0 (of several roots, the one in
    the retention's domain: `solve_in_domain`), then reparameterize.
    `retention`: a `miras.derive.protocols.RetentionParts`; returns (steps, step)."""
    objective = retention.objective()
    stationarity = sp.expand(sp.diff(objective, w))
    solution = solve_in_domain(stationarity, w, retention.domain(), f"retention {retention.kind}")
    reparameterization = retention.reparameterization()
    step = solution.subs(reparameterization)
    simplified = bounded_simplify(step)
    step = step if simplified is None else simplified  # a large solution is kept as solved
    steps: list[Step] = [
        ("objective", sp.Eq(J, objective)),
        ("stationarity", sp.Eq(stationarity, 0)),
        ("solution", sp.Eq(w, solution)),
        ("reparameterization", equations(reparameterization)),
        ("step", sp.Eq(w, step)),
    ]
    if retention.retained_factor() is not None:
        steps.append(
            (
                "grad_at: retained",
                "the runtime takes the bias gradient (inside u_t) at the retained state "
                "decay*w0 instead of w0; the step above is unchanged",
            )
        )
    return steps, step
