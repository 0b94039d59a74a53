"""Muon: momentum orthogonalized by Newton-Schulz (ATLAS)."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Literal

from miras.components.base import HALF_OPEN_UNIT, POSITIVE, Optimizer, Range, gate_or, number

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


class Muon(Optimizer):
    """Momentum, then Newton-Schulz orthogonalization of each matrix parameter (ATLAS eq. 30).

    Equation: s_t = theta_t s_{t-1} + b_t g_t,  u_t = NewtonSchulz_k(s_t), k = 5
    """

    kind: Literal["muon"] = "muon"
    lr: gate_or(POSITIVE) = "gate"
    momentum: gate_or(HALF_OPEN_UNIT) = "gate"
    ns_steps: number(Range(1, 10, lo_closed=True, hi_closed=True), integer=True) = 5
    gateable: ClassVar[dict[str, Range]] = {"lr": POSITIVE, "momentum": HALF_OPEN_UNIT}
    stateful: ClassVar[bool] = True

    def update(
        self,
        grad: torch.Tensor,
        state: torch.Tensor | None,
        lr: torch.Tensor,
        momentum: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`grad`, `state`: [..., m, n]. Returns (u_t, s_t)."""
        s = lr * grad if state is None else momentum * state + lr * grad
        return newton_schulz(s, self.ns_steps), s

    def update_lines(self) -> list:
        from miras.components.optimizer.momentum import surprise_lines
        from miras.terms import Call, Line, Name, sym

        n = self.ns_steps
        newton_schulz = Name(f"NewtonSchulz{n}", rf"\operatorname{{NewtonSchulz}}_{{{n}}}")
        return [*surprise_lines(self), Line(sym("u_t"), Call(newton_schulz, (sym("S_t"),)))]
