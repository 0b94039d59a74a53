"""Nonparametric memory: softmax attention as the closed-form solution."""

from __future__ import annotations

import math
from typing import Literal

from miras.components.base import Memory, Range, number


class NonparametricMemory(Memory):
    """Softmax attention over the whole past, or the last `window` tokens (SWA).

    Equation: M_t(q) = sum_{i <= t} softmax_i(q . k_i) v_i, the Nadaraya-Watson minimizer of sum_i s(q, k_i) ||v - v_i||^2 (MIRAS section 3)
    """

    kind: Literal["nonparametric"] = "nonparametric"
    window: number(Range(1, math.inf, lo_closed=True), integer=True) | None = None

    def parameter_shapes(self, d_in: int, d_out: int) -> dict[str, tuple[int, ...]]:
        return {}
