"""Robust (value-shift) bias."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Literal

from miras.components.base import POSITIVE, Bias, GateDefaults, Range, gate_or

if TYPE_CHECKING:  # annotations only: sympy and torch are imported where used (components/base.py)
    import sympy as sp
    import torch


class RobustBias(Bias):
    """Robust to a value shift of radius Delta: the worst case of l2 over ||delta v|| <= Delta.

    Equation: L = 1/2 ||e||^2 + Delta ||e|| + 1/2 Delta^2, e = M(k) - v   (MIRAS eq. 13; ||e|| ~ sqrt(||e||^2 + 1e-12))
    """

    kind: Literal["robust"] = "robust"
    radius: gate_or(POSITIVE) = 0.1
    gateable: ClassVar[dict[str, Range]] = {"radius": POSITIVE}
    gate_defaults: ClassVar[dict[str, GateDefaults]] = {
        "radius": GateDefaults(probe_values=(0.03, 0.3))
    }

    def expression(self) -> sp.Expr:
        import sympy as sp

        from miras.derive.formula import NORM_EPS
        from miras.derive.symbols import ChannelSum, e, gate_symbol

        r = gate_symbol("radius")
        sq = ChannelSum(e**2)
        return sq / 2 + r * sp.sqrt(sq + NORM_EPS) + r**2 / 2

    def reference_loss(self, y, v, radius=None, **scalars) -> torch.Tensor:
        import torch

        from miras.derive.formula import NORM_EPS

        r = self.radius if radius is None else radius
        if torch.is_tensor(r) and r.dim() > 0:
            r = r.squeeze(-1)  # a scalar per vector: [..., 1] -> [...]
        sq = ((y - v) ** 2).sum(-1)
        return 0.5 * sq + r * torch.sqrt(sq + float(NORM_EPS)) + 0.5 * r**2
