"""The exact chunk form: for rules the affine analysis accepts (`miras.derive.affine`), each
chunk is solved exactly, so the output equals the recurrence at any chunk size.

The WY / UT form of the delta rule (Yang et al. 2024, "Parallelizing Linear Transformers with
the Delta Rule over Sequence Length"), generalized to decay products, the retained gradient
point, momentum and the Omega window (docs/chunking.md, "The exact form"). In a chunk of n
tokens from state (W_0, S_0), with x_{t,j} = phi(k_{t-j}) (j < c) and the error signals

    r_{t,j} = A_{t-j} * (W_e,t x_{t,j}) + C_{t-j},   A = gamma * d2L/dy2,  C = gamma * dL/dy|_{y=0}
    W_e,t   = rho_t W_{t-1}                           (rho = 1, or a_t for grad_at: retained)
    W_{t}   = D_t W_0 - carry_t S_0 - sum_{s<=t} M[t, s] sum_j r_{s,j} x_{s,j}^T

(the compiled `LinearStep` unrolled, `miras.runtime.unroll`: D_t = prod a, M[t, s] the weight
of g_s in W_t, L^a diag(lr) for gd and L^a L^theta diag(lr) for momentum, carry_t the weight
of S_0), the n*c signals solve one unit-lower-triangular system

    (I + diag(A) K) R = A * P_0 + C,   K[(t,j'), (s,j)] = rho_t M[t-1, s] (x_{s,j} . x_{t,j'}), s < t,

with P_0 the predictions at W_0 and S_0. Everything but W_0 and S_0 is known before the scan,
so the triangular solves run for all chunks at once, giving R = R_C + E_W W_0^T - E_S S_0^T;
the scan over chunks is two matmuls per chunk, and the reads are batched after it.
A per-channel gate or slope scales rows of W, so the system then has one copy per channel
(X = Dv instead of 1).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from miras.ir import ChunkForm
from miras.runtime.chunk_common import chunk_views
from miras.runtime.core import Runtime, State, Tokens
from miras.runtime.unroll import mul_fresh, unroll


def forward(rt: Runtime, seq: Tokens, state: State, chunk_size: int, form: ChunkForm):
    """Returns o [B, H, T, Dv] and the final memory state, like `chunk.forward`. `form`: the
    compiled rule's `plan.chunk_form`; it must be "exact". Three steps: `prepare` (everything
    that does not read the state, for all chunks at once), `scan_chunks` (the one sequential
    pass), `read` (the outputs, for all chunks at once).

    On the CPU a long sequence runs as segments of whole chunks (`segment_chunks`), one after
    the other, each from the state the previous one ended in: the same chunks and the same
    per-chunk products, so the same numbers, but every [B, H, N, nc, .] intermediate is a
    segment's, a few MiB that stay in cache and that the allocator hands back for the next
    segment, where whole-sequence ones are fetched from memory and page-faulted in again on
    every call (docs/benchmarks.md, "The exact form in segments")."""
    n = min(chunk_size, seq.length)
    if form.form != "exact":  # refused by `prepare`, with the reason
        return _forward(rt, seq, state, chunk_size, form)
    tokens = segment_chunks(seq, n, rt.spec.window.c) * n
    if seq.length <= tokens:
        return _forward(rt, seq, state, chunk_size, form)
    outputs = []
    for part in chunk_views(seq, tokens):
        o, state = _forward(rt, part, state, chunk_size, form)
        outputs.append(o)
    return torch.cat(outputs, dim=2), state


# A segment's [B, H, N, X, nc, nc] matrices hold about this many numbers (1 MiB of fp32), and
# at least this many chunks. Measured on the development VM (B 2, H 4, d 64, chunk 64, one
# thread, CPU time, interleaved medians; docs/benchmarks.md): 8 chunks per segment ran the
# T = 8192 forward in 148 ms, 16 chunks in 159, the whole sequence in 202; 2 chunks were
# slower again (the ops' fixed costs), and 8 beat 16 in forward+backward too.
SEGMENT_NUMBERS, MIN_SEGMENT_CHUNKS = 1 << 18, 4


def segment_chunks(seq: Tokens, n: int, c: int) -> int:
    """Chunks of n tokens per segment of `forward`: SEGMENT_NUMBERS over one chunk's
    matrices [B, H, X, nc, nc] (X = Dv for per-channel gates), at least MIN_SEGMENT_CHUNKS.
    The whole sequence off the CPU, where batches are wide and memory is not faulted in, and
    for an empty batch (B = 0), whose chunks hold no numbers."""
    b, h = seq.phi_q.shape[:2]
    gates = [*seq.step_gates.values(), *seq.window_gates.values()]
    x = max((g.shape[-1] for g in gates), default=1)
    per_chunk = b * h * x * (n * c) ** 2
    if seq.phi_q.device.type != "cpu" or per_chunk == 0:
        return -(-seq.length // n)
    return max(MIN_SEGMENT_CHUNKS, SEGMENT_NUMBERS // per_chunk)


def _forward(rt: Runtime, seq: Tokens, state: State, chunk_size: int, form: ChunkForm):
    """`forward` over one segment: prepare, scan, read."""
    prep = prepare(rt, seq, chunk_size, form)
    r, starts_w, starts_s, w, s = scan_chunks(*prep.scan_args(state["W"], state.get("S.W")))
    o = read(prep, r, starts_w, starts_s)
    final = dict(state)
    final["W"] = w
    if s is not None:
        final["S.W"] = s
    return o, final


@dataclass
class Prepared:
    """The state-independent parts of the exact form, for all N chunks of n tokens (nc = n*c
    window rows per chunk; X = 1 per head, Dv per channel; Dphi the feature width).

    Read by `read`: `length` (T, real tokens), `c`, `queries` [B, H, N, n, Dphi], `keys`
    [B, H, N, nc, Dphi], `d` (D_t) [B, H, N, n, X], `carry` [B, H, N, n, X] or None,
    `mix_lr` (M[t, s] lr_s) [B, H, N, X, n, n]. The rest are `scan_chunks`' inputs, named there.
    """

    length: int
    c: int
    queries: torch.Tensor
    keys: torch.Tensor
    d: torch.Tensor
    carry: torch.Tensor | None
    mix_lr: torch.Tensor
    base: torch.Tensor
    from_w: torch.Tensor | None
    from_s: torch.Tensor | None
    last_w: torch.Tensor
    last_s: torch.Tensor | None
    d_end: torch.Tensor
    carry_end: torch.Tensor | None
    theta_end: torch.Tensor | None

    def scan_args(self, w0: torch.Tensor, s0: torch.Tensor | None) -> tuple:
        """The arguments of `scan_chunks`, in order, from the initial W_0 (and S_0)."""
        return (
            self.base, self.keys, self.from_w, self.from_s, self.last_w, self.last_s,
            self.d_end, self.carry_end, self.theta_end, w0, s0,
        )  # fmt: skip


def prepare(rt: Runtime, seq: Tokens, chunk_size: int, form: ChunkForm) -> Prepared:
    """Everything of the exact form that does not read the memory state, batched over chunks:
    the gates' products, the triangular solves, and the terms of the scan (`Prepared`)."""
    if form.form != "exact":
        raise ValueError(f"spec '{rt.spec.name}' has no exact chunk form: {form.reason}")
    spec = rt.spec
    length, past, c = seq.length, seq.past, spec.window.c
    n = min(chunk_size, length)
    chunks = -(-length // n)
    pad = chunks * n - length

    # Step gates [B, H, T, X] -> [B, H, N, n, X]; padded tokens carry factor 1 (finite; they
    # come after every token they could touch). Contiguous (they arrive as [B, T, H]
    # transposed, T*X numbers per head): every factor and [n, n] matrix built from them takes
    # their layout, and a matmul then copies each such operand into the [B, H, N] order again.
    def steps(component, name: str) -> torch.Tensor:
        g = step_gate(component, name, seq.step_gates, seq.phi_q)
        return _pad_tokens(g, pad, 1.0).unflatten(2, (chunks, n)).contiguous()

    step = rt.linear_step  # the compiled LinearStep: its coefficients read these gates
    like = _pad_tokens(seq.phi_q[..., :1], pad).unflatten(2, (chunks, n))  # [B, H, N, n, 1]
    unrolled = unroll(step, lambda field, name: steps(getattr(spec, field), name), like)

    # Window terms [B, H, P+T, .] -> [B, H, N, n*c, .], row t*c + j is token t's offset j.
    # Keys and queries contiguous once (they arrive as [B, T, H, D] transposed): every batched
    # matmul below would copy a strided operand again.
    slope, offset = bias_signals(rt, form, seq)
    keys = _window_rows(seq.phi_k, past, c, chunks, n, pad).contiguous()
    slope, offset = (_window_rows(z, past, c, chunks, n, pad) for z in (slope, offset))
    queries = _pad_tokens(seq.phi_q, pad).unflatten(2, (chunks, n)).contiguous()

    # D_t, C_t [B, H, N, n, X]; M[t, s], the weight of g_s in W_t, [B, H, N, X, n, n].
    a, d, carry, mix_lr = unrolled.a, unrolled.d, unrolled.carry, unrolled.mix
    rho = a if rt.retained_gradient else torch.ones_like(like)
    coef_w = rho * _shift(d, 1.0)  # rho_t D_{t-1}: [B, H, N, n, X]
    coef_s = rho * _shift(carry, 0.0) if carry is not None else None

    solve = form.slope != 0.0  # a zero slope (dot): the signals do not depend on the state
    per_head = mix_lr.shape[3] == 1 and slope.shape[-1] == 1
    # R = base + E_W W_0^T - E_S S_0^T, with base = T^-1 C and E = T^-1 diag(A coef) X, where
    # T = I + A K over (t, j') x (s, j): K = rho_t M[t-1, s] lr_s times the keys' Gram matrix.
    if solve and per_head:
        # Row factors (the slope A of row (t, j'), and rho_t) scale the left keys of the Gram
        # matrix, [nc, Dphi] instead of [nc, nc]; the token matrix multiplies it in place.
        # A constant slope (l2: 1, no gamma gate, no carried window) is a number, not a pass.
        const = _constant_slope(rt, form, seq)
        slope = slope if const is None else const
        # Without a state M = L^a diag(q), and a_t L^a[t-1, s] = L^a[t, s], s < t.
        if not step.stateful and rt.retained_gradient:
            # The diagonal is never read; with a window, a token's own c x c block must be 0.
            k_tok, row = mix_lr, slope
            if c > 1:
                k_tok = mix_lr * _lower(n, True, str(mix_lr.device))
        else:
            k_tok, row = _shift_rows(mix_lr), slope * _expand_tokens(rho, c)
        left = keys if isinstance(row, float) and row == 1.0 else keys * row
        system = mul_fresh(left @ keys.mT, _expand_rows(_expand_cols(k_tok, c), c)[:, :, :, 0])
        scale_w = slope * _expand_tokens(coef_w, c)  # [B, H, N, nc, 1]
        rhs = [offset, scale_w * keys]
        if coef_s is not None:
            rhs.append((slope * _expand_tokens(coef_s, c)) * keys)
        base, from_w, *rest = _unit_lower_solve(system, *rhs)
        from_s = rest[0] if rest else None
    elif solve:  # one system per value channel: the inverse, then its column-scaled copies
        if not step.stateful and rt.retained_gradient:
            k_tok = mix_lr * _lower(n, True, str(mix_lr.device))
        else:
            k_tok = _rows(rho).unsqueeze(-1) * _shift_rows(mix_lr)  # [B, H, N, X, n, n]
        gram_kk = (keys @ keys.transpose(-1, -2)).unsqueeze(3)  # [B, H, N, 1, nc, nc]
        system = _expand_rows(_expand_cols(k_tok, c), c) * gram_kk * _rows(slope).unsqueeze(-1)
        scale_w = slope * _expand_tokens(coef_w, c)  # [B, H, N, nc, X]
        scale_s = slope * _expand_tokens(coef_s, c) if coef_s is not None else None
        inverse = _unit_lower_inverse_of(system)  # [B, H, N, Dv, nc, nc]
        base = _mix(inverse, offset)
        from_w = inverse * _rows(scale_w).unsqueeze(-2)
        from_s = inverse * _rows(scale_s).unsqueeze(-2) if scale_s is not None else None
    else:  # contiguous: it is the scan's signals as they are, and `read` multiplies them
        base, from_w, from_s = offset.contiguous(), None, None

    # Row e of the chunk's end: n - 1, or the last real token in the last chunk.
    ends = [n - 1] * (chunks - 1) + [length - 1 - (chunks - 1) * n]
    end = torch.tensor(ends, device=d.device)
    last_w = _expand_cols(_at_row(mix_lr, end), c)  # [B, H, N, X, nc]
    d_end = _at_token(d, end)  # [B, H, N, X]
    last_s = carry_end = theta_end = None
    if step.stateful:  # S's end row N[end, s] = L^theta[end, s] beta_s, and Theta_end
        last_s = _expand_cols(_at_row(unrolled.state_mix, end), c).mT
        carry_end, theta_end = _at_token(carry, end), _at_token(unrolled.state_carry, end)
    return Prepared(
        length, c, queries, keys, d, carry, mix_lr,
        base, from_w, from_s, last_w.mT, last_s, d_end, carry_end, theta_end,
    )  # fmt: skip


def scan_chunks(
    base: torch.Tensor,
    keys: torch.Tensor,
    from_w: torch.Tensor | None,
    from_s: torch.Tensor | None,
    last_w: torch.Tensor,
    last_s: torch.Tensor | None,
    d_end: torch.Tensor,
    carry_end: torch.Tensor | None,
    theta_end: torch.Tensor | None,
    w0: torch.Tensor,
    s0: torch.Tensor | None,
):
    """The one sequential pass of the exact form: chunk i = 0 .. N-1 from (W_0, S_0),

        r_i     = base_i + F_i W_i^T - G_i S_i^T                  (per head)
        r_i     = base_i + mix(F_i, K_i W_i^T) - mix(G_i, K_i S_i^T)   (per channel)
        W_{i+1} = d_i * W_i - (r_i * lw_i)^T K_i - ce_i * S_i
        S_{i+1} = te_i * S_i + (r_i * ls_i)^T K_i

    with mix(F, P)[t, v] = sum_s F[v, t, s] P[s, v], and d_i, ce_i, te_i scaling the rows of
    W and S (X = 1 or Dv). Shapes (nc = n*c rows per chunk, every tensor batched over B, H):

        base [B, H, N, nc, Dv]          (base_i)
        keys [B, H, N, nc, Dphi]        (K_i)
        from_w, from_s                  (F_i, G_i) per head [B, H, N, nc, Dphi],
                                        per channel [B, H, N, Dv, nc, nc]; from_w None (the dot
                                        bias: r does not read the state), from_s None without
                                        momentum
        last_w, last_s [B, H, N, nc, X] (lw_i, ls_i)
        d_end, carry_end, theta_end [B, H, N, X]   (d_i, ce_i, te_i)
        w0, s0 [B, H, Dv, Dphi]         (s0 None without momentum; then last_s, carry_end,
                                        theta_end are None too)

    Returns (r [B, H, N, nc, Dv], starts_w [B, H, N, Dv, Dphi] (W_0 .. W_{N-1}), starts_s
    (the same for S, or None), W_N, S_N (or None)). Differentiable in every tensor input by a
    hand-written reverse scan over chunks (`_ScanChunks`); first-order only.
    """
    if from_w is None and from_s is not None:
        raise ValueError("scan_chunks: from_s without from_w")
    momentum = (s0, last_s, carry_end, theta_end)
    if any(z is None for z in momentum) and any(z is not None for z in momentum):
        raise ValueError("scan_chunks: s0, last_s, carry_end, theta_end: give all or none")
    return _ScanChunks.apply(
        base, keys, from_w, from_s, last_w, last_s, d_end, carry_end, theta_end, w0, s0
    )


class _ScanChunks(torch.autograd.Function):
    """`scan_chunks` with a reverse scan for the backward: only the state gradients are
    sequential; every other gradient is one batched product over all chunks after it."""

    @staticmethod
    def forward(ctx, base, keys, from_w, from_s, last_w, last_s, d_end, carry_end, theta_end, w0, s0):  # fmt: skip
        r, starts_w, starts_s, w, s = _scan(
            base, keys, from_w, from_s, last_w, last_s, d_end, carry_end, theta_end, w0, s0
        )
        ctx.save_for_backward(
            keys, from_w, from_s, last_w, last_s, d_end, carry_end, theta_end, r, starts_w, starts_s
        )  # fmt: skip
        return r, starts_w, starts_s, w, s

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_r, g_starts_w, g_starts_s, g_w, g_s):
        keys, from_w, from_s, last_w, last_s, d_end, carry_end, theta_end, r, starts_w, starts_s = (
            ctx.saved_tensors
        )
        momentum = starts_s is not None
        per_channel = from_w is not None and from_w.dim() == 6
        chunks = r.shape[2]
        # The reverse scan: next_w[:, :, i], next_s[:, :, i] hold dL/dW_{i+1}, dL/dS_{i+1}
        # entering chunk i; each chunk writes the next one's (and its own signal gradient and
        # K_i g_W^T) in place, as the forward does (`_scan`): no per-chunk tensors, no stacks.
        next_w = chunk_major(starts_w, starts_w.shape)
        k_gw = chunk_major(r, r.shape)  # [B, H, N, nc, Dv]
        g_sig = chunk_major(r, r.shape)
        next_w[:, :, -1] = 0.0 if g_w is None else g_w
        if momentum:
            next_s, k_gs = chunk_major(next_w, next_w.shape), chunk_major(k_gw, k_gw.shape)
            next_s[:, :, -1] = 0.0 if g_s is None else g_s
        g_pw, g_ps = [None] * chunks, [None] * chunks
        for i in reversed(range(chunks)):
            k, g_w = keys[:, :, i], next_w[:, :, i]
            g_prev_w = next_w[:, :, i - 1] if i else torch.empty_like(g_w)
            gr = g_sig[:, :, i]
            _mm_into(k, g_w.mT, k_gw[:, :, i])  # [B, H, nc, Dv]
            torch.addcmul(g_r[:, :, i], k_gw[:, :, i], last_w[:, :, i], value=-1, out=gr)
            torch.addcmul(g_starts_w[:, :, i], d_end[:, :, i, :, None], g_w, out=g_prev_w)
            if momentum:
                g_s = next_s[:, :, i]
                g_prev_s = next_s[:, :, i - 1] if i else torch.empty_like(g_s)
                _mm_into(k, g_s.mT, k_gs[:, :, i])
                gr.addcmul_(k_gs[:, :, i], last_s[:, :, i])
                torch.mul(theta_end[:, :, i, :, None], g_s, out=g_prev_s)
                g_prev_s.addcmul_(carry_end[:, :, i, :, None], g_w, value=-1)
                if g_starts_s is not None:
                    g_prev_s.add_(g_starts_s[:, :, i])
            if per_channel:  # dL/d(K_i W_i^T) = mix^T(F_i, gr): [B, H, nc, Dv]
                g_pw[i] = _mix_t(from_w[:, :, i], gr)
                g_prev_w.add_(g_pw[i].mT @ k)
                if momentum:
                    g_ps[i] = _mix_t(from_s[:, :, i], gr)
                    g_prev_s.sub_(g_ps[i].mT @ k)
            elif from_w is not None:
                _plus_mm(g_prev_w, gr.mT, from_w[:, :, i], out=g_prev_w)
                if momentum:
                    _plus_mm(g_prev_s, gr.mT, from_s[:, :, i], alpha=-1, out=g_prev_s)
        g_w = g_prev_w  # dL/dW_0 (and dL/dS_0)
        if momentum:
            g_s = g_prev_s

        # Everything else, for all chunks at once.
        u_w = r * last_w
        g_keys = -_chunk_matmul(u_w, next_w)  # [B, H, N, nc, Dphi]
        g_last_w = (-k_gw * r).sum_to_size(last_w.shape)
        g_d = (next_w * starts_w).sum(-1).sum_to_size(d_end.shape)
        g_last_s = g_carry = g_theta = g_from_s = None
        if momentum:
            g_keys = g_keys + _chunk_matmul(r * last_s, next_s)
            g_last_s = (k_gs * r).sum_to_size(last_s.shape)
            g_carry = -(next_w * starts_s).sum(-1).sum_to_size(carry_end.shape)
            g_theta = (next_s * starts_s).sum(-1).sum_to_size(theta_end.shape)
        g_from_w = None
        if per_channel:  # dF[v, t, s] = gr[t, v] (K W^T)[s, v]
            g_pw = torch.stack(g_pw, dim=2)
            g_keys = g_keys + g_pw @ starts_w
            g_from_w = g_sig.mT.unsqueeze(-1) * (keys @ starts_w.mT).mT.unsqueeze(-2)
            g_from_w = g_from_w.sum_to_size(from_w.shape)
            if momentum:
                g_ps = torch.stack(g_ps, dim=2)
                g_keys = g_keys - g_ps @ starts_s
                g_from_s = -g_sig.mT.unsqueeze(-1) * (keys @ starts_s.mT).mT.unsqueeze(-2)
                g_from_s = g_from_s.sum_to_size(from_s.shape)
        elif from_w is not None:
            g_from_w = _chunk_matmul(g_sig, starts_w)
            g_from_s = -_chunk_matmul(g_sig, starts_s) if momentum else None
        return (
            g_sig, g_keys, g_from_w, g_from_s, g_last_w, g_last_s,
            g_d, g_carry, g_theta, g_w, g_s if momentum else None,
        )  # fmt: skip


