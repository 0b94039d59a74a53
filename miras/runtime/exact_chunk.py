"""The exact chunk form: for rules the affine analysis accepts (`miras.compiler.affine`), each
chunk is solved exactly, so the output equals the recurrence at any chunk size.

The WY / UT form of the delta rule (Yang et al. 2024, "Parallelizing Linear Transformers with
the Delta Rule over Sequence Length"), generalized to decay products, the retained gradient
point, momentum and the Omega window (docs/chunking.md, "The exact form"). In a chunk of n
tokens from state (W_0, S_0), with x_{t,j} = phi(k_{t-j}) (j < c) and the error signals

    r_{t,j} = A_{t-j} * (W_e,t x_{t,j}) + C_{t-j},   A = gamma * d2L/dy2,  C = gamma * dL/dy|_{y=0}
    W_e,t   = rho_t W_{t-1}                           (rho = 1, or a_t for grad_at: retained)
    W_{t}   = D_t W_0 - carry_t S_0 - sum_{s<=t} M[t, s] lr_s sum_j r_{s,j} x_{s,j}^T

(D_t = prod a, M = L^a for gd and L^a L^theta for momentum, carry_t = sum_tau L^a[t, tau]
Theta_tau), the n*c signals solve one unit-lower-triangular system

    (I + diag(A) K) R = A * P_0 + C,   K[(t,j'), (s,j)] = rho_t M[t-1, s] lr_s (x_{s,j} . x_{t,j'}), s < t,

with P_0 the predictions at W_0 and S_0. Everything but W_0 and S_0 is known before the scan,
so the triangular solves run for all chunks at once, giving R = R_C + E_W W_0^T - E_S S_0^T;
the scan over chunks is two matmuls per chunk, and the reads are batched after it.
A per-channel gate or slope scales rows of W, so the system then has one copy per channel
(X = Dv instead of 1).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from miras.ir import ChunkForm
from miras.runtime.core import Runtime, State, Tokens, as_param_gate


def forward(rt: Runtime, seq: Tokens, state: State, chunk_size: int, form: ChunkForm):
    """Returns o [B, H, T, Dv] and the final memory state, like `chunk.forward`. `form`: the
    compiled rule's `plan.chunk_form`; it must be "exact"."""
    if form.form != "exact":
        raise ValueError(f"spec '{rt.spec.name}' has no exact chunk form: {form.reason}")
    spec = rt.spec
    length, past, c = seq.length, seq.past, spec.window.c
    n = min(chunk_size, length)
    chunks = -(-length // n)
    pad = chunks * n - length

    # Step gates [B, H, T, X] -> [B, H, N, n, X]; padded tokens carry factor 1 (finite; they
    # come after every token they could touch).
    def steps(component, name: str) -> torch.Tensor:
        g = _gate(component, name, seq.step_gates, seq.phi_q)
        return F.pad(g, (0, 0, 0, pad), value=1.0).unflatten(2, (chunks, n))

    opt, retention = spec.optimizer, spec.retention
    lr = steps(opt, "lr")
    decay = steps(retention, retention.decay_gate) if retention.decay_gate else None
    theta = steps(opt, "momentum") if rt.has_momentum else None

    # Window terms [B, H, P+T, .] -> [B, H, N, n*c, .], row t*c + j is token t's offset j.
    slope, offset = _signals(rt, form, seq)
    keys = _window_rows(seq.phi_k, past, c, chunks, n, pad)
    slope, offset = (_window_rows(z, past, c, chunks, n, pad) for z in (slope, offset))
    queries = F.pad(seq.phi_q, (0, 0, 0, pad)).unflatten(2, (chunks, n))

    like = lr[..., :1]  # [B, H, N, n, 1]
    a = decay if decay is not None else torch.ones_like(like)
    d = torch.cumprod(a, dim=3)  # D_t [B, H, N, n, X]
    mix_a = _decay_matrix(a)  # L^a [B, H, N, X, n, n]
    if theta is not None:
        mix_theta = _decay_matrix(theta)
        big_theta = torch.cumprod(theta, dim=3)  # Theta_t
        mix = mix_a @ mix_theta  # M = L^a L^theta
        carry = (mix_a @ _rows(big_theta).unsqueeze(-1)).squeeze(-1).movedim(-1, 3)
    else:
        mix, carry = mix_a, None
    rho = a if rt.retained_gradient else torch.ones_like(like)
    coef_w = rho * _shift(d, 1.0)  # rho_t D_{t-1}: [B, H, N, n, X]
    coef_s = rho * _shift(carry, 0.0) if carry is not None else None

    mix_lr = mix * _rows(lr).unsqueeze(-2)  # M[t, s] lr_s: [B, H, N, X, n, n]
    solve = form.slope != 0.0  # a zero slope (dot): the signals do not depend on the state
    per_head = mix_lr.shape[3] == 1 and slope.shape[-1] == 1
    if solve:
        # K over (t, j') x (s, j): rho_t M[t-1, s] lr_s times the keys' Gram matrix; T = I + A K.
        k_tok = _rows(rho).unsqueeze(-1) * _shift_rows(mix_lr)  # [B, H, N, X, n, n]
        gram_kk = (keys @ keys.transpose(-1, -2)).unsqueeze(3)  # [B, H, N, 1, nc, nc]
        system = _expand_rows(_expand_cols(k_tok, c), c) * gram_kk * _rows(slope).unsqueeze(-1)
        # R = base + E_W W_0^T - E_S S_0^T, with base = T^-1 C and E = T^-1 diag(A coef) X.
        scale_w = slope * _expand_tokens(coef_w, c)  # [B, H, N, nc, X]
        scale_s = slope * _expand_tokens(coef_s, c) if coef_s is not None else None
        if per_head:  # one solve for every right-hand side: [C | A coef_W X | A coef_S X]
            rhs = [offset, scale_w * keys] + ([scale_s * keys] if scale_s is not None else [])
            solved = _unit_lower_solve(system.squeeze(3), torch.cat(rhs, dim=-1))
            widths = [offset.shape[-1]] + [keys.shape[-1]] * (len(rhs) - 1)
            base, from_w, *rest = solved.split(widths, dim=-1)
            from_s = rest[0] if rest else None
        else:  # one system per value channel: the inverse, then its column-scaled copies
            eye = torch.eye(n * c, dtype=system.dtype, device=system.device)
            inverse = _unit_lower_solve(system, eye.expand_as(system))  # [B, H, N, Dv, nc, nc]
            base = _mix(inverse, offset)
            from_w = inverse * _rows(scale_w).unsqueeze(-2)
            from_s = inverse * _rows(scale_s).unsqueeze(-2) if scale_s is not None else None
    else:
        base, from_w, from_s = offset, None, None

    # Row e of the chunk's end: n - 1, or the last real token in the last chunk.
    ends = [n - 1] * (chunks - 1) + [length - 1 - (chunks - 1) * n]
    end = torch.tensor(ends, device=lr.device)
    last_w = _at_row(_expand_cols(mix_lr, c), end)  # [B, H, N, X, nc]
    d_end = _at_token(d, end)  # [B, H, N, X]
    last_s = carry_end = theta_end = None
    if theta is not None:
        last_s = _at_row(_expand_cols(mix_theta * _rows(lr).unsqueeze(-2), c), end)
        carry_end, theta_end = _at_token(carry, end), _at_token(big_theta, end)

    # The scan over chunks: the signals R and the next state. Chunk-major copies, so each
    # chunk's operands are contiguous.
    def by_chunk(z):
        return None if z is None else z.movedim(2, 0).contiguous()

    keys_c, base_c, from_w_c, from_s_c = map(by_chunk, (keys, base, from_w, from_s))
    last_w_c, last_s_c = by_chunk(last_w.transpose(-1, -2)), by_chunk(_t(last_s))
    d_end_c, carry_end_c, theta_end_c = map(by_chunk, (d_end, carry_end, theta_end))
    w = state["W"]  # [B, H, Dv, Dphi]
    s = state.get("S.W")
    starts_w, starts_s, signals = [], [], []
    for i in range(chunks):
        starts_w.append(w)
        starts_s.append(s)
        r = base_c[i]  # [B, H, nc, Dv]
        if solve and per_head:
            r = r + from_w_c[i] @ w.transpose(-1, -2)
            if s is not None:
                r = r - from_s_c[i] @ s.transpose(-1, -2)
        elif solve:
            r = r + _mix(from_w_c[i], keys_c[i] @ w.transpose(-1, -2))
            if s is not None:
                r = r - _mix(from_s_c[i], keys_c[i] @ s.transpose(-1, -2))
        signals.append(r)
        w_new = as_param_gate(d_end_c[i]) * w - (r * last_w_c[i]).transpose(-1, -2) @ keys_c[i]
        if s is not None:
            w_new = w_new - as_param_gate(carry_end_c[i]) * s
            s = as_param_gate(theta_end_c[i]) * s + (r * last_s_c[i]).transpose(-1, -2) @ keys_c[i]
        w = w_new

    # The reads, for all chunks at once: o_t = D_t W_0 q_t - carry_t S_0 q_t
    #                                          - sum_{s<=t} M[t, s] lr_s sum_j (x_{s,j} . q_t) r_{s,j}.
    w0 = torch.stack(starts_w, dim=2)  # [B, H, N, Dv, Dphi]
    r = torch.stack(signals, dim=2)  # [B, H, N, nc, Dv]
    read_mix = _expand_cols(mix_lr, c) * (queries @ keys.transpose(-1, -2)).unsqueeze(3)
    o = d * (queries @ w0.transpose(-1, -2)) - _mix(read_mix, r)
    if s is not None:
        s0 = torch.stack(starts_s, dim=2)
        o = o - carry * (queries @ s0.transpose(-1, -2))
    o = o.flatten(2, 3)[:, :, :length]
    final = dict(state)
    final["W"] = w
    if s is not None:
        final["S.W"] = s
    return o, final


def _unit_lower_solve(system: torch.Tensor, rhs: torch.Tensor) -> torch.Tensor:
    """(I + system)^-1 rhs for a strictly lower-triangular `system`."""
    eye = torch.eye(system.shape[-1], dtype=system.dtype, device=system.device)
    return torch.linalg.solve_triangular(system + eye, rhs, upper=False, unitriangular=True)


def _t(z: torch.Tensor | None) -> torch.Tensor | None:
    return None if z is None else z.transpose(-1, -2)


# Helpers. Token-major tensors are [B, H, N, n, X]; matrices over a chunk [B, H, N, X, n, n].


def _gate(component, name: str, gates: dict[str, torch.Tensor], like: torch.Tensor):
    """A gate [B, H, L, X], or the spec's fixed value as [B, H, L, 1]."""
    value = getattr(component, name)
    if value != "gate":
        return torch.full_like(like[..., :1], float(value))
    return gates[name]


def _signals(rt: Runtime, form: ChunkForm, seq: Tokens):
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
    gamma = _gate(rt.spec.window, "gamma", seq.window_gates, v)
    live = seq.valid > 0  # selected, not multiplied: an empty slot contributes exactly 0
    return torch.where(live, slope * gamma, 0.0), torch.where(live, offset * gamma, 0.0)


def _window_rows(z: torch.Tensor, past: int, c: int, chunks: int, n: int, pad: int):
    """[B, H, P+T, D] (the window arrays) -> [B, H, N, n*c, D]: row t*c + j of chunk m holds
    token m*n + t - j; zero rows past the end."""
    z = F.pad(z, (0, 0, 0, pad))
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


def _decay_matrix(f: torch.Tensor) -> torch.Tensor:
    """L[t, s] = prod_{s<j<=t} f_j for s <= t, else 0: [B, H, N, n, X] -> [.., X, n, n].
    A cumulative product down the columns (no logs, no division), so a factor of 0
    (momentum theta = 0) gives exact zeros and finite gradients."""
    n = f.shape[3]
    device = str(f.device)
    rows = _rows(f).unsqueeze(-1).expand(*f.shape[:3], f.shape[-1], n, n)  # [t, s] = f_t
    factors = torch.where(_lower(n, True, device), rows, torch.ones_like(rows))
    return torch.cumprod(factors, dim=-2) * _lower(n, False, device)


def _rows(z: torch.Tensor) -> torch.Tensor:
    """[.., n, X] -> [.., X, n]."""
    return z.movedim(-1, -2)


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


def _at_row(m: torch.Tensor, end: torch.Tensor) -> torch.Tensor:
    """Row end[i] of chunk i: [B, H, N, X, n, m] -> [B, H, N, X, m]."""
    chunk = torch.arange(m.shape[2], device=m.device)
    return m.transpose(3, 4)[:, :, chunk, end]


def _at_token(z: torch.Tensor, end: torch.Tensor) -> torch.Tensor:
    """Token end[i] of chunk i: [B, H, N, n, X] -> [B, H, N, X]."""
    chunk = torch.arange(z.shape[2], device=z.device)
    return z[:, :, chunk, end]


CHUNK_MODES = ("auto", "start", "exact")


def resolve_mode(
    chunk_mode: str, form: ChunkForm, spec_name: str, backend: str, chunk_size: int
) -> str:
    """`chunk_mode` -> "exact" or "start" for this spec and backend; a ValueError naming the
    reason where the exact form is asked for and does not exist, or the backend lacks it."""
    if chunk_mode not in CHUNK_MODES:
        raise ValueError(
            f"chunk_mode: expected one of {', '.join(CHUNK_MODES)}, got {chunk_mode!r}"
        )
    if chunk_mode == "exact" and form.form != "exact":
        raise ValueError(
            f"chunk_mode: 'exact' is not available for spec '{spec_name}': {form.reason}; use "
            "chunk_mode='start' (the chunk-start approximation) or 'auto'"
        )
    mode = form.form if chunk_mode == "auto" else chunk_mode
    # Both forms coincide at chunk size 1, and for a zero slope (the dot bias: the signals do
    # not read the state).
    if backend == "triton" and mode == "exact" and form.slope != 0.0 and chunk_size > 1:
        raise ValueError(
            f"backend: 'triton' computes the chunk-start form only, and spec '{spec_name}' "
            f"resolves to the exact chunk form ({form.reason}); use backend='chunk' for the "
            "exact form, or chunk_mode='start' for the chunk-start approximation"
        )
    return mode
