"""Elastic-net retention: decay plus soft thresholding."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Literal

from miras.components.base import POSITIVE, UNIT, Range, Retention, gate_or

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
    decay_gate: ClassVar[str | None] = "decay"
    derivation: ClassVar[str] = "elastic_net"

    def objective(self) -> sp.Expr:
        """One entry of <u, W> + 1/(2 eta) ||W - W_{t-1}||^2 + 1/(2 alpha) ||W||^2
        + gamma ||W||_1. The l1 weight gamma is the `threshold` itself (not scaled by alpha), so
        that after the reparameterization the threshold of the soft-thresholding is gamma."""
        import sympy as sp

        from miras.symbols import alpha, eta, gate_symbol, u, w, w0

        gamma = gate_symbol("threshold")
        return u * w + (w - w0) ** 2 / (2 * eta) + w**2 / (2 * alpha) + gamma * sp.Abs(w)

    def reparameterization(self) -> dict[sp.Symbol, sp.Expr]:
        """As for l2: 1/eta = a, 1/alpha = 1 - a (the quadratic part has curvature 1)."""
        from miras.symbols import alpha, eta, gate_symbol

        a = gate_symbol("decay")
        return {eta: 1 / a, alpha: 1 / (1 - a)}