def _scan(base, keys, from_w, from_s, last_w, last_s, d_end, carry_end, theta_end, w, s):
    """The forward recurrence of `scan_chunks`, a loop over chunks of small products. Per head
    (X = 1) the end weights scale the keys once for all chunks, lw_i * K_i, so each chunk is
    two fused multiply-adds (baddbmm) on [B*H] batches: r_i = base_i + F_i W_i^T and
    W_{i+1} = d_i W_i - r_i^T (lw_i * K_i).

    The results are written into their places in the returned tensors (`out=` and in-place
    updates; `_ScanChunks` records no graph here): the signals of chunk i and W_{i+1} go
    straight into r [B, H, N, nc, Dv] and starts_w [B, H, N, Dv, Dphi], where lists of
    per-chunk tensors cost one allocation per chunk and a stack (a copy of all of them) at the
    end. Both are stored chunk by chunk (`chunk_major`), so each chunk's block is contiguous
    and the products write it directly (the T = 2048 forward 8-17% faster than into
    [B, H, N]-ordered results, docs/benchmarks.md). Without a state-reading term (from_w
    None) r is base itself, not a copy."""
    per_channel = from_w is not None and from_w.dim() == 6
    chunks = base.shape[2]
    per_head = last_w.shape[-1] == 1 and d_end.shape[-1] == 1
    signals = base if from_w is None else chunk_major(base, base.shape)
    starts_w = chunk_major(w, (*w.shape[:2], chunks, *w.shape[2:]))  # [B, H, N, Dv, Dphi]
    starts_s = chunk_major(s, starts_w.shape) if s is not None else None
    starts_w[:, :, 0] = w
    if s is not None:
        starts_s[:, :, 0] = s
    if per_head:  # [B, H, N, nc, Dphi]
        lw_keys = last_w * keys
        ls_keys = last_s * keys if s is not None else None
    for i in range(chunks):
        k, w = keys[:, :, i], starts_w[:, :, i]
        s = starts_s[:, :, i] if s is not None else None
        r = signals[:, :, i]  # [B, H, nc, Dv]
        if per_channel:
            r.copy_(base[:, :, i] + _mix(from_w[:, :, i], k @ w.mT))
            if s is not None:
                r.sub_(_mix(from_s[:, :, i], k @ s.mT))
        elif from_w is not None:
            _plus_mm(base[:, :, i], from_w[:, :, i], w.mT, out=r)
            if s is not None:
                _plus_mm(r, from_s[:, :, i], s.mT, alpha=-1, out=r)
        # W_{i+1} (and S_{i+1}) into the next chunk's start, the last into fresh tensors.
        last = i == chunks - 1
        w_new = torch.empty_like(w) if last else starts_w[:, :, i + 1]
        s_new = (torch.empty_like(s) if last else starts_s[:, :, i + 1]) if s is not None else None
        if per_head:
            torch.mul(w, d_end[:, :, i, :, None], out=w_new)
            _plus_mm(w_new, r.mT, lw_keys[:, :, i], alpha=-1, out=w_new)
            if s is not None:
                w_new.sub_(carry_end[:, :, i, :, None] * s)
                torch.mul(s, theta_end[:, :, i, :, None], out=s_new)
                _plus_mm(s_new, r.mT, ls_keys[:, :, i], out=s_new)
        else:
            torch.sub(d_end[:, :, i, :, None] * w, (r * last_w[:, :, i]).mT @ k, out=w_new)
            if s is not None:
                w_new.sub_(carry_end[:, :, i, :, None] * s)
                torch.add(theta_end[:, :, i, :, None] * s, (r * last_s[:, :, i]).mT @ k, out=s_new)
        w, s = w_new, s_new
    return signals, starts_w, starts_s, w, s


