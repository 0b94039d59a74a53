"""What a retention's derivation is written with: the objective's display symbol, a unique
solve, and the default strategy, `separable` (solve dJ/dw = 0 per entry, then reparameterize).

Each retention component derives its own step (`Retention.derive_step`): a smooth objective
takes `separable` (the base's default), and a retention of another shape writes its strategy in
its own file (elastic_net's subgradient cases, kl's Lagrange multiplier, bregman's mirror step,
lq's accumulator and read) from these pieces. `miras.derive.retention_derive` runs the
component's strategy and emits the step. Sympy only; nothing here imports a component.
"""

from __future__ import annotations

from typing import Any

import sympy as sp

from miras.derive.formula import bounded_simplify
from miras.derive.symbols import w
from miras.errors import DerivationError

J = sp.Symbol("J")  # the objective's value (display only, never printed to torch)
# One line of a derivation: (label, an equation or a note) -- `miras.ir.Step`, which this
# module does not import (the components import it, and the IR names components).
Step = tuple[str, "sp.Basic | str"]


def equations(mapping: dict[sp.Symbol, sp.Expr]) -> sp.Tuple:
    """A substitution as a tuple of equations, for a derivation's display."""
    return sp.Tuple(*(sp.Eq(k, v) for k, v in mapping.items()))


def solve_unique(equation: sp.Expr, symbol: sp.Symbol, what: str) -> sp.Expr:
    """The one solution of `equation = 0` for `symbol`, or a DerivationError."""
    try:
        solutions = sp.solve(equation, symbol)
    except NotImplementedError as err:
        raise DerivationError(f"{what}: sympy cannot solve {equation} = 0 ({err})") from None
    if not solutions:
        raise DerivationError(f"{what}: sympy found no solution of {equation} = 0 for {symbol}")
    if len(solutions) > 1:
        listed = ", ".join(map(str, solutions))
        raise DerivationError(
            f"{what}: expected one solution of {equation} = 0 for {symbol}, sympy found "
            f"{len(solutions)}: {listed}"
        )
    return solutions[0]


def separable(retention: Any) -> tuple[list[Step], sp.Expr]:
    """A smooth objective, one entry at a time: solve dJ/dw = 0, then reparameterize.
    `retention`: a `miras.derive.protocols.RetentionParts`; returns (steps, step)."""
    objective = retention.objective()
    stationarity = sp.expand(sp.diff(objective, w))
    solution = solve_unique(stationarity, w, f"retention {retention.kind}")
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
