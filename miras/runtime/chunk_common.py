"""The chunk steps every chunk form shares: the sequence cut into chunks, and the error signals
of the window's terms at a chunk's gradient point. Layout: `[B, H, T, D]` (miras.runtime.core).
"""

from __future__ import annotations

import torch

from miras.runtime.core import Runtime, Tokens


def window_gradients(rt: Runtime, predict, seq: Tokens, start: int, end: int):
    """For each window offset j = 0..c-1: (phi(k_i), error signal) for the chunk's tokens t,
    i = t - j: `grad_y` [B, H, n, Dv] = gamma_i dL/dy(M_{W_e,t}(phi(k_i)), v_i), zero where
    token i does not exist. `predict(x)`: M_{W_e,t}(x) for x [B, H, n, Dphi]."""
    out = []
    for j in range(rt.spec.window.c):
        # Token i = t - j sits at t + past - j in the window arrays: a contiguous slice.
        idx = slice(start + seq.past - j, end + seq.past - j)
        x = seq.phi_k[:, :, idx]
        y = predict(x)
        bias_args = [seq.window_gates[n][:, :, idx] for n in rt.bias_gates]
        grad_y = rt.functions.bias_grad(y, seq.v[:, :, idx], *bias_args)
        grad_y = grad_y * rt.scalar(
            rt.spec.window, rt.spec.window.weight_gate, seq.window_gates, idx
        )
        if seq.past:  # only the window reaches tokens that may not exist: selected away
            grad_y = torch.where(seq.valid[:, :, idx] > 0, grad_y, 0.0)
        out.append((x, grad_y))
    return out


def chunk_views(seq: Tokens, chunk_size: int) -> list[Tokens]:
    """The sequence as one `Tokens` per chunk, each indexed from its own first token.

    Split once with `torch.split`, so autograd joins the chunks' gradients in one op; slicing
    inside the loop would give every chunk a backward the size of the whole sequence (T^2).
    A window (past > 0) reads c - 1 tokens before its chunk, so its arrays overlap: sliced."""
    sizes = [min(chunk_size, seq.length - s) for s in range(0, seq.length, chunk_size)]
    starts = range(0, seq.length, chunk_size)

    def split(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return x.split(sizes, dim=2)

    def window(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if seq.past == 0:
            return split(x)
        return tuple(x[:, :, s : s + n + seq.past] for s, n in zip(starts, sizes, strict=True))

    q, k, v, valid = split(seq.phi_q), window(seq.phi_k), window(seq.v), window(seq.valid)
    step = {n: split(g) for n, g in seq.step_gates.items()}
    win = {n: window(g) for n, g in seq.window_gates.items()}
    return [
        Tokens(
            q[i],
            k[i],
            v[i],
            valid[i],
            {n: g[i] for n, g in step.items()},
            {n: g[i] for n, g in win.items()},
            seq.past,
        )
        for i in range(len(sizes))
    ]