def chunk_major(like: torch.Tensor, shape) -> torch.Tensor:
    """An empty [B, H, N, ...] tensor stored chunk by chunk ([N, B, H, ...] in memory), as a
    [B, H, N, ...] view: chunk i's [B, H, ...] block is contiguous, so the scan's products
    write it with `out=` directly, where a slice of a [B, H, N, ...] tensor is strided over B
    and H and each product went through a temporary and a copy."""
    b, h, n, *rest = shape
    return like.new_empty(n, b, h, *rest).movedim(0, 2)


def _chunk_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b for [B, H, N, ., .] operands. Where both are stored chunk by chunk (`chunk_major`),
    the product runs on that storage ([N, B, H] batches fold into one without a copy) and
    returns a chunk-major view; torch's matmul would copy each into [B, H, N] order first."""
    a_n, b_n = a.movedim(2, 0), b.movedim(2, 0)
    if _folds(a_n) and _folds(b_n):
        return (a_n @ b_n).movedim(0, 2)
    return a @ b


def _folds(x: torch.Tensor) -> bool:
    """Whether the batch axes of x [N, B, H, ., .] merge into one as a view."""
    b, h = x.shape[1:3]
    return x.stride(1) == h * x.stride(2) and x.stride(0) == b * x.stride(1)


