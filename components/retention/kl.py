"""KL retention (Memora)."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Literal

from miras.components.base import (
    DECAY_GATE,
    POSITIVE,
    UNIT,
    GateDefaults,
    Range,
    Retention,
    gate_or,
    number,
)

if TYPE_CHECKING:  # annotations only: sympy is imported where used (components/base.py)
    import sympy as sp


class KLRetention(Retention):
    """KL retention: each memory row is a scaled distribution kept close to the previous one.

    Equation: W_t = c Softmax((1 - lambda_t) log W_{t-1} - u_t) over each row, W > 0   (MIRAS eq. 20, Memora; a_t = 1 - lambda_t)
    """

    kind: Literal["kl"] = "kl"
    decay: gate_or(UNIT) = "gate"  # a_t = 1 - lambda_t
    scale: number(POSITIVE) = 1.0  # c: the sum of each row
    gateable: ClassVar[dict[str, Range]] = {"decay": UNIT}
    gate_defaults: ClassVar[dict[str, GateDefaults]] = {"decay": DECAY_GATE}
    decay_gate: ClassVar[str | None] = "decay"
    simplex_rows: ClassVar[bool] = True

    def derive_step(self) -> tuple[list, sp.Expr]:
        """Lagrange multiplier mu for the row sum: w = exp(z) * (a factor in mu alone), and the
        row sum fixes the factor, giving c softmax(z) over the row. The step is the logits z."""
        import sympy as sp
        from sympy.utilities.iterables import sift

        from miras.derive.retention_solve import J, equations, solve_unique
        from miras.derive.symbols import w
        from miras.errors import DerivationError

        # Display-only symbols (never printed to torch).
        mu = sp.Symbol("mu", real=True)  # the Lagrange multiplier of one row's sum
        S = sp.Symbol("S", positive=True)  # sum_j exp(z_j) over one row
        c = sp.Symbol("c", positive=True)  # the row sum (`scale`)
        softmax = sp.Function("softmax")  # over the row, shown in the derivation only

        objective = self.objective()
        reparameterization = self.reparameterization()
        gated = objective.subs(reparameterization)
        lagrangian = gated + mu * w  # one mu per row: + mu (sum_j w_j - c)
        stationarity = sp.diff(lagrangian, w)
        solution = solve_unique(stationarity, w, f"retention {self.kind}")
        log_w = sp.expand(sp.expand_log(sp.log(solution), force=True))
        # Split log w into the row's common part (terms in mu, and numbers) and per-entry
        # logits z.
        row_terms, entry_terms = sift(
            sp.Add.make_args(log_w), lambda t: t.has(mu) or t.is_number, binary=True
        )
        row_part, logits = sp.Add(*row_terms), sp.Add(*entry_terms)
        if row_part.free_symbols != {mu}:
            raise DerivationError(
                f"retention {self.kind}: log w = {log_w} does not split into logits plus a "
                "factor that depends on the row's multiplier alone"
            )
        # sum_j w_j = exp(row_part) * S = c with S = sum_j exp(z_j).
        constraint = sp.Eq(sp.exp(row_part) * S, c)
        (multiplier,) = sp.solve(constraint, mu)
        w_row = sp.simplify(sp.exp(logits) * sp.exp(row_part.subs(mu, multiplier)))
        if sp.simplify(w_row - c * sp.exp(logits) / S) != 0:
            raise DerivationError(f"retention {self.kind}: the row sum gives {w_row}")
        steps = [
            ("objective", sp.Eq(J, objective)),
            ("reparameterization", equations(reparameterization)),
            ("lagrangian", sp.Eq(J, lagrangian)),
            ("stationarity", sp.Eq(stationarity, 0)),
            ("solution", sp.Eq(w, solution)),
            ("separated", sp.Eq(sp.log(w), sp.Add(logits, row_part, evaluate=False))),
            ("row sum", constraint),
            ("multiplier", sp.Eq(mu, multiplier)),
            ("solution (row)", sp.Eq(w, w_row)),
            ("step", sp.Eq(w, c * softmax(logits))),
            ("where", f"S = sum_j exp(z_j) over the row, c = {self.scale:g}"),
        ]
        return steps, logits

    def objective(self) -> sp.Expr:
        """One entry of <u, W> + (1/eta) KL(W || W_{t-1}) + (1/alpha) sum W log W (negative
        entropy), minimized subject to each row of W summing to c (`scale`)."""
        import sympy as sp

        from miras.derive.symbols import alpha, eta, u, w, w0

        return u * w + w * sp.log(w / w0) / eta + w * sp.log(w) / alpha

    def reparameterization(self) -> dict[sp.Symbol, sp.Expr]:
        """1/eta = a = 1 - lambda and 1/alpha = 1 - a = lambda (as for l2)."""
        from miras.derive.symbols import alpha, eta, gate_symbol

        a = gate_symbol("decay")
        return {eta: 1 / a, alpha: 1 / (1 - a)}

    def domain(self) -> str:
        """Where the state lives: "real", "positive" or "unit_interval"."""
        return "positive"

    def row_sum(self) -> float:
        return self.scale

    def update_lines(self, step) -> list:
        """W_t = c softmax_row(logits): the derived step gives the logits."""
        from miras.derive.terms import SOFTMAX_ROW, Call, Line, Math, scalar, sym, times

        softmax = Call(SOFTMAX_ROW, (Math(step("W_{t-1}")),))
        return [Line(sym("W_t"), times(scalar(self.scale, "scale"), softmax))]
