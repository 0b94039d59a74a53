"""No retention: the memory keeps everything (linear attention, DeltaNet)."""

from __future__ import annotations

from typing import Literal

from miras.components.base import Retention


class NoRetention(Retention):
    """No retention gate: the previous state is kept whole.

    Equation: W_t = argmin_W <u_t, W> + 1/2 ||W - W_{t-1}||^2 = W_{t-1} - u_t
    """

    kind: Literal["none"] = "none"