def _plus_mm(
    c: torch.Tensor, a: torch.Tensor, b: torch.Tensor, alpha: float = 1.0, out=None
) -> torch.Tensor:
    """c + alpha a @ b for [B, H, ., .] operands, as one baddbmm over B*H matrices; into `out`
    (a [B, H, ., .] view whose B and H axes merge, c itself allowed) where given."""
    if out is None:
        out = torch.baddbmm(c.flatten(0, 1), a.flatten(0, 1), b.flatten(0, 1), alpha=alpha)
        return out.unflatten(0, c.shape[:2])
    flat = out.view(-1, *out.shape[2:])  # a view, never a copy: the result lands in `out`
    if c is out:
        flat.baddbmm_(a.flatten(0, 1), b.flatten(0, 1), alpha=alpha)
    else:
        torch.baddbmm(c.flatten(0, 1), a.flatten(0, 1), b.flatten(0, 1), alpha=alpha, out=flat)
    return out


def _mm_into(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """a @ b for [B, H, ., .] operands into `out`, a [B, H, ., .] view whose B and H merge."""
    torch.bmm(a.flatten(0, 1), b.flatten(0, 1), out=out.view(-1, *out.shape[2:]))
    return out


def read(prep: Prepared, r: torch.Tensor, starts_w: torch.Tensor, starts_s: torch.Tensor | None):
    """The outputs for all chunks at once, o [B, H, T, Dv], from the signals r [B, H, N, nc, Dv]
    and the chunk-start states [B, H, N, Dv, Dphi]:
        o_t = D_t W_0 q_t - carry_t S_0 q_t - sum_{s<=t} M[t, s] lr_s sum_j (x_{s,j} . q_t) r_{s,j}.
    Per head (X = 1) the row factors D_t and carry_t scale the queries ([n, Dphi]) instead of
    the products, and the subtraction is fused into one baddbmm."""
    queries, keys = prep.queries, prep.keys
    mix = _expand_cols(prep.mix_lr, prep.c)  # [B, H, N, X, n, nc]
    read_mix = mul_fresh(queries @ keys.mT, mix.squeeze(3)) if mix.shape[3] == 1 else None
    if read_mix is not None and prep.d.shape[-1] == 1:
        o = (prep.d * queries) @ starts_w.mT
        if starts_s is not None:
            o = o - (prep.carry * queries) @ starts_s.mT
        # o -= read_mix r in place (o is a product's result: no backward reads it), where a
        # new [B, H, N, n, Dv] tensor would be one more allocation the kernel must fault in
        o.view(-1, *o.shape[3:]).baddbmm_(read_mix.flatten(0, 2), r.flatten(0, 2), alpha=-1)
        return o.flatten(2, 3)[:, :, : prep.length]
    read_mix = mix * (queries @ keys.mT).unsqueeze(3) if read_mix is None else read_mix.unsqueeze(3)
    o = prep.d * (queries @ starts_w.mT) - _mix(read_mix, r)
    if starts_s is not None:
        o = o - prep.carry * (queries @ starts_s.mT)
    return o.flatten(2, 3)[:, :, : prep.length]


def _unit_lower_solve(system: torch.Tensor, *rhs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(I + system)^-1 R for each right-hand side R, `system` [.., m, m] strictly lower
    triangular (its diagonal and upper triangle are never read, so I + system is never formed):
    one inverse (`_unit_lower_inverse`), then one matmul per right-hand side."""
    return _UnitLowerSolve.apply(system, *rhs)


def _unit_lower_inverse_of(system: torch.Tensor) -> torch.Tensor:
    """(I + system)^-1 for a strictly lower-triangular `system` [.., m, m], differentiable."""
    return _UnitLowerInverse.apply(system)


# The diagonal blocks `_unit_lower_inverse` hands to LAPACK; every larger block is matmuls.
# torch's batched solve_triangular loops over the batch in small trsm calls: at 64 rows and 128
# right-hand columns it ran at 13 GFLOP/s on one core, where this inverse plus a matmul per
# right-hand side takes a third of its time (docs/benchmarks.md, "Roofline").
_BLOCK = 16


def _unit_lower_inverse(a: torch.Tensor) -> torch.Tensor:
    """(I + a)^-1 for a strictly lower-triangular a [.., m, m] (diagonal and upper not read),
    by blocks: LAPACK inverts the diagonal 16 x 16 blocks of every matrix in one call, then
    each doubling of the block size fills the lower-left block of every 2 x 2 block matrix,
    T21 = -T22 A21 T11, with two batched matmuls. m is padded with identity rows to 16 * 2^k."""
    m = a.shape[-1]
    if m <= _BLOCK:
        eye = torch.eye(m, dtype=a.dtype, device=a.device).expand_as(a)
        return torch.linalg.solve_triangular(a, eye, upper=False, unitriangular=True)
    size = _BLOCK
    while size < m:
        size *= 2
    if size != m:  # zero rows and columns of a: the inverse is the identity there
        a = F.pad(a, (0, size - m, 0, size - m))
    out = a.new_zeros(a.shape)
    eye = torch.eye(_BLOCK, dtype=a.dtype, device=a.device)
    diag = _diagonal_blocks(a, _BLOCK)
    _diagonal_blocks(out, _BLOCK).copy_(
        torch.linalg.solve_triangular(diag, eye.expand_as(diag), upper=False, unitriangular=True)
    )
    s = _BLOCK
    while s < size:
        t, lower = _diagonal_blocks(out, 2 * s), _diagonal_blocks(a, 2 * s)[..., s:, :s]
        t[..., s:, :s] = (t[..., s:, s:] @ lower).neg_() @ t[..., :s, :s]
        s *= 2
    return out if size == m else out[..., :m, :m]


def _diagonal_blocks(x: torch.Tensor, s: int) -> torch.Tensor:
    """The diagonal s x s blocks of x [.., m, m] as a view [.., m / s, s, s]."""
    g = x.shape[-1] // s
    blocks = x.unflatten(-1, (g, s)).unflatten(-3, (g, s))  # [.., g, s, g, s]
    return blocks.diagonal(dim1=-4, dim2=-2).movedim(-1, -3)


class _UnitLowerSolve(torch.autograd.Function):
    """X_i = (I + A)^-1 R_i. Backward (A strictly lower): dR_i = T^T dX_i and
    dA = -tril_{-1}(sum_i dR_i X_i^T), T = (I + A)^-1: two matmuls per right-hand side, the
    same as solve_triangular's own backward without its second solve."""

    @staticmethod
    def forward(ctx, system, *rhs):
        inverse = _unit_lower_inverse(system)
        xs = tuple(inverse @ r for r in rhs)
        ctx.save_for_backward(inverse, *xs)
        return xs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *g_xs):
        inverse, *xs = ctx.saved_tensors
        g_system, g_rhs = None, []
        for g, x in zip(g_xs, xs, strict=True):
            if g is None:
                g_rhs.append(None)
                continue
            g_r = inverse.mT @ g
            g_rhs.append(g_r)
            term = g_r @ x.mT
            g_system = term if g_system is None else g_system.add_(term)
        if g_system is not None:
            g_system = g_system.tril_(-1).neg_()
        return (g_system, *g_rhs)


class _UnitLowerInverse(torch.autograd.Function):
    """T = (I + A)^-1, A strictly lower; backward dA = -tril_{-1}(T^T dT T^T)."""

    @staticmethod
    def forward(ctx, system):
        inverse = _unit_lower_inverse(system)
        ctx.save_for_backward(inverse)
        return inverse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_inverse):
        (inverse,) = ctx.saved_tensors
        return ((inverse.mT @ g_inverse @ inverse.mT).tril_(-1).neg_(),)


