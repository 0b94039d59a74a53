"""Huber bias (Yaad)."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Literal

from miras.components.base import POSITIVE, Bias, GateDefaults, Range, gate_or

if TYPE_CHECKING:  # annotations only: sympy and torch are imported where used (components/base.py)
    import sympy as sp
    import torch


class HuberBias(Bias):
    """Huber loss: squared error for small errors, absolute error past the threshold delta.

    Equation: L = sum_j { 1/2 e_j^2 if |e_j| <= delta_t; delta_t (|e_j| - delta_t / 2) otherwise }   (MIRAS eq. 12, Yaad)
    """

    kind: Literal["huber"] = "huber"
    delta: gate_or(POSITIVE) = "gate"
    gateable: ClassVar[dict[str, Range]] = {"delta": POSITIVE}
    gate_defaults: ClassVar[dict[str, GateDefaults]] = {
        "delta": GateDefaults(probe_values=(0.03, 0.3, 3.0))
    }

    def expression(self) -> sp.Expr:
        import sympy as sp

        from miras.derive.symbols import ChannelSum, e, gate_symbol

        d = gate_symbol("delta")
        return ChannelSum(sp.Piecewise((e**2 / 2, sp.Abs(e) <= d), (d * (sp.Abs(e) - d / 2), True)))

    def reference_loss(self, y, v, delta=None, **scalars) -> torch.Tensor:
        import torch

        d = self.delta if delta is None else delta
        err = (y - v).abs()
        return torch.where(err <= d, 0.5 * err**2, d * (err - 0.5 * d)).sum(-1)
