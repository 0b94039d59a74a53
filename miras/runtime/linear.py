"""The linear fast path of the chunk-start form: the chunk collapses into matmuls with decay
masks, no per-token state.

It applies where every piece of the step is linear, as the compiler's chunk_form pass records
(`miras.derive.affine.start_path`, `ChunkForm.start_path`):
- the memory is linear in its weights (M_W(x) = W x: the matrix memory);
- the whole step is linear in the state and the gradient, as the compiler proved and
  recorded it (`LinearStep`, here `rt.linear_step`): W_t = a_t W_{t-1} - u_t with
  u_t = p_t S_t + q_t g_t and S_t = theta_t S_{t-1} + beta_t g_t (gd, momentum, Nesterov),
  unrolled once for every form by `miras.runtime.unroll`.
Any bias: its gradients are taken at the chunk-start state, as in `miras.runtime.chunk`.
"""

from __future__ import annotations

import torch

from miras.runtime.chunk_common import chunk_views, window_gradients
from miras.runtime.core import Runtime, State, Tokens, gate_values
from miras.runtime.unroll import rows, unroll


def forward(rt: Runtime, seq: Tokens, state: State, chunk_size: int):
    """Returns o [B, H, T, Dv] and the final state; the chunk's tokens as matmuls.

    With g_s the gradients, the record's recurrences unroll inside a chunk to
        W_t = D_t W_S - C_t S_S - sum_{s<=t} M[t, s] g_s,   D_t = prod_{j<=t} a_j,
        S_t = Theta_t S_S + sum_{s<=t} N[t, s] g_s
    (`miras.runtime.unroll`); M is lower triangular, so the read o_t = W_t phi(q_t) is a
    masked matmul over the chunk's error signals G (each g_s = sum_j G_{s,j} phi(k_{s-j})^T).
    Exact at b = 1."""
    step, spec = rt.linear_step, rt.spec
    state = dict(state)
    outputs = []
    for part in chunk_views(seq, chunk_size):
        gates = part.step_gates
        start, end = 0, part.length
        sl = slice(start, end)
        like = part.phi_q
        w_s = state["W"]  # [B, H, Dv, Dphi]

        def lookup(field, name, gates=gates, sl=sl, like=like):
            return gate_values(getattr(spec, field), name, gates, sl, like)  # [B, H, n, X]

        # D_t, C_t, Theta_t [B, H, n, X]; M, N [B, H, X, n(t), n(s)]
        unrolled = unroll(step, lookup, like)
        d_t = unrolled.d
        w_t = w_s.transpose(-1, -2)  # [B, H, Dphi, Dv]

        def predict(x, w_t=w_t, d_t=d_t):
            # M_{W_e,t}(x) = W_S x, or (D_t W_S) x = D_t (W_S x) for the retained state:
            # rows of W scale, so the decay applies to the prediction, not a per-token copy.
            y = x @ w_t
            return d_t * y if rt.retained_gradient else y

        signals = window_gradients(rt, predict, part, start, end)

        # Reads: o_t = D_t W_S phi(q_t) - C_t S_S phi(q_t) - sum_s M[t, s] sum_j (phi(k_{s-j})
        # . phi(q_t)) G_{s,j}
        q_c = part.phi_q  # [B, H, n, Dphi]
        o = d_t * (q_c @ w_t)
        coeff = unrolled.mix  # [B, H, X, n(t), n(s)]
        for x, grad_y in signals:
            scores = q_c @ x.transpose(-1, -2)  # [B, H, n(t), n(s)]
            weight = coeff * scores.unsqueeze(2)  # [B, H, X, n, n]
            o = o - _mix(weight, grad_y)
        if step.stateful:
            s_prev = state["S.W"]
            carry = unrolled.carry  # [B, H, n, X]
            o = o - carry * (q_c @ s_prev.transpose(-1, -2))
        outputs.append(o)

        # The state at the chunk's end: row t = n - 1 of the same sums, as outer products.
        last = coeff[..., -1, :]  # [B, H, X, n(s)]
        w_new = d_t[:, :, -1].unsqueeze(-1) * w_s
        for x, grad_y in signals:
            w_new = w_new - _outer_sum(last, grad_y, x)
        if step.stateful:
            w_new = w_new - rows(carry)[..., -1].unsqueeze(-1) * s_prev
            state_last = unrolled.state_mix[..., -1, :]  # [B, H, X, n(s)]
            s_new = unrolled.state_carry[:, :, -1].unsqueeze(-1) * s_prev
            for x, grad_y in signals:
                s_new = s_new + _outer_sum(state_last, grad_y, x)
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
