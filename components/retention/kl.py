"""KL retention (Memora)."""

from __future__ import annotations

from typing import ClassVar, Literal

from miras.components.base import POSITIVE, UNIT, Range, Retention, gate_or, number


class KLRetention(Retention):
    """KL retention: each memory row is a scaled distribution kept close to the previous one.

    Equation: W_t = c Softmax((1 - lambda_t) log W_{t-1} - u_t) over each row, W > 0   (MIRAS eq. 20, Memora; a_t = 1 - lambda_t)
    """

    kind: Literal["kl"] = "kl"
    decay: gate_or(UNIT) = "gate"  # a_t = 1 - lambda_t
    scale: number(POSITIVE) = 1.0  # c: the sum of each row
    gateable: ClassVar[dict[str, Range]] = {"decay": UNIT}
    needs_positive_state: ClassVar[bool] = True
