"""Muon: momentum orthogonalized by Newton-Schulz, then scaled by the step size (ATLAS)."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Literal

from miras.components.base import (
    HALF_OPEN_UNIT,
    MOMENTUM_GATE,
    NONNEGATIVE,
    STEP_SIZE_GATE,
    GateDefaults,
    Range,
    gate_or,
    number,
)
from miras.components.optimizer.steps import SteppedOptimizer

if TYPE_CHECKING:
    import torch  # annotations only; imported where used (loading a spec needs no torch)

# Coefficients of the quintic Newton-Schulz iteration used by Muon: they push every singular
# value of a normalized matrix towards 1 in a few steps.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def newton_schulz(s: torch.Tensor, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """Approximate U V^T of s = U S V^T. `s`: [..., m, n] (batched matrices)."""
    import torch

    a, b, c = NS_COEFFICIENTS
    x = s / (torch.linalg.matrix_norm(s, keepdim=True) + eps)
    tall = x.shape[-2] > x.shape[-1]
    if tall:
        x = x.mT
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.mT if tall else x


class Muon(SteppedOptimizer):
    """Momentum of the raw gradient, orthogonalized by Newton-Schulz per matrix parameter, then
    scaled by the step size (ATLAS eq. 30).

    Equation: s_t = theta_t s_{t-1} + g_t,  u_t = b_t NewtonSchulz_k(s_t), k = 5

    The step size b_t (gate `lr`, ATLAS's eta_t) multiplies the orthogonalized direction: inside
    the momentum it would be normalized away, since NewtonSchulz(c s) = NewtonSchulz(s) for any
    c > 0. Each singular value of u_t is then about b_t."""

    kind: Literal["muon"] = "muon"
    lr: gate_or(NONNEGATIVE) = "gate"
    momentum: gate_or(HALF_OPEN_UNIT) = "gate"
    ns_steps: number(Range(1, 10, lo_closed=True, hi_closed=True), integer=True) = 5
    gateable: ClassVar[dict[str, Range]] = {"lr": NONNEGATIVE, "momentum": HALF_OPEN_UNIT}
    gate_defaults: ClassVar[dict[str, GateDefaults]] = {
        "lr": STEP_SIZE_GATE,
        "momentum": MOMENTUM_GATE,
    }
    step_size_gate: ClassVar[str | None] = "lr"
    stateful: ClassVar[bool] = True

    def update(
        self,
        grad: torch.Tensor,
        state: torch.Tensor | None,
        lr: torch.Tensor,
        momentum: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`grad`, `state`: [..., m, n]; `lr`, `momentum` broadcast against them. Returns
        (u_t, s_t)."""
        s = grad if state is None else momentum * state + grad
        return lr * newton_schulz(s, self.ns_steps), s

    def update_lines(self) -> list:
        from miras.derive.terms import Call, Line, Name, Plus, scalar, sym, times

        n = self.ns_steps
        newton_schulz = Name(f"NewtonSchulz{n}", rf"\operatorname{{NewtonSchulz}}_{{{n}}}")
        surprise = times(scalar(self.momentum, "momentum"), sym("S_{t-1}"))
        direction = Call(newton_schulz, (sym("S_t"),))
        return [
            Line(sym("S_t"), Plus((surprise, sym("g_t")))),
            Line(sym("u_t"), times(scalar(self.lr, "lr"), direction)),
            *self.steps_lines(),
        ]
