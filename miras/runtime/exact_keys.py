"""The exact chunk form with a decay per key channel (KDA, GDN-2: `retention.decay_channels:
key`) or a step size per key channel (optimizer preconditioned), in plain torch: each chunk
solved exactly, equal to the recurrence at any chunk size.

The step, on a matrix memory W [Dv, Dk] with a_t [Dk] scaling its columns and the gradient of
an affine bias dL/dy = A_t y + C_t taken at W_e,t = W_{t-1} diag(a_t) (grad_at: retained) or
W_{t-1} (state), a gd step of size lr_t:

    r_t = lr_t (A_t * (W_e,t k_t) + C_t),        W_t = W_{t-1} diag(a_t) - r_t k_t^T

In a chunk from W_0, with G_t = sum_{s<=t} log a_s (per key channel, from the chunk's start),
the rescaled state V_t = W_t diag(exp(-G_t)) takes a step with no decay, reading at
exp(G_t) k_t and writing at exp(-G_t) k_t (the delta rule's WY form with the decays inside the
keys' products, as in Kimi Linear's KDA, Kimi Team 2025, arXiv:2510.26692):

    W_e,t k_t = W_0 (exp(R_t) k_t) - sum_{s<t} r_s (k_s . (exp(R_t - G_s) k_t)),
    R_t = G_t (retained) or G_{t-1} (state)

so the signals of a chunk solve one unit-lower-triangular system, per value channel where the
slope or the step size has one (X = Dv):

    (I + diag(lr A) K) r = lr A P_0 + lr C,    K[t, s] = sum_d k_t,d k_s,d exp(R_t,d - G_s,d)

(s < t; K is 0 elsewhere) with P_0 = W_0 exp(R_t) k_t, and

    o_t = W_0 (exp(G_t) q_t) - sum_{s<=t} r_s (k_s . exp(G_t - G_s) q_t)
    W_n = W_0 diag(exp(G_end)) - sum_s r_s (exp(G_end - G_s) k_s)^T

A step size per key channel (the preconditioned optimizer's lr_t M_t, [Dk]) scales the update's
columns, W_t = W_{t-1} diag(a_t) - r_t (lr_t * k_t)^T with r_t = A_t * (W_e,t k_t) + C_t: the
same form with the written key w_s = lr_s * k_s in place of k_s wherever a token s writes (K,
the reads' weights and W_n), while each token t still reads at k_t (fla's asymmetric k_read /
k_precond in its precond_gated_delta_rule).

Every exponent is a sum of log-decays over tokens after s, so <= 0: nothing overflows, at the
cost of [n, n, Dk] factors per chunk (this is the reference-grade form; the faster exact form
and the Triton kernels scale the state by rows and do not take it). Autograd differentiates
it. Padded tokens of the last chunk carry a decay of 1 and no signal.
"""

from __future__ import annotations

import torch

from miras.ir import ChunkForm
from miras.runtime.core import Runtime, State, Tokens
from miras.runtime.exact_chunk import bias_signals, step_gate

# The optimizers whose step this form takes: gd's u_t = lr_t g_t, and the preconditioned one's,
# which is gd's with lr_t M_t per key channel once `miras.runtime.precondition` has run.
OPTIMIZERS = ("gd", "preconditioned")


def refusal(rt: Runtime) -> str | None:
    """Why this form cannot run the spec (None: it can): gd (or its preconditioned step), one
    window token, no implicit step."""
    spec = rt.spec
    if spec.optimizer.kind not in OPTIMIZERS:
        return f"optimizer {spec.optimizer.kind!r} (it takes gd or preconditioned)"
    if spec.window.c != 1:
        return f"window c = {spec.window.c} (it takes c = 1)"
    return None


def decays_per_key(rt: Runtime, seq: Tokens) -> bool:
    """Whether the call's retention decay comes per key channel ([B, H, T, Dk], Dk > 1)."""
    names = rt.spec.retention.key_channel_gates
    return any(seq.step_gates[n].shape[-1] > 1 for n in names if n in seq.step_gates)


def steps_per_key(rt: Runtime, seq: Tokens) -> bool:
    """Whether the call's step size comes per key channel ([B, H, T, Dk], Dk > 1): the
    preconditioned optimizer's lr_t M_t, or an lr the optimizer declares per key channel."""
    name = rt.spec.optimizer.step_size_gate
    if name not in rt.spec.optimizer.key_channel_gates or name not in seq.step_gates:
        return False
    return seq.step_gates[name].shape[-1] > 1


def applies(rt: Runtime, seq: Tokens) -> bool:
    """Whether the exact form runs here rather than `exact_chunk`: a decay or a step size per
    key channel, which scales W's columns where exact_chunk scales rows."""
    return decays_per_key(rt, seq) or steps_per_key(rt, seq)