# Helpers. Token-major tensors are [B, H, N, n, X]; matrices over a chunk [B, H, N, X, n, n].


def step_gate(component, name: str, gates: dict[str, torch.Tensor], like: torch.Tensor):
    """A gate [B, H, L, X], or the spec's fixed value as [B, H, L, 1]."""
    value = getattr(component, name)
    if value != "gate":
        return torch.full_like(like[..., :1], float(value))
    return gates[name]


def bias_signals(rt: Runtime, form: ChunkForm, seq: Tokens):
    """dL/dy = slope * y + offset per window token, times gamma, zero where no token exists:
    slope [B, H, P+T, 1 or Dv], offset [B, H, P+T, Dv]. y = 0 makes e = -v exactly."""
    args = [seq.window_gates[name] for name in rt.bias_gates]
    grad = rt.functions.bias_grad
    v = seq.v
    offset = grad(torch.zeros_like(v), v, *args)
    if form.slope is not None:
        slope = torch.full_like(v[..., :1], form.slope)
    elif form.slope_reads_v:
        slope = grad(torch.ones_like(v), v, *args) - offset
    else:  # reads only the bias's gates: evaluate at v = 0, where e = y exactly
        width = max((g.shape[-1] for g in args), default=1)
        zero = v.new_zeros(*v.shape[:-1], width)
        slope = grad(zero + 1, zero, *args) - grad(zero, zero, *args)
    if rt.spec.window.gamma == "gate":
        gamma = seq.window_gates[rt.spec.window.weight_gate]
        slope, offset = slope * gamma, offset * gamma
    elif float(rt.spec.window.gamma) != 1.0:
        gamma = float(rt.spec.window.gamma)
        slope, offset = slope * gamma, offset * gamma
    if seq.past == 0:  # every slot holds a token
        return slope, offset
    live = seq.valid > 0  # selected, not multiplied: an empty slot contributes exactly 0
    return torch.where(live, slope, 0.0), torch.where(live, offset, 0.0)


