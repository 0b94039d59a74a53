"""Elastic-net retention: decay plus soft thresholding."""

from __future__ import annotations

from typing import ClassVar, Literal

from miras.components.base import POSITIVE, UNIT, Range, Retention, gate_or


class ElasticNetRetention(Retention):
    """Elastic net: l2 retention (gradual forgetting) plus l1 (small entries forgotten exactly).

    Equation: W_t = soft_threshold(a_t W_{t-1} - u_t, gamma)   (MIRAS eq. 21)
    """

    kind: Literal["elastic_net"] = "elastic_net"
    decay: gate_or(UNIT) = "gate"
    threshold: gate_or(POSITIVE) = 0.001  # gamma, the l1 weight
    gateable: ClassVar[dict[str, Range]] = {"decay": UNIT, "threshold": POSITIVE}
