"""l_q retention (Moneta)."""

from __future__ import annotations

import math
from typing import ClassVar, Literal

from miras.components.base import UNIT, Range, Retention, gate_or, number


class LqRetention(Retention):
    """l_q retention: an l2-retained accumulator A_t, read out through l_q normalization.

    Equation: A_t = a_t A_{t-1} - u_t,  W_t = A_t / ||A_t||_q^(q-2)   (MIRAS eq. 24, Moneta; q = 4)
    """

    kind: Literal["lq"] = "lq"
    q: number(Range(1, math.inf)) = 4.0
    decay: gate_or(UNIT) = "gate"
    gateable: ClassVar[dict[str, Range]] = {"decay": UNIT}