def _constant_slope(rt: Runtime, form: ChunkForm, seq: Tokens) -> float | None:
    """The slope of `bias_signals` as a number where it is one for every window slot: a constant
    d2L/dy2 times a constant gamma, with no empty slot; else None."""
    gamma = rt.spec.window.gamma
    if form.slope is None or gamma == "gate" or seq.past:
        return None
    return float(form.slope) * float(gamma)


def _window_rows(z: torch.Tensor, past: int, c: int, chunks: int, n: int, pad: int):
    """[B, H, P+T, D] (the window arrays) -> [B, H, N, n*c, D]: row t*c + j of chunk m holds
    token m*n + t - j; zero rows past the end."""
    z = _pad_tokens(z, pad)
    if c == 1:
        return z.unflatten(2, (chunks, n))
    return z[:, :, _window_index(past, c, chunks, n, str(z.device))].unflatten(2, (chunks, n * c))


@functools.lru_cache(maxsize=64)
def _window_index(past: int, c: int, chunks: int, n: int, device: str) -> torch.Tensor:
    token = torch.arange(chunks * n, device=device).view(-1, 1)
    return (token + past - torch.arange(c, device=device)).flatten()


@functools.lru_cache(maxsize=64)
def _lower(n: int, strict: bool, device: str) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool, device=device).tril(-1 if strict else 0)


