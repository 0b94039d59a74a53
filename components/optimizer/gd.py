"""Gradient descent: one step of size lr_t."""

from __future__ import annotations

from typing import ClassVar, Literal

import torch

from miras.components.base import POSITIVE, Optimizer, Range, gate_or


class GD(Optimizer):
    """Plain gradient descent with a learning-rate gate.

    Equation: u_t = b_t g_t   (b_t = lr, the delta rule's beta_t)
    """

    kind: Literal["gd"] = "gd"
    lr: gate_or(POSITIVE) = "gate"
    gateable: ClassVar[dict[str, Range]] = {"lr": POSITIVE}

    def update(
        self, grad: torch.Tensor, state: torch.Tensor | None, lr: torch.Tensor
    ) -> tuple[torch.Tensor, None]:
        """`grad`: [..., *param]; `lr` broadcasts against it. Returns (u_t, no state)."""
        return lr * grad, None