def forward(rt: Runtime, seq: Tokens, state: State, chunk_size: int, form: ChunkForm):
    """o [B, H, T, Dv] and the final state {"W": [B, H, Dv, Dk]}, like `exact_chunk.forward`."""
    if form.form != "exact":
        raise ValueError(f"spec '{rt.spec.name}' has no exact chunk form: {form.reason}")
    why = refusal(rt)
    if why is not None:
        raise ValueError(f"the exact form with a decay per key channel does not take {why}")
    spec = rt.spec
    length = seq.length
    n = min(chunk_size, length)
    chunks = -(-length // n)
    pad = chunks * n - length

    def chunked(
        z: torch.Tensor, fill: float = 0.0
    ) -> torch.Tensor:  # [B, H, T, D] -> [B, H, N, n, D]
        z = torch.nn.functional.pad(z, (0, 0, 0, pad), value=fill)
        return z.unflatten(2, (chunks, n))

    like = seq.phi_q
    decay = step_gate(spec.retention, spec.retention.decay_gate, seq.step_gates, like)
    lr = step_gate(spec.optimizer, spec.optimizer.step_size_gate, seq.step_gates, like)
    slope, offset = bias_signals(rt, form, seq)  # [B, H, T, X], [B, H, T, Dv]
    real = chunked(torch.ones_like(like[..., :1]))  # 1 on real tokens, 0 on the padding
    # A step size per key channel (the preconditioned lr_t M_t) scales the update's columns:
    # W_t = W'_t - r_t (lr_t * k_t)^T, so it goes into the written key, not the signal.
    per_key_lr = steps_per_key(rt, seq)
    row_lr = torch.ones_like(lr[..., :1]) if per_key_lr else lr
    alpha = chunked(row_lr * slope) * real  # [B, H, N, n, X]
    beta = chunked(row_lr * offset) * real  # [B, H, N, n, Dv]
    d_k = seq.phi_k.shape[-1]
    g = chunked(decay.log(), 0.0).cumsum(3).expand(*alpha.shape[:-1], d_k)  # G_t [B, H, N, n, K]
    read = g if rt.retained_gradient else torch.nn.functional.pad(g, (0, 0, 1, -1))  # R_t
    q, k = chunked(seq.phi_q), chunked(seq.phi_k)  # k: the key each token is read at
    written = chunked(seq.phi_k * lr) if per_key_lr else k  # the key each token writes at

    lower = torch.ones(n, n, dtype=torch.bool, device=like.device).tril(-1)  # s < t
    upto = torch.ones(n, n, dtype=torch.bool, device=like.device).tril()  # s <= t

    def weights(x: torch.Tensor, rows: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """sum_d x_t,d w_s,d exp(rows_t,d - G_s,d) over the masked (t, s), w the written keys:
        [B, H, N, n, n]. The exponent is set to 0 off the mask before exp, so no inf enters
        (nor its gradient)."""
        expo = rows.unsqueeze(-2) - g.unsqueeze(-3)  # [B, H, N, t, s, K]
        expo = torch.where(mask[..., None], expo, 0.0)
        pair = torch.einsum("...td,...sd,...tsd->...ts", x, written, expo.exp())
        return pair * mask

    gram = weights(k, read, lower)  # K [B, H, N, n, n]
    reads = weights(q, g, upto)  # the reads' weights [B, H, N, n, n]
    per_channel = alpha.shape[-1] > 1
    # I + diag(alpha) K, one system per value channel where alpha has one: [B, H, N, X, n, n]
    system = torch.eye(n, dtype=like.dtype, device=like.device) + (
        alpha.transpose(-1, -2).unsqueeze(-1) * gram.unsqueeze(3)
    )
    key_read = k * read.exp()  # exp(R_t) k_t
    query_read = q * g.exp()  # exp(G_t) q_t
    g_end = g[:, :, :, -1:]  # [B, H, N, 1, K]: the padding adds nothing to G
    key_end = written * (g_end - g).exp()  # exp(G_end - G_s) w_s

    w = state["W"]  # [B, H, Dv, Dk]
    outputs = []
    for i in range(chunks):
        rhs = alpha[:, :, i] * (key_read[:, :, i] @ w.mT) + beta[:, :, i]  # [B, H, n, Dv]
        if per_channel:  # column v solves system v: [B, H, Dv, n, 1]
            r = torch.linalg.solve_triangular(
                system[:, :, i], rhs.mT.unsqueeze(-1), upper=False, unitriangular=True
            )
            r = r.squeeze(-1).mT
        else:
            r = torch.linalg.solve_triangular(
                system[:, :, i, 0], rhs, upper=False, unitriangular=True
            )
        outputs.append(query_read[:, :, i] @ w.mT - reads[:, :, i] @ r)
        w = w * g_end[:, :, i].exp() - r.mT @ key_end[:, :, i]
    o = torch.cat(outputs, dim=2)[:, :, :length]
    final = dict(state)
    final["W"] = w
    return o, final
