"""l_q retention (Moneta)."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Literal

from miras.components.base import DECAY_GATE, UNIT, GateDefaults, Range, Retention, gate_or, number

if TYPE_CHECKING:  # annotations only: sympy is imported where used (components/base.py)
    import sympy as sp


class LqRetention(Retention):
    """l_q retention: an l2-retained accumulator A_t, read out through l_q normalization.

    Equation: A_t = a_t A_{t-1} - u_t,  W_t = A_t / ||A_t||_q^(q-2)   (MIRAS eq. 24; Moneta: q = 4)
    """

    kind: Literal["lq"] = "lq"
    q: number(Range(1, 64, hi_closed=True)) = 4.0  # ||A||_q^(q-2): as lp's p, at most 64
    decay: gate_or(UNIT) = "gate"
    gateable: ClassVar[dict[str, Range]] = {"decay": UNIT}
    gate_defaults: ClassVar[dict[str, GateDefaults]] = {"decay": DECAY_GATE}
    decay_gate: ClassVar[str | None] = "decay"

    def spec_equation(self) -> str:
        """The docstring's equation with this spec's q in place of the paper's."""
        q = f"{self.q:g}"
        return (
            self.equation()
            .replace("||A_t||_q^(q-2)", f"||A_t||_{q}^{self.q - 2:g}")
            .replace("Moneta: q = 4", f"q = {q} here, 4 in Moneta")
        )

    def derive_step(self) -> tuple[list, sp.Expr]:
        """The l2 step on the accumulator A, then Moneta's normalization as the read map."""
        import sympy as sp

        from miras.derive.retention_solve import separable

        steps, step = separable(self)
        q = sp.nsimplify(self.q)
        steps = [(label.replace("step", "accumulator step"), value) for label, value in steps]
        steps.append(
            (
                "read",
                f"W_t = A_t / ||A_t||_q^(q-2) with q = {q}, the norm over each matrix (last two "
                "axes); this is Moneta's declared normalization, not an argmin: W/||W||_q^(q-2) "
                "is not the gradient of any potential unless q = 2",
            )
        )
        return steps, step

    def objective(self) -> sp.Expr:
        """One entry of the accumulator's objective: the l2 retention's, with w an entry of A.
        The read W = A / ||A||_q^(q-2) (per matrix) is Moneta's declared map, not an argmin."""
        from miras.derive.symbols import alpha, eta, u, w, w0

        return u * w + (w - w0) ** 2 / (2 * eta) + w**2 / (2 * alpha)

    def reparameterization(self) -> dict[sp.Symbol, sp.Expr]:
        """As for l2: 1/eta = a, 1/alpha = 1 - a."""
        from miras.derive.symbols import alpha, eta, gate_symbol

        a = gate_symbol("decay")
        return {eta: 1 / a, alpha: 1 / (1 - a)}

    def update_lines(self, step) -> list:
        """The accumulator's step, then the read W_t = A_t / ||A_t||_q^(q-2)."""
        from miras.derive.terms import Frac, Line, Math, Norm, Power, sym

        a_t = sym("A_t")
        read = Frac(a_t, Power(Norm(a_t, f"{self.q:g}"), f"{self.q - 2:g}"))
        return [Line(a_t, Math(step("A_{t-1}"))), Line(sym("W_t"), read)]

    def read_norm(self) -> float | None:
        return float(self.q)

    def reference_read(self, state):
        """Moneta's W = A / ||A||_q^(q-2) per matrix [..., out, in]; A = 0 reads as 0."""
        import torch

        q = float(self.q)
        norm = state.abs().pow(q).sum(dim=(-2, -1), keepdim=True).pow(1 / q)
        return torch.where(norm > 0, state / norm.clamp_min(1e-300) ** (q - 2), state)
