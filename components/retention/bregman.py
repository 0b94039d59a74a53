"""Bregman retention with a potential written as a formula."""

from __future__ import annotations

from typing import Literal

from miras.components.base import Range, Retention, number

BINARY_ENTROPY = "w*log(w) + (1 - w)*log(1 - w)"


class BregmanRetention(Retention):
    """Bregman divergence of a convex potential F(w) as the retention (mirror descent).

    Equation: W_t = (F')^(-1)(F'(W_{t-1}) - u_t); binary entropy F gives the sigmoid   (MIRAS eq. 22)
    """

    kind: Literal["bregman"] = "bregman"
    potential: str = BINARY_ENTROPY  # F(w), a formula in `w`
    # closed_form: sympy must invert F'; newton: if it cannot, a few Newton steps on F'(w) = z.
    solver: Literal["closed_form", "newton"] = "closed_form"
    newton_steps: number(Range(1, 50, lo_closed=True, hi_closed=True), integer=True) = 5
