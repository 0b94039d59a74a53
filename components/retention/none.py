"""No retention: the memory keeps everything (linear attention, DeltaNet)."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Literal

from miras.components.base import Retention

if TYPE_CHECKING:  # annotations only: sympy is imported where used (components/base.py)
    import sympy as sp


class NoRetention(Retention):
    """No retention gate: the previous state is kept whole.

    Equation: W_t = argmin_W <u_t, W> + 1/2 ||W - W_{t-1}||^2 = W_{t-1} - u_t
    """

    kind: Literal["none"] = "none"
    linear_step: ClassVar[bool] = True

    def objective(self) -> sp.Expr:
        """One entry of <u, W> + (1/eta) D(W, W_{t-1}) with D = 1/2 ||W - W_{t-1}||^2, no G."""
        from miras.derive.symbols import eta, u, w, w0

        return u * w + (w - w0) ** 2 / (2 * eta)

    def reparameterization(self) -> dict[sp.Symbol, sp.Expr]:
        """eta = 1: the step size already lives in u_t (the optimizer's lr gate)."""
        import sympy as sp

        from miras.derive.symbols import eta

        return {eta: sp.Integer(1)}
