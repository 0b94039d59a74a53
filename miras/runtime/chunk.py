"""The chunk backend: inside a chunk of b tokens every gradient is taken at the chunk-start
state (the parallelization of Titans, MIRAS and ATLAS); b = 1 is the exact recurrence.

Two paths, the same semantics:
- `forward_linear`: matrix memory, linear retention (none, l2), gd or momentum, a linear read.
  The chunk collapses into matmuls with decay masks (no per-token state): the fast path.
- `forward_general`: any other spec. Gradients, memory backward and reads are batched over the
  chunk; the optimizer recurrence and the (possibly nonlinear) retention map run token by token
  on per-token updates, so each map is applied at every token exactly as in the recurrence
  (docs/chunking.md).

Within a chunk starting at state S (read as W_S), for token t with window c:
    W_e,t = W_S                 (grad_at: state)   or   (prod_{j=s..t} a_j) W_S   (retained)
    g_t   = sum_{i=t-c+1..t} gamma_i grad_W L(M_{W_e,t}(phi(k_i)), v_i)
and the optimizer and retention recurrences of the exact step run over the g_t.
"""

from __future__ import annotations

import functools

import torch

from miras.components.optimizer.muon import newton_schulz
from miras.runtime.core import Runtime, State, Tokens, as_param_gate


def forward(rt: Runtime, seq: Tokens, state: State, chunk_size: int):
    """Returns o [B, H, T, Dv] and the final memory state."""
    if linear_path_applies(rt):
        return forward_linear(rt, seq, state, chunk_size)
    return forward_general(rt, seq, state, chunk_size)


def linear_path_applies(rt: Runtime) -> bool:
    spec = rt.spec
    return (
        spec.memory.kind == "matrix"
        and spec.retention.kind in ("none", "l2")
        and spec.optimizer.kind in ("gd", "momentum")
    )


def _gate(rt: Runtime, component, name: str, gates, sl: slice, like: torch.Tensor):
    """A gate over the chunk [B, H, n, X], or its fixed value broadcast the same way."""
    value = getattr(component, name)
    if value != "gate":
        return torch.full_like(like[..., :1], float(value))
    return gates[name][:, :, sl]


def _window_gradients(rt: Runtime, predict, seq: Tokens, start: int, end: int):
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
        grad_y = grad_y * rt.scalar(rt.spec.window, "gamma", seq.window_gates, idx)
        if seq.past:  # only the window reaches tokens that may not exist: selected away
            grad_y = torch.where(seq.valid[:, :, idx] > 0, grad_y, 0.0)
        out.append((x, grad_y))
    return out


def _chunk_views(seq: Tokens, chunk_size: int) -> list[Tokens]:
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


def _retained_decay(rt: Runtime, gates, sl: slice, like: torch.Tensor) -> torch.Tensor:
    """prod_{j=s..t} a_j for each t of the chunk: [B, H, n, X]."""
    a = _gate(rt, rt.spec.retention, "decay", gates, sl, like)
    return torch.cumprod(a, dim=2)


# The general path ---------------------------------------------------------------------------


def forward_general(rt: Runtime, seq: Tokens, state: State, chunk_size: int):
    state = dict(state)
    opt = rt.spec.optimizer
    outputs = []
    for part in _chunk_views(seq, chunk_size):
        gates = part.step_gates
        start, end = 0, part.length
        sl = slice(start, end)
        n = end - start
        weights = rt.weights(state)  # W_S [B, H, out, in]
        weights_e = {name: w.unsqueeze(2) for name, w in weights.items()}  # [B, H, 1, out, in]
        like = part.phi_q
        if rt.retained_gradient:
            decay = as_param_gate(_retained_decay(rt, gates, sl, like))
            weights_e = {name: decay * w for name, w in weights_e.items()}

        # g_t for every token of the chunk at once: [B, H, n, out, in] per parameter.
        grads = None

        def predict(x, weights_e=weights_e):
            return rt.memory.forward(weights_e, x)

        for x, grad_y in _window_gradients(rt, predict, part, start, end):
            g = rt.memory.backward(weights_e, x, grad_y)
            grads = g if grads is None else {k: grads[k] + g[k] for k in g}

        lr = as_param_gate(_gate(rt, opt, "lr", gates, sl, like))
        theta = (
            as_param_gate(_gate(rt, opt, "momentum", gates, sl, like)) if rt.has_momentum else None
        )
        retention_args = [as_param_gate(gates[name][:, :, sl]) for name in rt.retention_gates]

        per_token = {name: [] for name in rt.param_names}
        for t in range(n):
            for name in rt.param_names:
                u = lr[:, :, t] * grads[name][:, :, t]
                if theta is not None:
                    u = theta[:, :, t] * state[f"S.{name}"] + u
                    state[f"S.{name}"] = u
                    if opt.kind == "muon":
                        u = newton_schulz(u, opt.ns_steps)
                args = [g[:, :, t] for g in retention_args]
                state[name] = rt.functions.retention_step(state[name], u, *args)
                per_token[name].append(state[name])
        read = {
            name: rt.functions.retention_read(torch.stack(ws, dim=2))
            for name, ws in per_token.items()
        }
        outputs.append(rt.memory.forward(read, part.phi_q))
    return torch.cat(outputs, dim=2), state


# The linear path ----------------------------------------------------------------------------


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


def forward_linear(rt: Runtime, seq: Tokens, state: State, chunk_size: int):
    """Matrix memory, retention none or l2, gd or momentum, as matmuls per chunk.

    With u_t the update, the recurrence
    W_t = a_t W_{t-1} - u_t unrolls inside a chunk to
        W_t = D_t W_S - sum_{s<=t} L^a[t, s] u_s,   D_t = prod_{j<=t} a_j,
    and momentum u_s = theta_s u_{s-1} + lr_s g_s unrolls the same way with L^theta; both are
    lower-triangular decay matrices, so the read o_t = W_t phi(q_t) is a masked matmul over
    the chunk's error signals G (each g_s = sum_j G_{s,j} phi(k_{s-j})^T). Exact at b = 1."""
    opt = rt.spec.optimizer
    retention = rt.spec.retention
    state = dict(state)
    outputs = []
    for part in _chunk_views(seq, chunk_size):
        gates = part.step_gates
        start, end = 0, part.length
        sl = slice(start, end)
        like = part.phi_q
        w_s = state["W"]  # [B, H, Dv, Dphi]
        if retention.kind == "l2":
            decay = _gate(rt, retention, "decay", gates, sl, like)  # [B, H, n, X]
        else:
            decay = torch.ones_like(like[..., :1])
        d_t = torch.cumprod(decay, dim=2)  # prod_{j=s..t} a_j: [B, H, n, X]
        w_t = w_s.transpose(-1, -2)  # [B, H, Dphi, Dv]

        def predict(x, w_t=w_t, d_t=d_t):
            # M_{W_e,t}(x) = W_S x, or (D_t W_S) x = D_t (W_S x) for the retained state:
            # rows of W scale, so the decay applies to the prediction, not a per-token copy.
            y = x @ w_t
            return d_t * y if rt.retained_gradient else y

        signals = _window_gradients(rt, predict, part, start, end)

        lr = _gate(rt, opt, "lr", gates, sl, like)  # [B, H, n, X]
        mixing = _decay_matrix(decay)  # L^a [B, H, X, n, n]
        if rt.has_momentum:
            theta = _gate(rt, opt, "momentum", gates, sl, like)
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
        if rt.has_momentum:
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
        if rt.has_momentum:
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
