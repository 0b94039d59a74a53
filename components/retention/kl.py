"""KL retention (Memora)."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Literal

from miras.components.base import POSITIVE, UNIT, Range, Retention, gate_or, number

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
    decay_gate: ClassVar[str | None] = "decay"
    derivation: ClassVar[str] = "kl"
    simplex_rows: ClassVar[bool] = True

    def objective(self) -> sp.Expr:
        """One entry of <u, W> + (1/eta) KL(W || W_{t-1}) + (1/alpha) sum W log W (negative
        entropy), minimized subject to each row of W summing to c (`scale`)."""
        import sympy as sp

        from miras.symbols import alpha, eta, u, w, w0

        return u * w + w * sp.log(w / w0) / eta + w * sp.log(w) / alpha

    def reparameterization(self) -> dict[sp.Symbol, sp.Expr]:
        """1/eta = a = 1 - lambda and 1/alpha = 1 - a = lambda (as for l2)."""
        from miras.symbols import alpha, eta, gate_symbol

        a = gate_symbol("decay")
        return {eta: 1 / a, alpha: 1 / (1 - a)}

    def domain(self) -> str:
        """Where the state lives: "real", "positive" or "unit_interval"."""
        return "positive"

    def row_sum(self) -> float:
        return self.scale

    def update_lines(self, step) -> list:
        """W_t = c softmax_row(logits): the derived step gives the logits."""
        from miras.terms import SOFTMAX_ROW, Call, Line, Math, scalar, sym, times

        softmax = Call(SOFTMAX_ROW, (Math(step("W_{t-1}")),))
        return [Line(sym("W_t"), times(scalar(self.scale, "scale"), softmax))]
