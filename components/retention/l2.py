"""Local and global l2 retention: the decay / forget gate (RetNet, Gated DeltaNet, Titans)."""

from __future__ import annotations

from typing import ClassVar, Literal

from miras.components.base import UNIT, Range, Retention, gate_or


class L2Retention(Retention):
    """Local l2 (stay near W_{t-1}) plus global l2 (stay small): a decay a_t on the state.

    Equation: W_t = argmin_W <u_t, W> + 1/(2 eta_t) ||W - W_{t-1}||^2 + 1/(2 alpha_t) ||W||^2 = a_t W_{t-1} - u_t   (MIRAS eq. 16)
    """

    kind: Literal["l2"] = "l2"
    decay: gate_or(UNIT) = "gate"
    # Where the bias gradient is taken: at W_{t-1} (MIRAS, Titans) or at the retained state
    # a_t W_{t-1} (the Gated DeltaNet order).
    grad_at: Literal["state", "retained"] = "state"
    gateable: ClassVar[dict[str, Range]] = {"decay": UNIT}
