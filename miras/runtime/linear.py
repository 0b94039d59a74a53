"""The linear fast path of the chunk-start form: the chunk collapses into matmuls with decay
masks, no per-token state.

It applies where every piece of the step is linear, as the compiler's chunk_form pass records
(`miras.compiler.affine.start_path`, `ChunkForm.start_path`):
- the memory is linear in its weights (M_W(x) = W x: the matrix memory);
- the retention's step is W_t = a_t W_{t-1} - u_t (`Retention.linear_step`; a_t its
  `decay_gate`, or 1);
- the optimizer's update is linear in g_t in one of the two recurrences unrolled here
  (`Optimizer.linear_form`): u_t = lr_t g_t, or momentum s_t = theta_t s_{t-1} + lr_t g_t.
Any bias: its gradients are taken at the chunk-start state, as in `miras.runtime.chunk`.
"""

from __future__ import annotations

import functools

import torch

from miras.runtime.chunk_common import chunk_views, window_gradients
from miras.runtime.core import Runtime, State, Tokens, gate_values


def _decay_matrix(factors: torch.Tensor) -> torch.Tensor:
    """L[t, s] = prod_{j=s+1..t} a_j for s <= t, else 0. `factors` [B, H, n, X] ->
    [B, H, X, n, n] (X = 1 per head or Dv per channel).

    Built as exp of segment sums of log a, accumulated (never differenced), so a zero factor
    (momentum theta = 0) gives exact zeros instead of inf - inf."""
    log_a = torch.log(factors).movedim(-1, 2)  # [B, H, X, n]
    n = log_a.shape[-1]
    above_strict, above = _masks(n, str(log_a.device))
    terms = log_a.unsqueeze(-1).expand(*log_a.shape, n).masked_fill(above, 0.0)
    segment = torch.cumsum(terms, dim=-2)  # [.., t, s] = sum_{s<j<=t} log a_j below the diagonal
    return segment.masked_fill(above_strict, float("-inf")).exp()


@functools.lru_cache(maxsize=64)
def _masks(n: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(s > t, s >= t) for an n x n chunk: the entries above the diagonal, strictly or not."""
    above_strict = torch.ones(n, n, dtype=torch.bool, device=device).triu(1)
    return above_strict, torch.ones(n, n, dtype=torch.bool, device=device).triu()


def forward(rt: Runtime, seq: Tokens, state: State, chunk_size: int):
    """Returns o [B, H, T, Dv] and the final state; the chunk's tokens as matmuls.

    With u_t the update, the recurrence
    W_t = a_t W_{t-1} - u_t unrolls inside a chunk to
        W_t = D_t W_S - sum_{s<=t} L^a[t, s] u_s,   D_t = prod_{j<=t} a_j,
    and momentum u_s = theta_s u_{s-1} + lr_s g_s unrolls the same way with L^theta; both are
    lower-triangular decay matrices, so the read o_t = W_t phi(q_t) is a masked matmul over
    the chunk's error signals G (each g_s = sum_j G_{s,j} phi(k_{s-j})^T). Exact at b = 1."""
    opt = rt.spec.optimizer
    retention = rt.spec.retention
    momentum = opt.linear_form == "momentum"
    state = dict(state)
    outputs = []
    for part in chunk_views(seq, chunk_size):
        gates = part.step_gates
        start, end = 0, part.length
        sl = slice(start, end)
        like = part.phi_q
        w_s = state["W"]  # [B, H, Dv, Dphi]
        if retention.decay_gate is not None:
            decay = gate_values(retention, retention.decay_gate, gates, sl, like)  # [B, H, n, X]
        else:
            decay = torch.ones_like(like[..., :1])
        d_t = torch.cumprod(decay, dim=2)  # prod_{j=s..t} a_j: [B, H, n, X]
        w_t = w_s.transpose(-1, -2)  # [B, H, Dphi, Dv]

        def predict(x, w_t=w_t, d_t=d_t):
            # M_{W_e,t}(x) = W_S x, or (D_t W_S) x = D_t (W_S x) for the retained state:
            # rows of W scale, so the decay applies to the prediction, not a per-token copy.
            y = x @ w_t
            return d_t * y if rt.retained_gradient else y

        signals = window_gradients(rt, predict, part, start, end)

        lr = gate_values(opt, "lr", gates, sl, like)  # [B, H, n, X]
        mixing = _decay_matrix(decay)  # L^a [B, H, X, n, n]
        if momentum:
            theta = gate_values(opt, "momentum", gates, sl, like)
            theta_mix = _decay_matrix(theta)  # L^theta [B, H, X, n, n]
            carry_theta = torch.cumprod(theta, dim=2)  # prod_{j<=t} theta_j
            mixing_u = mixing @ theta_mix  # u_s -> W_t through both recurrences
        else:
            mixing_u = mixing

        # Reads: o_t = D_t W_S phi(q_t) - sum_s K[t, s] lr_s sum_j (phi(k_{s-j}) . phi(q_t)) G_{s,j}
        q_c = part.phi_q  # [B, H, n, Dphi]
        o = d_t * (q_c @ w_t)
        coeff = mixing_u * lr.movedim(-1, 2).unsqueeze(-2)  # [B, H, X, n(t), n(s)]
        for x, grad_y in signals:
            scores = q_c @ x.transpose(-1, -2)  # [B, H, n(t), n(s)]
            weight = coeff * scores.unsqueeze(2)  # [B, H, X, n, n]
            o = o - _mix(weight, grad_y)
        if momentum:
            s_prev = state["S.W"]
            # sum_{tau<=t} L^a[t, tau] prod_{j<=tau} theta_j: the carried momentum's weight.
            carry = (mixing @ carry_theta.movedim(-1, 2).unsqueeze(-1)).squeeze(-1)  # [B,H,X,n]
            o = o - carry.movedim(2, -1) * (q_c @ s_prev.transpose(-1, -2))
        outputs.append(o)

        # The state at the chunk's end: row t = n - 1 of the same sums, as outer products.
        last = coeff[..., -1, :]  # [B, H, X, n(s)]
        w_new = d_t[:, :, -1].unsqueeze(-1) * w_s
        for x, grad_y in signals:
            w_new = w_new - _outer_sum(last, grad_y, x)
        if momentum:
            w_new = w_new - carry[..., -1].unsqueeze(-1) * s_prev
            theta_last = theta_mix[..., -1, :] * lr.movedim(-1, 2)  # [B, H, X, n(s)]
            s_new = carry_theta[:, :, -1].unsqueeze(-1) * s_prev
            for x, grad_y in signals:
                s_new = s_new + _outer_sum(theta_last, grad_y, x)
            state["S.W"] = s_new
        state["W"] = w_new
    return torch.cat(outputs, dim=2), state


def _mix(weight: torch.Tensor, signal: torch.Tensor) -> torch.Tensor:
    """sum_s weight[b, h, x, t, s] signal[b, h, s, v] -> [b, h, t, v] (x broadcasts to v)."""
    if weight.shape[2] == 1:
        return weight[:, :, 0] @ signal
    return torch.einsum("bhvts,bhsv->bhtv", weight, signal)


def _outer_sum(coeff: torch.Tensor, signal: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """sum_s coeff[b, h, x, s] signal[b, h, s, v] phi[b, h, s, d] -> [b, h, v, d]."""
    if coeff.shape[2] == 1:
        return (signal * coeff[:, :, 0].unsqueeze(-1)).transpose(-1, -2) @ x
    return torch.einsum("bhvs,bhsv,bhsd->bhvd", coeff, signal, x)
