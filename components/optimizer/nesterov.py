"""Nesterov momentum: the update looks one step ahead along the momentum."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from miras.components.base import (
    HALF_OPEN_UNIT,
    MOMENTUM_GATE,
    NONNEGATIVE,
    STEP_SIZE_GATE,
    GateDefaults,
    Range,
    gate_or,
)
from miras.components.optimizer.steps import SteppedOptimizer


class Nesterov(SteppedOptimizer):
    """Nesterov momentum over the inner gradient (Sutskever et al. 2013, in the form of
    PyTorch's SGD with nesterov=True): the step adds the momentum once more, decayed.

    Equation: s_t = theta_t s_{t-1} + b_t g_t,  u_t = theta_t s_t + b_t g_t
    """

    kind: Literal["nesterov"] = "nesterov"
    lr: gate_or(NONNEGATIVE) = "gate"
    momentum: gate_or(HALF_OPEN_UNIT) = "gate"
    gateable: ClassVar[dict[str, Range]] = {"lr": NONNEGATIVE, "momentum": HALF_OPEN_UNIT}
    gate_defaults: ClassVar[dict[str, GateDefaults]] = {
        "lr": STEP_SIZE_GATE,
        "momentum": MOMENTUM_GATE,
    }
    step_size_gate: ClassVar[str | None] = "lr"
    stateful: ClassVar[bool] = True

    def update(self, grad: Any, state: Any, lr: Any, momentum: Any) -> tuple[Any, Any]:
        """`grad`, `state`: [..., *param]. Returns (u_t, s_t)."""
        step = lr * grad
        s = step if state is None else momentum * state + step
        return momentum * s + step, s

    def update_expressions(self) -> tuple:
        """u_t = theta_t s_t + lr_t g_t, s_t = theta_t s_{t-1} + lr_t g_t."""
        from miras.components.optimizer.momentum import surprise_expression
        from miras.derive.symbols import g, gate_symbol, s_new

        lr, theta = gate_symbol("lr"), gate_symbol("momentum")
        return theta * s_new + lr * g, surprise_expression()

    def update_lines(self) -> list:
        from miras.components.optimizer.momentum import surprise_lines
        from miras.derive.terms import Line, Plus, scalar, sym, times

        step = times(scalar(self.lr, "lr"), sym("g_t"))
        ahead = times(scalar(self.momentum, "momentum"), sym("S_t"))
        return [*surprise_lines(self), Line(sym("u_t"), Plus((ahead, step))), *self.steps_lines()]
