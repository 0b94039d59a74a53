"""Nonparametric memory: causal softmax attention, optionally over a sliding window.

The closed-form minimizer of sum_i exp(q . k_i) ||v - v_i||^2 (Nadaraya-Watson), so attention
and SWA are points of the same space as the parametric memories. The rule applies no scaling
to q (docs/architecture.md, the public call); a layer that wants 1/sqrt(d) scales q itself.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def run(window: int | None, q, k, v, initial_state) -> tuple[torch.Tensor, None]:
    """The closed form as an execution form (`miras.runtime.forms`): o [B, H, T, Dv] and no
    state, since attention carries none here (a layer keeps its KV cache itself)."""
    if initial_state is not None:
        raise ValueError("initial_state: softmax attention carries no state here; pass None")
    return forward(window, q, k, v), None


def forward(window: int | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q, k [B, H, T, Dk], v [B, H, T, Dv] -> o [B, H, T, Dv]."""
    t = q.shape[2]
    if window is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=1.0)
    i = torch.arange(t, device=q.device)
    distance = i[:, None] - i[None, :]
    mask = (distance >= 0) & (distance < window)  # token t sees t-window+1 .. t
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0)
