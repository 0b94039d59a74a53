"""Gradient descent: one step of size lr_t."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Literal

from miras.components.base import NONNEGATIVE, STEP_SIZE_GATE, GateDefaults, Range, gate_or
from miras.components.optimizer.steps import SteppedOptimizer

if TYPE_CHECKING:
    import torch  # annotations only; imported where used (loading a spec needs no torch)


class GD(SteppedOptimizer):
    """Plain gradient descent with a learning-rate gate; `steps: n` takes n steps per token,
    on the token's key and value or (`keys: per_step`) on n keys and values of its own
    (DeltaProduct, Siems et al. 2025, arXiv:2502.10297, eq. 4).

    Equation: u_t = b_t g_t   (b_t = lr, the delta rule's beta_t)
    """

    kind: Literal["gd"] = "gd"
    lr: gate_or(NONNEGATIVE) = "gate"
    gateable: ClassVar[dict[str, Range]] = {"lr": NONNEGATIVE}
    gate_defaults: ClassVar[dict[str, GateDefaults]] = {"lr": STEP_SIZE_GATE}
    step_size_gate: ClassVar[str | None] = "lr"

    def update(
        self, grad: torch.Tensor, state: torch.Tensor | None, lr: torch.Tensor
    ) -> tuple[torch.Tensor, None]:
        """`grad`: [..., *param]; `lr` broadcasts against it. Returns (u_t, no state)."""
        return lr * grad, None

    def update_expressions(self) -> tuple:
        """u_t = lr_t g_t, no state."""
        from miras.derive.symbols import g, gate_symbol

        return gate_symbol("lr") * g, None

    def update_lines(self) -> list:
        from miras.derive.terms import Line, scalar, sym, times

        return [Line(sym("u_t"), times(scalar(self.lr, "lr"), sym("g_t"))), *self.steps_lines()]
