"""Bias pass, emission: the torch source of a derived bias.

bias_loss(y, v, *gates)   L per vector, [..., Dv] -> [..., 1]
bias_grad(y, v, *gates)   dL/dy, [..., Dv] -> [..., Dv], channel sums computed first
"""

from __future__ import annotations

import sympy as sp

from miras.derive.printer import torch_code
from miras.derive.symbols import ChannelSum, channels


def bias_source(loss, sums, gradient, gates, fixed) -> str:
    """bias_loss and bias_grad; fixed parameters become literals."""
    values = {sp.Symbol(n, positive=True): sp.nsimplify(x) for n, x in fixed.items()}
    args = ", ".join(["y", "v", *gates])
    loss_body = torch_code(loss.subs(values))
    # The channel count, where the loss reads it (a mean over the channels).
    count = [f"    {channels} = e.shape[-1]"] if loss.has(channels) else []
    lines = [
        f"def bias_loss({args}):",
        '    """L per vector: [..., Dv] -> [..., 1]."""',
        "    e = y - v",
        *count,
        f"    return torch.zeros_like(e[..., :1]) + {loss_body}",
        "",
        "",
        f"def bias_grad({args}):",
        '    """dL/dy: [..., Dv] -> [..., Dv]."""',
        "    e = y - v",
        *count,
    ]
    lines += [f"    {s} = {torch_code(ChannelSum(f).subs(values))}" for s, f in sums]
    # zeros_like keeps the output a full tensor when the gradient is constant or misses e.
    lines.append(f"    return torch.zeros_like(e) + {torch_code(gradient.subs(values))}")
    return "\n".join(lines) + "\n"
