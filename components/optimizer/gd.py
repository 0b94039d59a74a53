"""Gradient descent: one step of size lr_t."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Literal

from miras.components.base import NONNEGATIVE, Optimizer, Range, gate_or

if TYPE_CHECKING:
    import torch  # annotations only; imported where used (loading a spec needs no torch)


class GD(Optimizer):
    """Plain gradient descent with a learning-rate gate.

    Equation: u_t = b_t g_t   (b_t = lr, the delta rule's beta_t)
    """

    kind: Literal["gd"] = "gd"
    lr: gate_or(NONNEGATIVE) = "gate"
    gateable: ClassVar[dict[str, Range]] = {"lr": NONNEGATIVE}
    linear_form: ClassVar[str | None] = "step"

    def update(
        self, grad: torch.Tensor, state: torch.Tensor | None, lr: torch.Tensor
    ) -> tuple[torch.Tensor, None]:
        """`grad`: [..., *param]; `lr` broadcasts against it. Returns (u_t, no state)."""
        return lr * grad, None

    def update_lines(self) -> list:
        from miras.terms import Line, scalar, sym, times

        return [Line(sym("u_t"), times(scalar(self.lr, "lr"), sym("g_t")))]
