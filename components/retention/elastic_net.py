"""Elastic-net retention: decay plus soft thresholding."""

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
)

if TYPE_CHECKING:  # annotations only: sympy is imported where used (components/base.py)
    import sympy as sp


class ElasticNetRetention(Retention):
    """Elastic net: l2 retention (gradual forgetting) plus l1 (small entries forgotten exactly).

    Equation: W_t = soft_threshold(a_t W_{t-1} - u_t, gamma)   (MIRAS eq. 21)
    """

    kind: Literal["elastic_net"] = "elastic_net"
    decay: gate_or(UNIT) = "gate"
    threshold: gate_or(POSITIVE) = 0.001  # gamma, the l1 weight
    gateable: ClassVar[dict[str, Range]] = {"decay": UNIT, "threshold": POSITIVE}
    gate_defaults: ClassVar[dict[str, GateDefaults]] = {
        "decay": DECAY_GATE,
        "threshold": GateDefaults(start=1e-3, probe_values=(0.001, 0.01)),
    }
    decay_gate: ClassVar[str | None] = "decay"

    def derive_step(self) -> tuple[list, sp.Expr]:
        """Subgradient cases of J = smooth(w) + gamma |w|: w > 0, w < 0, and 0 in dJ(0)."""
        import sympy as sp

        from miras.derive.retention_solve import J, equations, solve_unique
        from miras.derive.symbols import soft_threshold, w
        from miras.errors import DerivationError

        objective = self.objective()
        reparameterization = self.reparameterization()
        gated = objective.subs(reparameterization)
        smooth = gated.subs(sp.Abs(w), 0)
        weight = sp.simplify((gated - smooth) / sp.Abs(w))  # gamma, the l1 weight
        curvature = sp.simplify(sp.diff(smooth, w, 2))
        if weight.has(w) or curvature.has(w) or weight == 0:
            raise DerivationError(
                f"retention {self.kind}: expected a quadratic plus gamma*|w|, got {gated}"
            )
        slope = sp.diff(smooth, w)
        positive = solve_unique(slope + weight, w, "case w > 0")  # d|w|/dw = 1
        negative = solve_unique(slope - weight, w, "case w < 0")  # d|w|/dw = -1
        at_zero = slope.subs(w, 0)  # 0 is optimal iff |smooth'(0)| <= gamma (d|w| at 0: [-1, 1])
        assembled = sp.Piecewise((positive, positive > 0), (negative, negative < 0), (0, True))
        # A quadratic with curvature k: w = soft_threshold(-smooth'(0)/k, gamma/k). Confirm that
        # the three cases are exactly the branches of that soft thresholding.
        center, threshold = sp.simplify(-at_zero / curvature), sp.simplify(weight / curvature)
        branches = (positive - (center - threshold), negative - (center + threshold))
        if any(sp.simplify(b) != 0 for b in branches):
            raise DerivationError(f"retention {self.kind}: the cases are not soft thresholding")
        step = soft_threshold(center, threshold)
        steps = [
            ("objective", sp.Eq(J, objective)),
            ("reparameterization", equations(reparameterization)),
            ("objective (gates)", sp.Eq(J, gated)),
            ("case w > 0", sp.Eq(w, positive)),
            ("case w < 0", sp.Eq(w, negative)),
            ("case w = 0", sp.Abs(at_zero) <= weight),
            ("assembled", sp.Eq(w, assembled)),
            ("step", sp.Eq(w, step)),
        ]
        return steps, step

    def objective(self) -> sp.Expr:
        """One entry of <u, W> + 1/(2 eta) ||W - W_{t-1}||^2 + 1/(2 alpha) ||W||^2
        + gamma ||W||_1. The l1 weight gamma is the `threshold` itself (not scaled by alpha), so
        that after the reparameterization the threshold of the soft-thresholding is gamma."""
        import sympy as sp

        from miras.derive.symbols import alpha, eta, gate_symbol, u, w, w0

        gamma = gate_symbol("threshold")
        return u * w + (w - w0) ** 2 / (2 * eta) + w**2 / (2 * alpha) + gamma * sp.Abs(w)

    def reparameterization(self) -> dict[sp.Symbol, sp.Expr]:
        """As for l2: 1/eta = a, 1/alpha = 1 - a (the quadratic part has curvature 1)."""
        from miras.derive.symbols import alpha, eta, gate_symbol

        a = gate_symbol("decay")
        return {eta: 1 / a, alpha: 1 / (1 - a)}
