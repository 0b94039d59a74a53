"""The exact minimizer (optimizer exact, MesaNet): the memory is the minimizer of the whole
quadratic objective, so its state is the objective's sufficient statistics and each read
solves the normal equations (the derivation: miras/compiler/minimizer.py).

    H_kk,t = a_t H_kk,t-1 + gamma_t phi(k_t) phi(k_t)^T       [B, H, Dphi, Dphi]
    H_vk,t = a_t H_vk,t-1 + gamma_t r_t phi(k_t)^T            [B, H, Dv, Dphi]
    (s H_kk,t + diag(ridge_t)) x_t = phi(q_t),   o_t = H_vk,t x_t

r_t = -dL/dy(0, v_t) (the emitted bias gradient at y = 0: v_t for l2 and dot), s = d2L/dy^2
(`ChunkForm.slope`), a_t the retention's decay (1 without one).

Two forms, equal to float precision at any chunk size:
- `recurrent`: one token at a time, the statistics as above (the reference);
- `chunked`: per chunk of b tokens, the per-token statistics from the chunk-start ones by a
  masked matmul, H_kk,t = A_t H_kk,0 + sum_{i<=t} (A_t / A_i) gamma_i phi(k_i) phi(k_i)^T
  (A_t the decays' product since the chunk's start), and the read without H_vk,t:
  o_t = A_t H_vk,0 x_t + sum_{i<=t} (A_t / A_i) gamma_i (phi(k_i) . x_t) r_i.

The solve is a batched Cholesky factorization per token (torch.linalg.cholesky_ex, then
cholesky_solve): exact, and at Dphi <= 128 cheap next to the statistics; fla's kernel uses
conjugate gradients with a fixed iteration count, which converges to the same x_t. Its
gradient is the implicit derivative of the solve (`_CholeskySolve`: two triangular solves
with the saved factor), exact; the statistics' gradients are autograd through the matmuls.
"""

from __future__ import annotations

import torch

from miras.ir import ChunkForm
from miras.runtime.core import Runtime, State
from miras.runtime.recurrent import collector_paused


def initial_state(
    batch: int, heads: int, d_phi: int, d_v: int, dtype, device, window: int | str = "global"
) -> State:
    """The state before any token: the objective is the ridge alone (W_0 = 0). With the whole
    prefix (`window` "global"), zero statistics; with a window of c tokens, c empty slots of
    the carried tokens, all zeros (gamma 0: no term; log-decay 0), so that a state of zeros is
    the empty one (as the layer starts it)."""
    if window == "global":
        return {
            "H_kk": torch.zeros(batch, heads, d_phi, d_phi, dtype=dtype, device=device),
            "H_vk": torch.zeros(batch, heads, d_v, d_phi, dtype=dtype, device=device),
        }

    def slots(value: float, width: int) -> torch.Tensor:
        return torch.full((batch, heads, window, width), value, dtype=dtype, device=device)

    return {
        "window.k": slots(0.0, d_phi),
        "window.r": slots(0.0, d_v),
        "window.gamma": slots(0.0, 1),
        "window.log_decay": slots(0.0, 1),
    }


def check_state(initial, default: State) -> State:
    """The caller's statistics (a dict H_kk, H_vk of the default's shapes) or the default."""
    if initial is None:
        return default
    names = list(default)
    if not isinstance(initial, dict) or set(initial) != set(names):
        got = sorted(initial) if isinstance(initial, dict) else type(initial).__name__
        what = "statistics" if "H_kk" in default else "window's last c tokens"
        raise ValueError(
            f"initial_state: optimizer exact's state is the objective's {what}, a dict with "
            f"keys {names}, got {got}"
        )
    state = {}
    for name in names:
        given, expected = initial[name], default[name]
        if not isinstance(given, torch.Tensor) or tuple(given.shape) != tuple(expected.shape):
            shape = list(given.shape) if isinstance(given, torch.Tensor) else type(given).__name__
            raise ValueError(
                f"initial_state[{name!r}]: expected shape {list(expected.shape)}, got {shape}"
            )
        state[name] = given.to(expected.dtype)
    if "H_kk" not in state:
        return state
    kk = state["H_kk"].detach()
    # The read's Cholesky factor sees one triangle of H_kk: an asymmetric one is not a sum of
    # k k^T, and its solve would depend on which triangle is read.
    largest = float(kk.abs().max()) if kk.numel() else 0.0  # none in an empty batch (B = 0)
    if not torch.allclose(kk, kk.mT, rtol=1e-5, atol=1e-6 * max(largest, 1.0)):
        raise ValueError(
            "initial_state['H_kk']: expected a symmetric matrix (the decayed sum of "
            f"gamma k k^T), got one with |H - H^T| up to {float((kk - kk.mT).abs().max()):.3g}"
        )
    return state


