"""Momentum: Titans' surprise with its decay."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Literal

from miras.components.base import (
    HALF_OPEN_UNIT,
    MOMENTUM_GATE,
    NONNEGATIVE,
    STEP_SIZE_GATE,
    GateDefaults,
    Optimizer,
    Range,
    gate_or,
)
from miras.components.optimizer.steps import SteppedOptimizer

if TYPE_CHECKING:
    import torch  # annotations only; imported where used (loading a spec needs no torch)


class Momentum(SteppedOptimizer):
    """Momentum over the inner gradient: the past surprise decays by theta_t (Titans eq. 10).

    Equation: s_t = theta_t s_{t-1} + b_t g_t,  u_t = s_t
    """

    kind: Literal["momentum"] = "momentum"
    lr: gate_or(NONNEGATIVE) = "gate"
    momentum: gate_or(HALF_OPEN_UNIT) = "gate"
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
        """`grad`, `state`: [..., *param]. Returns (u_t, s_t)."""
        s = lr * grad if state is None else momentum * state + lr * grad
        return s, s

    def update_expressions(self) -> tuple:
        """u_t = s_t, s_t = theta_t s_{t-1} + lr_t g_t."""
        from miras.derive.symbols import s_new

        return s_new, surprise_expression()

    def update_lines(self) -> list:
        from miras.derive.terms import Line, sym

        return [*surprise_lines(self), Line(sym("u_t"), sym("S_t")), *self.steps_lines()]


def surprise_expression():
    """s_t = theta_t s_{t-1} + lr_t g_t in sympy, the state Momentum and Nesterov share."""
    from miras.derive.symbols import g, gate_symbol, s_prev

    return gate_symbol("momentum") * s_prev + gate_symbol("lr") * g


def surprise_lines(opt: Optimizer) -> list:
    """S_t = theta_t S_{t-1} + lr_t g_t, the momentum that Muon and Nesterov share."""
    from miras.derive.terms import Line, Plus, scalar, sym, times

    step = times(scalar(opt.lr, "lr"), sym("g_t"))
    surprise = times(scalar(opt.momentum, "momentum"), sym("S_{t-1}"))
    return [Line(sym("S_t"), Plus((surprise, step)))]