def _rows(z: torch.Tensor) -> torch.Tensor:
    """[.., n, X] -> [.., X, n]."""
    return z.movedim(-1, -2)


def _pad_tokens(z: torch.Tensor, pad: int, fill: float = 0.0) -> torch.Tensor:
    """`pad` rows of `fill` after the tokens (axis 2); no copy when there are none."""
    return F.pad(z, (0, 0, 0, pad), value=fill) if pad else z


def _shift(z: torch.Tensor, fill: float) -> torch.Tensor:
    """z_{t-1} along the chunk's tokens (axis 3), `fill` before the first."""
    return F.pad(z, (0, 0, 1, 0), value=fill)[:, :, :, :-1]


def _shift_rows(m: torch.Tensor) -> torch.Tensor:
    """Row t of the result is row t - 1 of m; row 0 is zero."""
    return F.pad(m, (0, 0, 1, 0))[..., :-1, :]


def _expand_tokens(z: torch.Tensor, c: int) -> torch.Tensor:
    """[B, H, N, n, X] -> [B, H, N, n*c, X]: each token for its c window rows."""
    return z if c == 1 else z.repeat_interleave(c, dim=3)


def _expand_rows(m: torch.Tensor, c: int) -> torch.Tensor:
    return m if c == 1 else m.repeat_interleave(c, dim=-2)