def _per_token(component, name: str | None, gates, like: torch.Tensor) -> torch.Tensor:
    """A gate [B, H, T, X], or the spec's fixed value (1 without the field) as [B, H, T, 1]."""
    value = 1.0 if name is None else getattr(component, name)
    if value == "gate":
        return gates[name]
    return torch.full_like(like[..., :1], float(value))


def inputs(rt: Runtime, phi_k, v, gates) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log a [B, H, T], gamma [B, H, T], r = -dL/dy(0, v) [B, H, T, Dv])."""
    spec = rt.spec
    decay = _per_token(spec.retention, spec.retention.decay_gate, gates, phi_k)[..., 0]
    gamma = _per_token(spec.window, spec.window.weight_gate, gates, phi_k)[..., 0]
    bias_args = [gates[n] for n in rt.bias_gates]
    r = -rt.functions.bias_grad(torch.zeros_like(v), v, *bias_args)
    return decay.log(), gamma, r


def ridge_of(rt: Runtime, gates, phi_q: torch.Tensor) -> torch.Tensor:
    """The ridge lambda_t [B, H, T, Dphi] (a per-head gate or a fixed value broadcast)."""
    name = rt.spec.optimizer.ridge_gate
    ridge = _per_token(rt.spec.optimizer, name, gates, phi_q)
    d_phi = phi_q.shape[-1]
    if ridge.shape[-1] not in (1, d_phi):
        raise ValueError(
            f"gates[{name!r}]: per key channel it must have Dphi = {d_phi} entries, the feature "
            f"map's width, got {ridge.shape[-1]}; pass it per head [B, T, H] instead"
        )
    return ridge.expand(*phi_q.shape)


def solve(kk: torch.Tensor, ridge: torch.Tensor, slope: float, rhs: torch.Tensor, first: int = 0):
    """x with (slope kk + diag(ridge)) x = rhs. kk [..., D, D] symmetric, ridge and rhs
    [..., D]. `first`: the token of the first system along axis 2 of per-token batches
    [B, H, n, D, D], for the error where a system is not positive definite."""
    return _CholeskySolve.apply(slope * kk + torch.diag_embed(ridge), rhs, first)


class _CholeskySolve(torch.autograd.Function):
    """x = A^-1 b for symmetric positive definite A [..., D, D], b [..., D], by the Cholesky
    factor L (A = L L^T). The backward is the implicit derivative of A x = b: with
    y = A^-1 dx (the same factor, A = A^T), db = y and dA = -y x^T, the gradient of the solve
    of the full matrix A (fla's torch.linalg.solve has it), where autograd through
    torch.linalg.cholesky would give a gradient on A's lower triangle only (equal for every
    input that reaches A symmetrically, k k^T, but not for a caller's initial H_kk)."""

    @staticmethod
    def forward(ctx, system: torch.Tensor, b: torch.Tensor, first: int) -> torch.Tensor:
        factor, info = torch.linalg.cholesky_ex(system)
        if bool((info != 0).any()):
            bad = (info != 0).nonzero()[0].tolist()
            token = first + (bad[2] if info.dim() > 2 else 0)
            raise ValueError(
                f"optimizer exact: the system s H_kk + diag(ridge) is not positive definite in "
                f"{str(system.dtype).removeprefix('torch.')} at token {token} (batch row "
                f"{bad[0]}, head {bad[1]}); raise the ridge gate (MesaNet keeps lambda >= "
                "0.25) or run in float64"
            )
        x = torch.cholesky_solve(b.unsqueeze(-1), factor).squeeze(-1)
        ctx.save_for_backward(factor, x)
        return x

    @staticmethod
    def backward(ctx, dx: torch.Tensor):
        factor, x = ctx.saved_tensors
        y = torch.cholesky_solve(dx.unsqueeze(-1), factor).squeeze(-1)
        return -y.unsqueeze(-1) * x.unsqueeze(-2), y, None


def weights(form: ChunkForm, state: State, ridge: torch.Tensor) -> torch.Tensor:
    """W = H_vk (s H_kk + diag(ridge))^-1, the minimizer the statistics stand for, for reads
    outside a sequence (the probes): state H_kk [B, H, D, D], H_vk [B, H, Dv, D]; ridge
    [B, H, D] (or broadcasting). Returns W [B, H, Dv, D]."""
    if "H_kk" not in state:  # the window's c tokens: their statistics at the last one
        kk, vk = window_statistics(state)
    else:
        kk, vk = state["H_kk"], state["H_vk"]
    rows = vk.shape[-2]
    # Row j of W is A^-1 (row j of H_vk), A symmetric: one system per value channel.
    kk = kk.unsqueeze(-3).expand(*kk.shape[:-2], rows, *kk.shape[-2:])
    ridge = ridge.expand(*vk.shape[:-2], vk.shape[-1]).unsqueeze(-2).expand(vk.shape)
    return solve(kk, ridge, form.slope, vk)


@collector_paused()
def recurrent(rt: Runtime, form: ChunkForm, phi_q, phi_k, v, gates, state: State):
    """One token at a time: returns o [B, H, T, Dv] and the final statistics."""
    log_a, gamma, r = inputs(rt, phi_k, v, gates)
    ridge = ridge_of(rt, gates, phi_q)
    kk, vk = state["H_kk"], state["H_vk"]
    outputs = []
    # Per-token views by `unbind` (one stack in the backward, where indexing [:, :, t] adds a
    # zero full-length gradient per token: quadratic in T).
    by_token = zip(*(z.unbind(2) for z in (log_a, gamma, r, phi_k, ridge, phi_q)), strict=True)
    for t, (log_a_t, gamma_t, r_t, k, ridge_t, q) in enumerate(by_token):
        a, g = log_a_t[:, :, None, None].exp(), gamma_t[:, :, None, None]
        kk = a * kk + g * k.unsqueeze(-1) * k.unsqueeze(-2)
        vk = a * vk + g * r_t.unsqueeze(-1) * k.unsqueeze(-2)
        x = solve(kk, ridge_t, form.slope, q, first=t)
        outputs.append((vk @ x.unsqueeze(-1)).squeeze(-1))
    return torch.stack(outputs, dim=2), {"H_kk": kk, "H_vk": vk}


def chunked(rt: Runtime, form: ChunkForm, phi_q, phi_k, v, gates, state: State, chunk_size: int):
    """Chunks of `chunk_size` tokens, each in masked matmuls; returns o and the statistics.
    The per-token statistics of every chunk are built first and factored in one batched call
    (fewer, larger LAPACK batches), then each chunk's outputs read them."""
    log_a, gamma, r = inputs(rt, phi_k, v, gates)
    ridge = ridge_of(rt, gates, phi_q)
    kk, vk = state["H_kk"], state["H_vk"]
    length, d = phi_q.shape[2], phi_q.shape[-1]
    pieces = []  # per chunk: (slice, log A_t, mix, H_vk at the chunk's start)
    systems = []
    for start in range(0, length, chunk_size):
        sl = slice(start, min(start + chunk_size, length))
        k, n = phi_k[:, :, sl], phi_k[:, :, sl].shape[2]
        g = log_a[:, :, sl].cumsum(-1)  # log A_t [B, H, n]
        causal = torch.ones(n, n, dtype=torch.bool, device=k.device).tril()
        # log(A_t / A_i) for i <= t; -inf above the diagonal (exp 0, never inf * 0).
        gap = (g.unsqueeze(-1) - g.unsqueeze(-2)).masked_fill(~causal, -torch.inf)
        mix = gap.exp() * gamma[:, :, sl].unsqueeze(-2)  # [B, H, t, i]
        outer = (k.unsqueeze(-1) * k.unsqueeze(-2)).flatten(-2)  # [B, H, n, D*D]
        inside = (mix @ outer).unflatten(-1, (d, d))  # [B, H, n, D, D]
        kk_t = g.exp()[..., None, None] * kk.unsqueeze(2) + inside
        systems.append(kk_t)
        pieces.append((sl, g, mix, vk))
        last = mix[:, :, -1]  # A_n / A_i gamma_i [B, H, n]
        kk = kk_t[:, :, -1]
        vk = (
            g[:, :, -1, None, None].exp() * vk
            + (r[:, :, sl] * last.unsqueeze(-1)).transpose(-1, -2) @ k
        )
    x = solve(torch.cat(systems, dim=2), ridge, form.slope, phi_q)  # [B, H, T, D]
    outputs = []
    for sl, g, mix, vk0 in pieces:
        xs = x[:, :, sl]
        carried = g.exp().unsqueeze(-1) * (xs @ vk0.transpose(-1, -2))  # A_t H_vk,0 x_t
        outputs.append(carried + ((xs @ phi_k[:, :, sl].transpose(-1, -2)) * mix) @ r[:, :, sl])
    return torch.cat(outputs, dim=2), {"H_kk": kk, "H_vk": vk}


def window_statistics(state: State) -> tuple[torch.Tensor, torch.Tensor]:
    """H_kk, H_vk of the objective at the last carried token, from the window's c tokens."""
    k, r, gamma = state["window.k"], state["window.r"], state["window.gamma"]
    # a_{i+1..last}: the decays after each token, a reversed cumulative product.
    log_decay = state["window.log_decay"]
    after = torch.cat([log_decay[:, :, 1:], torch.zeros_like(gamma[:, :, :1])], 2).exp()
    weight = after.flip(2).cumprod(2).flip(2) * gamma  # [B, H, c, 1]
    return (weight * k).transpose(-1, -2) @ k, (weight * r).transpose(-1, -2) @ k


def _carried(rt: Runtime, phi_k, v, gates, state: State):
    """The window's c carried tokens, then the sequence's: k [B, H, c+T, D], r [B, H, c+T, Dv],
    gamma and log a [B, H, c+T]."""
    log_a, gamma, r = inputs(rt, phi_k, v, gates)
    return (
        torch.cat([state["window.k"], phi_k], 2),
        torch.cat([state["window.r"], r], 2),
        torch.cat([state["window.gamma"][..., 0], gamma], 2),
        torch.cat([state["window.log_decay"][..., 0], log_a], 2),
    )


def _window_out(k, r, gamma, log_a, c: int) -> State:
    """The last c tokens, the state for the next call."""
    return {
        "window.k": k[:, :, -c:],
        "window.r": r[:, :, -c:],
        "window.gamma": gamma[:, :, -c:, None],
        "window.log_decay": log_a[:, :, -c:, None],
    }


@collector_paused()
def window_recurrent(rt: Runtime, form: ChunkForm, phi_q, phi_k, v, gates, state: State):
    """A window of c tokens, one token at a time: token t's statistics summed over the tokens
    t-c+1..t (the carried ones first), each decayed by the decays after it."""
    c = rt.spec.window.c
    k, r, gamma, log_a = _carried(rt, phi_k, v, gates, state)
    ridge = ridge_of(rt, gates, phi_q)
    outputs = []
    # Per-token views by `unbind`, as in `recurrent`: indexing [:, :, i] would add a zero
    # full-length gradient per token and slot (quadratic in T).
    k_, r_, gamma_, log_a_ = (z.unbind(2) for z in (k, r, gamma, log_a))
    for t, (ridge_t, q) in enumerate(zip(ridge.unbind(2), phi_q.unbind(2), strict=True)):
        kk, vk = 0.0, 0.0
        weight = torch.ones_like(gamma_[0][:, :, None, None])  # a_{i+1..t}
        for i in range(t + c, t, -1):  # token t sits at c + t
            w = weight * gamma_[i][:, :, None, None]
            kk = kk + w * k_[i].unsqueeze(-1) * k_[i].unsqueeze(-2)
            vk = vk + w * r_[i].unsqueeze(-1) * k_[i].unsqueeze(-2)
            weight = weight * log_a_[i][:, :, None, None].exp()
        x = solve(kk, ridge_t, form.slope, q, first=t)
        outputs.append((vk @ x.unsqueeze(-1)).squeeze(-1))
    return torch.stack(outputs, dim=2), _window_out(k, r, gamma, log_a, c)


def window_chunked(
    rt: Runtime, form: ChunkForm, phi_q, phi_k, v, gates, state: State, chunk_size: int
):
    """A window of c tokens in chunks: each chunk's per-token statistics from its tokens and
    the c before it by a banded mask (no carried sums, so nothing is ever subtracted)."""
    c = rt.spec.window.c
    k, r, gamma, log_a = _carried(rt, phi_k, v, gates, state)
    ridge = ridge_of(rt, gates, phi_q)
    length, d = phi_q.shape[2], phi_q.shape[-1]
    outputs = []
    for start in range(0, length, chunk_size):
        n = min(chunk_size, length - start)
        sl = slice(start, start + c + n)  # the c tokens before the chunk, then the chunk's
        g = log_a[:, :, sl].cumsum(-1)  # [B, H, c+n]
        rows = torch.arange(c, c + n, device=g.device).unsqueeze(-1)  # token t at row c + t
        cols = torch.arange(c + n, device=g.device)
        band = (cols <= rows) & (cols > rows - c)  # i in t-c+1..t
        gap = (g[:, :, c:].unsqueeze(-1) - g.unsqueeze(-2)).masked_fill(~band, -torch.inf)
        mix = gap.exp() * gamma[:, :, sl].unsqueeze(-2)  # [B, H, n, c+n]
        ks = k[:, :, sl]
        outer = (ks.unsqueeze(-1) * ks.unsqueeze(-2)).flatten(-2)  # [B, H, c+n, D*D]
        kk_t = (mix @ outer).unflatten(-1, (d, d))  # [B, H, n, D, D]
        x = solve(
            kk_t,
            ridge[:, :, start : start + n],
            form.slope,
            phi_q[:, :, start : start + n],
            first=start,
        )
        outputs.append(((x @ ks.transpose(-1, -2)) * mix) @ r[:, :, sl])
    return torch.cat(outputs, dim=2), _window_out(k, r, gamma, log_a, c)


def forward(
    rt: Runtime,
    form: ChunkForm,
    phi_q: torch.Tensor,
    phi_k: torch.Tensor,
    v: torch.Tensor,
    gates: dict[str, torch.Tensor],
    initial,
    backend: str,
    chunk_size: int,
    mode: str,
):
    """phi_q, phi_k [B, H, T, Dphi], v [B, H, T, Dv], gates [B, H, T, X] (heads first, in the
    state's dtype); `initial`: None or a dict H_kk, H_vk. Returns o [B, H, T, Dv] and the
    final statistics (a dict H_kk [B, H, Dphi, Dphi], H_vk [B, H, Dv, Dphi])."""
    if backend == "triton":
        raise ValueError(
            f"backend: 'triton' has no kernel for spec '{rt.spec.name}' (optimizer exact); use "
            "backend='chunk' (parallel) or 'recurrent' (the exact reference)"
        )
    if mode == "start":
        raise ValueError(
            f"chunk_mode: 'start' does not apply to spec '{rt.spec.name}': optimizer exact "
            "takes no gradient step to approximate, and its chunk form is exact; use 'auto'"
        )
    b, h, _, d_phi = phi_k.shape
    window = rt.spec.window.c
    default = initial_state(b, h, d_phi, v.shape[-1], phi_k.dtype, phi_k.device, window)
    state = check_state(initial, default)
    if window != "global":
        if backend == "recurrent":
            return window_recurrent(rt, form, phi_q, phi_k, v, gates, state)
        return window_chunked(rt, form, phi_q, phi_k, v, gates, state, chunk_size)
    if backend == "recurrent":
        return recurrent(rt, form, phi_q, phi_k, v, gates, state)
    return chunked(rt, form, phi_q, phi_k, v, gates, state, chunk_size)
