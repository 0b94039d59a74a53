"""Local and global l2 retention: the decay / forget gate (RetNet, Gated DeltaNet, Titans)."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Literal

from miras.components.base import DECAY_GATE, UNIT, GateDefaults, Range, Retention, gate_or

if TYPE_CHECKING:  # annotations only: sympy is imported where used (components/base.py)
    import sympy as sp


class L2Retention(Retention):
    """Local l2 (stay near W_{t-1}) plus global l2 (stay small): a decay a_t on the state.

    Equation: W_t = argmin_W <u_t, W> + 1/(2 eta_t) ||W - W_{t-1}||^2 + 1/(2 alpha_t) ||W||^2 = a_t W_{t-1} - u_t   (MIRAS eq. 16)
    """

    kind: Literal["l2"] = "l2"
    decay: gate_or(UNIT) = "gate"
    # Where the bias gradient is taken: at W_{t-1} (MIRAS, Titans) or at the retained state
    # a_t W_{t-1} (the Gated DeltaNet order).
    grad_at: Literal["state", "retained"] = "state"
    gateable: ClassVar[dict[str, Range]] = {"decay": UNIT}
    gate_defaults: ClassVar[dict[str, GateDefaults]] = {"decay": DECAY_GATE}
    linear_step: ClassVar[bool] = True
    decay_gate: ClassVar[str | None] = "decay"

    def objective(self) -> sp.Expr:
        """One entry of <u, W> + 1/(2 eta) ||W - W_{t-1}||^2 + 1/(2 alpha) ||W||^2."""
        from miras.symbols import alpha, eta, u, w, w0

        return u * w + (w - w0) ** 2 / (2 * eta) + w**2 / (2 * alpha)

    def reparameterization(self) -> dict[sp.Symbol, sp.Expr]:
        """1/eta = a and 1/alpha = 1 - a: the curvature 1/eta + 1/alpha is 1, so u_t enters
        unscaled and a_t multiplies W_{t-1}. At a = 1 the global term vanishes (1/alpha = 0)."""
        from miras.symbols import alpha, eta, gate_symbol

        a = gate_symbol("decay")
        return {eta: 1 / a, alpha: 1 / (1 - a)}

    def retained_factor(self) -> str | None:
        return "decay" if self.grad_at == "retained" else None