def _expand_cols(m: torch.Tensor, c: int) -> torch.Tensor:
    return m if c == 1 else m.repeat_interleave(c, dim=-1)


def _mix(weight: torch.Tensor, signal: torch.Tensor) -> torch.Tensor:
    """sum_b weight[.., x, a, b] signal[.., b, v] -> [.., a, v], x = 1 or broadcast to v."""
    if weight.shape[-3] == 1:
        return weight.squeeze(-3) @ signal
    return torch.einsum("...vab,...bv->...av", weight, signal)


def _mix_t(weight: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """The adjoint of `_mix` in its signal: sum_a weight[.., x, a, b] grad[.., a, v] -> [.., b, v]."""
    if weight.shape[-3] == 1:
        return weight.squeeze(-3).mT @ grad
    return torch.einsum("...vab,...av->...bv", weight, grad)


def _at_row(m: torch.Tensor, end: torch.Tensor) -> torch.Tensor:
    """Row end[i] of chunk i: [B, H, N, X, n, m] -> [B, H, N, X, m]."""
    chunk = torch.arange(m.shape[2], device=m.device)
    return m.transpose(3, 4)[:, :, chunk, end]


def _at_token(z: torch.Tensor, end: torch.Tensor) -> torch.Tensor:
    """Token end[i] of chunk i: [B, H, N, n, X] -> [B, H, N, X]."""
    chunk = torch.arange(z.shape[2], device=z.device)
    return z[:, :, chunk, end]


# Default chunk sizes. With the exact form the chunk size changes only the speed: each chunk
# solves a system of n*c rows, so n = 64 // c keeps it at 64 (fla's chunk size; measured in
# docs/benchmarks.md). With the chunk-start form it changes the model: 16, as before.
EXACT_ROWS, START_CHUNK_SIZE = 64, 16


def default_chunk_size(mode: str, window_c: int | str) -> int:
    """The chunk size a layer gets when none is given, for a resolved `mode` and the spec's
    `window.c` (a global window keeps the chunk-start default: its rows grow with T)."""
    if mode == "exact" and isinstance(window_c, int):
        return max(1, EXACT_ROWS // window_c)
    return START_CHUNK_SIZE
