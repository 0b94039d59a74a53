"""Shared test inputs: random q, k, v and in-range gates for a compiled rule."""

from __future__ import annotations

import torch

from miras.components.base import HALF_OPEN_UNIT, UNIT
from miras.runtime import per_channel_gates


def random_inputs(
    rule, *, b=2, t=13, h=2, dk=4, dv=4, per_channel=False, seed=0, dtype=torch.float64
):
    """q, k (l2-normalized rows, as the layer feeds them), v and gates in their ranges; with
    `per_channel`, [B, T, H, Dv] for every gate the rule takes per channel."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(b, t, h, dk, generator=gen, dtype=dtype), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(b, t, h, dk, generator=gen, dtype=dtype), dim=-1)
    v = torch.randn(b, t, h, dv, generator=gen, dtype=dtype)
    gates = {}
    channels = per_channel_gates(rule) if per_channel else set()
    for info in rule.plan.gates:
        shape = (b, t, h, dv) if info.name in channels else (b, t, h)
        r = torch.rand(*shape, generator=gen, dtype=dtype)
        if info.allowed == UNIT:
            gates[info.name] = 0.8 + 0.2 * r  # a decay
        elif info.allowed == HALF_OPEN_UNIT:
            gates[info.name] = 0.9 * r  # a momentum
        else:
            gates[info.name] = 0.1 + 0.4 * r  # a learning rate, threshold, scale
    return q, k, v, gates
