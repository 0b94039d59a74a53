"""The dual form of a two-layer MLP memory on the Triton backend: a forward and a backward
kernel (`dual_forward`, `dual_backward`, emitted by `miras.compiler.triton_dual` from
`kernels/templates/dual.py`).

    o, final = forward(program, seq, state, chunk_size, precision, operand_dtype)

The kernels compute what `miras.runtime.dual.forward` computes and its gradients
(tests/kernels/test_triton_dual.py): the mixing matrices of every chunk (`dual.unrolled_chunks`,
from the step gates alone) are built in torch and handed to them zero-padded; each walks the
chunks, one program per (batch, head), with the network's weights in float32 global memory.

When a gradient is wanted the forward stores chunk start states for the backward: every
chunk's, or, past `STARTS_BUDGET` bytes, every G-th chunk's, and the backward then runs the
forward kernel again over each stretch of G chunks to get the starts inside it before
differentiating that stretch. The backward kernel hands the gates' gradients as gradients of
the mixing matrices, which torch carries back to the gates through `dual.unrolled_chunks`.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING

import torch

from miras.runtime import dual
from miras.runtime.core import State, Tokens
from miras.runtime.inputs import DEFAULT_TRITON_PRECISION
from miras.runtime.triton_launch import (
    accumulator,
    check_available,
    check_written,
    dot_precision,
    operands_dtype,
    poisoned,
    pow2,
)

if TYPE_CHECKING:
    from miras.runtime.program import Program

# The kernel streams the hidden width in blocks of at most this many units: [HB, Dk] tiles of
# the input layer, [Dv, HB] of the output layer. Tests lower it to exercise several blocks.
# Compiled for titans (chunk 16, bf16 inputs; docs/kernels.md, "Deep memories on the GPU"),
# 32 units, 8 warps and 2 stages spill 0 B at d 64 on sm_90 and 20 B at d 128; 64 units with
# 4 warps and 3 stages spilled 444 B and 3080 B and needed 283 KB of shared memory at d 128,
# over an H100's 227 KB. No GPU has timed either.
HIDDEN_BLOCK = 32
NUM_WARPS = 8
NUM_STAGES = 2
# The backward kernel: 8 warps, no software pipelining of its loads. Compiled for titans
# (chunk 16, bf16 inputs, sm_90), 2 stages spilled 498 B at d 64 and 1028 B at d 128, 1 stage
# 248 B and 496 B, hidden blocks of 16 (2 stages) 664 B and 2278 B; 4 or 16 warps and chunks of
# 32 or 64 spilled more on a variant of it. No GPU has timed any of them.
BACKWARD_WARPS = 8
BACKWARD_STAGES = 1
# The chunk starts the forward keeps for the backward, in bytes: past it, every G-th chunk's
# (`starts_every`), and the backward recomputes the rest a stretch of G chunks at a time.
# Titans at d 64 keeps 256 KiB a start and head: 1 GiB is 4096 (chunk, head) pairs, e.g.
# T 8192 at chunk 16 over 8 heads. Tests lower it.
STARTS_BUDGET = 1 << 30


def _per_token(x: torch.Tensor | float, like: torch.Tensor) -> torch.Tensor:
    """A per-head scalar per token ([B, H, T, 1] or a float) -> [B * H, T] in like's dtype."""
    b, h, t = like.shape[:3]
    full = torch.as_tensor(x, dtype=like.dtype, device=like.device).expand(b, h, t, 1)
    return full.reshape(b * h, t).contiguous()


def mixing_inputs(rt, seq: Tokens, chunk_size: int, graph: bool = False):
    """The kernel's step-gate inputs, every chunk at once from `dual.unrolled_chunks` (with
    `graph`, built under autograd so the backward kernel's gate gradients flow back through
    it to the step gates; without, no gradient): dec D_t and car C_t [BH, T]; coeff [BH, NC, BT, BT] (K[t, s] lr_s); last,
    last_s [BH, NC, BT] (-K[m-1, s] lr_s and L^theta[m-1, s] lr_s at each chunk's last token
    m - 1); ends [BH, NC, 4] = (D, C, Theta at that token, 0). Rows and columns past a chunk's
    tokens are zero. The last chunk, padded with factors 1 by the unrolling, ends at its last
    real token: with momentum the padding's steps would still move W."""
    with torch.set_grad_enabled(graph):
        return _mixing_inputs(rt, seq, chunk_size)


def _mixing_inputs(rt, seq: Tokens, chunk_size: int):
    b, h, t = seq.phi_q.shape[:3]
    bh = b * h
    unrolled, n, nc = dual.unrolled_chunks(rt, seq, chunk_size)
    bt = pow2(n)
    m = t - (nc - 1) * n  # the last chunk's tokens
    ends_at = torch.full((nc,), n - 1, device=seq.v.device)
    ends_at[-1] = m - 1
    chunk = torch.arange(nc, device=seq.v.device)

    def heads(x: torch.Tensor) -> torch.Tensor:
        """[B or 1, H or 1, N, ...] -> [BH, N, ...] in the state's dtype."""
        return x.expand(b, h, *x.shape[2:]).reshape(bh, *x.shape[2:]).to(seq.v.dtype)

    def per_token(x: torch.Tensor) -> torch.Tensor:  # [B, H, N, n, 1] -> [BH, T]
        return heads(x)[..., 0].reshape(bh, nc * n)[:, :t].contiguous()

    def end_row(x: torch.Tensor) -> torch.Tensor:  # [BH, N, n, n] -> [BH, N, BT], row m - 1
        row = x[:, chunk, ends_at].clone()
        row[:, -1, m:] = 0.0
        return torch.nn.functional.pad(row, (0, bt - n))

    mix = heads(unrolled.mix[:, :, :, 0])  # [BH, N, n, n]
    coeff = torch.nn.functional.pad(mix, (0, bt - n, 0, bt - n))
    coeff[:, -1, m:] = 0.0
    coeff[:, -1, :, m:] = 0.0
    last = -end_row(mix)
    d = heads(unrolled.d)[..., 0]  # [BH, N, n]
    ends = torch.zeros(bh, nc, 4, dtype=seq.v.dtype, device=seq.v.device)
    ends[..., 0] = d[:, chunk, ends_at]
    if unrolled.carry is None:
        last_s = torch.zeros_like(last)
        car = torch.zeros(bh, t, dtype=seq.v.dtype, device=seq.v.device)
    else:
        last_s = end_row(heads(unrolled.state_mix[:, :, :, 0]))
        car = per_token(unrolled.carry)
        ends[..., 1] = heads(unrolled.carry)[..., 0][:, chunk, ends_at]
        ends[..., 2] = heads(unrolled.state_carry)[..., 0][:, chunk, ends_at]
    return per_token(unrolled.d), car, coeff.contiguous(), last, last_s, ends


def starts_every(chunks: int, start_bytes: int) -> int:
    """G, the stretch of chunks per stored start: 1 (every chunk's) while `chunks` starts of
    `start_bytes` each fit `STARTS_BUDGET`, else the fewest chunks a start that fit it."""
    fit = max(1, STARTS_BUDGET // max(start_bytes, 1))
    return 1 if chunks <= fit else -(-chunks // fit)


def _launch(module, rt, seq: Tokens, weights, chunk_size, precision, operands, store_every):
    """The kernel's outputs: o [BH, T, Dv], the final weights (A, B[, SA, SB]) [BH, ...], and
    the start states of every `store_every`-th chunk (None for 0)."""
    b, h, t, d_k = seq.phi_q.shape
    bh = b * h
    gamma = rt.scalar(rt.spec.window, rt.spec.window.weight_gate, seq.window_gates, slice(0, t))
    momentum = bool(module.MOMENTUM.value)
    # The state, updated in place: fresh copies (the kernel's outputs), [BH, out, in].
    state = [w.detach().reshape(bh, *w.shape[2:]).clone() for w in weights[: 4 if momentum else 2]]
    return run_kernel(
        module,
        seq.phi_q.reshape(bh, t, d_k).contiguous().to(operands),
        seq.phi_k.reshape(bh, t, d_k).contiguous().to(operands),
        seq.v.reshape(bh, t, seq.v.shape[-1]).contiguous(),
        _per_token(gamma, seq.v),
        mixing_inputs(rt, seq, chunk_size),
        state,
        chunk_size,
        precision,
        store_every,
    )


def run_kernel(module, q, k, v, gamma, mixing, state, chunk_size, precision, store_every):
    """One launch of `dual_forward` on prepared tensors: q, k [BH, T, Dk] (the operand dtype),
    v [BH, T, Dv] and gamma [BH, T] (the state's dtype), `mixing` as `mixing_inputs` gives it,
    `state` the [BH, ...] weights A, B (and SA, SB with momentum) that the kernel updates in
    place to the final state. Returns (o [BH, T, Dv], state, and the start states of chunks
    0, G, 2 G, ... for `store_every` = G, [BH, ceil(NC / G), ...] each, or None for 0).
    `miras.checks.gpu_compile` calls it on meta tensors to record the launch."""
    bh, t, d_k = q.shape
    d_v = v.shape[-1]
    wa, wb = state[:2]
    d_h = wa.shape[-2]
    dec, car, coeff, last, last_s, ends = mixing
    nc, bt = coeff.shape[1], coeff.shape[2]
    momentum = bool(module.MOMENTUM.value)
    sa, sb = state[2:] if momentum else (wa[:1, :1], wb[:1, :1])  # never read without momentum
    if store_every:
        ns = -(-nc // store_every)
        starts = [poisoned(bh, ns, d_h, d_k, like=v), poisoned(bh, ns, d_v, d_h, like=v)]
        starts += (
            [poisoned(bh, ns, d_h, d_k, like=v), poisoned(bh, ns, d_v, d_h, like=v)]
            if momentum
            else [v.new_zeros(1), v.new_zeros(1)]
        )
    else:
        starts = [v.new_zeros(1)] * 4
    scratch = torch.empty(bh, 3, bt, d_h, dtype=v.dtype, device=v.device)  # z1, a1, e1
    o = poisoned(bh, t, d_v, like=v)
    meta = _blocks(v, bt, d_k, d_h, d_v, precision) | dict(STORE_STARTS=bool(store_every))
    if bh > 0:
        module.dual_forward[(bh,)](
            q, k, v, gamma, dec, car, coeff, last, last_s, ends, wa, wb, sa, sb, *starts,
            scratch, o, t, min(chunk_size, t), nc, d_k, d_h, d_v, max(store_every, 1), **meta,
            num_warps=NUM_WARPS, num_stages=NUM_STAGES,
        )  # fmt: skip
    written = {"o": o}
    if store_every:
        written |= {"the chunk starts A": starts[0], "the chunk starts B": starts[1]}
    check_written(written)
    return o, state, (starts if store_every else None)


def backward(module, q, k, v, gamma, mixing, starts, every, grad_o, grad_final, chunk_size,
             precision):  # fmt: skip
    """`run_backward` over the whole sequence from the starts of every `every`-th chunk (G):
    for G = 1 one launch; else stretch by stretch of G chunks, last first, each stretch's
    forward run again from its stored start to store the starts inside it, and the state's
    gradient carried from one stretch to the one before. Returns what `run_backward` does."""
    if every == 1:
        return run_backward(
            module, q, k, v, gamma, mixing, starts, grad_o, grad_final, chunk_size, precision
        )
    t, chunks = q.shape[1], mixing[2].shape[1]
    carried = grad_final
    parts = []  # per stretch, last first: [dq, dk, dv, *the gate inputs' gradients]
    for first in reversed(range(0, chunks, every)):
        end = min(first + every, chunks)
        tokens = (first * chunk_size, min(end * chunk_size, t))
        inputs = [_cut(x, *tokens) for x in (q, k, v, gamma)]
        stretch = [_cut(x, *tokens) for x in mixing[:2]] + [_cut(x, first, end) for x in mixing[2:]]
        state = [x[:, first // every].clone() for x in starts[: len(grad_final)]]
        _, _, inner = run_kernel(module, *inputs, stretch, state, chunk_size, precision, 1)
        dq, dk, dv, carried, d_gates = run_backward(
            module, *inputs, stretch, inner, _cut(grad_o, *tokens), carried, chunk_size, precision
        )
        parts.append([dq, dk, dv, *d_gates])
    dq, dk, dv, *d_gates = (torch.cat(x[::-1], dim=1) for x in zip(*parts, strict=True))
    return dq, dk, dv, carried, tuple(d_gates)


def _cut(x: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """x[:, lo:hi] as a tensor of its own ([BH, ...] inputs by token or by chunk)."""
    return x[:, lo:hi].contiguous()


@dataclass(frozen=True)
class Info:
    """What a `DualKernel` call needs besides its tensors."""

    module: ModuleType
    rt: object  # miras.runtime.core.Runtime
    chunk_size: int
    precision: str
    operands: torch.dtype  # q's and k's dtype as the kernel's products' operands
    step_names: tuple[str, ...]
    window_names: tuple[str, ...]
    keys: tuple[str, ...]  # the state's entries: A, B (and S.A, S.B with momentum)
    past: int


def _rebuild(info: Info, tensors) -> tuple[Tokens, State]:
    """The call's `Tokens` and state from the Function's flat tensors."""
    q, k, v, valid, *rest = tensors
    n_step, n_window = len(info.step_names), len(info.window_names)
    step = dict(zip(info.step_names, rest[:n_step], strict=True))
    window = dict(zip(info.window_names, rest[n_step : n_step + n_window], strict=True))
    state = dict(zip(info.keys, rest[n_step + n_window :], strict=True))
    return Tokens(q, k, v, valid, step, window, info.past), state


def _blocks(v: torch.Tensor, bt: int, d_k: int, d_h: int, d_v: int, precision: str) -> dict:
    """Both kernels' block sizes, accumulator dtype and tl.dot precision."""
    acc = accumulator(v)
    return dict(
        BT=bt,
        BK=pow2(d_k),
        BV=pow2(d_v),
        HB=min(HIDDEN_BLOCK, pow2(d_h)),
        ACC=acc,
        DOT_PRECISION=dot_precision(precision, acc),
    )


def run_backward(module, q, k, v, gamma, mixing, starts, grad_o, grad_final, chunk_size, precision):
    """One launch of `dual_backward`: the forward's prepared tensors (as `run_kernel` takes
    them), the chunk starts it stored, grad_o [BH, T, Dv] and the final state's gradients
    [BH, ...] (A, B, SA, SB: float32, copied: the kernel turns them into the initial state's
    in place). Returns (dq, dk, dv, the initial state's gradients, the gate inputs' gradients:
    dgamma, then one per `mixing` tensor). `miras.checks.gpu_compile` calls it on meta tensors."""
    bh, t, d_k = q.shape
    d_v = v.shape[-1]
    d_h = starts[0].shape[-2]  # A's chunk starts [BH, NC, Dh, Dk]
    dec, car, coeff, last, last_s, ends = mixing
    nc, bt = coeff.shape[1], coeff.shape[2]
    momentum = bool(module.MOMENTUM.value)
    grads = [g.clone() for g in grad_final]  # dA, dB (dSA, dSB), updated in place
    dsa, dsb = grads[2:] if momentum else (grads[0][:1, :1], grads[1][:1, :1])
    scratch = torch.empty(bh, 7, bt, d_h, dtype=v.dtype, device=v.device)
    dq, dk = poisoned(bh, t, d_k, like=v), poisoned(bh, t, d_k, like=v)
    dv = poisoned(bh, t, d_v, like=v)
    per_token = [poisoned(bh, t, like=v) for _ in range(3)]  # dgamma, ddec, dcar
    dcoeff = poisoned(bh, nc, bt, bt, like=v)
    dlast, dlast_s = poisoned(bh, nc, bt, like=v), poisoned(bh, nc, bt, like=v)
    dends = poisoned(bh, nc, 4, like=v)
    meta = _blocks(v, bt, d_k, d_h, d_v, precision)
    if bh > 0:
        module.dual_backward[(bh,)](
            q, k, v, gamma, dec, car, coeff, last, last_s, ends, *starts, grad_o,
            grads[0], grads[1], dsa, dsb, scratch,
            dq, dk, dv, *per_token, dcoeff, dlast, dlast_s, dends,
            t, min(chunk_size, t), nc, d_k, d_h, d_v, **meta,
            num_warps=BACKWARD_WARPS, num_stages=BACKWARD_STAGES,
        )  # fmt: skip
    dgamma, ddec, dcar = per_token
    check_written(
        {"dq": dq, "dk": dk, "dv": dv, "dgamma": dgamma, "ddec": ddec, "dcar": dcar,
         "dcoeff": dcoeff, "dlast": dlast, "dlast_s": dlast_s, "dends": dends}
    )  # fmt: skip
    return dq, dk, dv, grads, (dgamma, ddec, dcar, dcoeff, dlast, dlast_s, dends)


class DualKernel(torch.autograd.Function):
    """(q, k, v, valid, *step gates, *window gates, *initial state) -> (o, *final state), in
    the runtime's [B, H, ...] layout. When a gradient is wanted the forward kernel stores the
    chunk starts (every G-th past `STARTS_BUDGET`); the backward kernel walks the chunks back
    from them, and torch carries its gate gradients back through the mixing matrices
    (`mixing_inputs` under autograd) to the step and window gates."""

    @staticmethod
    def forward(ctx, info: Info, *tensors):
        seq, state = _rebuild(info, tensors)
        weights = [state[k] for k in info.keys]
        every = 0  # no starts stored without a gradient
        if any(ctx.needs_input_grad[1:]):
            chunks = -(-seq.length // min(info.chunk_size, seq.length))
            start_bytes = 4 * sum(w.numel() for w in weights)  # float32, every (batch, head)
            every = starts_every(chunks, start_bytes)
        o, final, starts = _launch(
            info.module, info.rt, seq, weights, info.chunk_size, info.precision, info.operands,
            store_every=every,
        )  # fmt: skip
        ctx.info = info
        ctx.every = every
        ctx.n_inputs = len(tensors)
        if every:
            ctx.save_for_backward(*tensors, *starts)
        b, h, t = seq.phi_q.shape[:3]
        shaped = [w.reshape(state[k].shape) for w, k in zip(final, info.keys, strict=True)]
        return (o.reshape(b, h, t, o.shape[-1]), *shaped)

    @staticmethod
    def backward(ctx, grad_o, *grad_final):
        info: Info = ctx.info
        needs = ctx.needs_input_grad[1:]  # per tensor (not `info`)
        saved = ctx.saved_tensors
        tensors, starts = saved[: ctx.n_inputs], list(saved[ctx.n_inputs :])
        leaves = [x.detach().requires_grad_(n) for x, n in zip(tensors, needs, strict=True)]
        seq, state = _rebuild(info, leaves)
        rt = info.rt
        b, h, t = seq.phi_q.shape[:3]
        bh = b * h
        with torch.enable_grad():  # the gate inputs, as graphs back to the gates
            weight = rt.scalar(rt.spec.window, rt.spec.window.weight_gate, seq.window_gates,
                               slice(0, t))  # fmt: skip
            gamma = _per_token(weight, seq.v)
            mixing = mixing_inputs(rt, seq, info.chunk_size, graph=True)

        def flat(x: torch.Tensor) -> torch.Tensor:  # [B, H, ...] -> [BH, ...]
            return x.detach().reshape(bh, *x.shape[2:]).contiguous()

        finals = [
            torch.zeros_like(flat(state[key])) if g is None else flat(g).to(state[key].dtype)
            for key, g in zip(info.keys, grad_final, strict=True)
        ]
        g_o = torch.zeros_like(flat(seq.v)) if grad_o is None else flat(grad_o)
        dq, dk, dv, d_init, d_gates = backward(
            info.module, flat(seq.phi_q).to(info.operands), flat(seq.phi_k).to(info.operands),
            flat(seq.v), gamma.detach(), [m.detach() for m in mixing], starts, ctx.every, g_o,
            finals, min(info.chunk_size, t), info.precision,
        )  # fmt: skip
        # The gates' gradients: back through gamma and the mixing matrices by autograd.
        gate_leaves = leaves[4 : 4 + len(info.step_names) + len(info.window_names)]
        wanted = [x for x in gate_leaves if x.requires_grad]
        pairs = [(y, g) for y, g in zip((gamma, *mixing), d_gates, strict=True) if y.requires_grad]
        found = iter(
            torch.autograd.grad(
                [y for y, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True
            )
            if pairs and wanted
            else [None] * len(wanted)
        )
        shaped = lambda g, like: g.reshape(like.shape).to(like.dtype)  # noqa: E731
        direct = [shaped(dq, seq.phi_q), shaped(dk, seq.phi_k), shaped(dv, seq.v), None]
        direct += [next(found) if x.requires_grad else None for x in gate_leaves]
        direct += [shaped(g, state[key]) for g, key in zip(d_init, info.keys, strict=True)]
        return (None, *(g if n else None for g, n in zip(direct, needs, strict=True)))


def forward(
    program: Program,
    seq: Tokens,
    state: State,
    chunk_size: int,
    precision: str = DEFAULT_TRITON_PRECISION,
    operand_dtype: torch.dtype | None = None,
):
    """Returns o [B, H, T, Dv] and the final memory state, as `dual.forward` does."""
    check_available(seq.phi_q)
    rt = program.runtime
    module = program.kernels.module()
    names = tuple(rt.param_names)  # input side first: A [Dh, Dk], then B [Dv, Dh]
    keys = names + (tuple(f"S.{n}" for n in names) if rt.has_momentum else ())
    # On a GPU the products take bf16 or fp16 q and k as operands, as the matrix kernels do.
    operands = operands_dtype(seq.phi_q.dtype, operand_dtype)
    info = Info(
        module=module,
        rt=rt,
        chunk_size=chunk_size,
        precision=precision,
        operands=operands,
        step_names=tuple(seq.step_gates),
        window_names=tuple(seq.window_gates),
        keys=keys,
        past=seq.past,
    )
    tensors = [
        seq.phi_q, seq.phi_k, seq.v, seq.valid, *seq.step_gates.values(),
        *seq.window_gates.values(), *(state[k] for k in keys),
    ]  # fmt: skip
    o, *final = DualKernel.apply(info, *tensors)
    out = dict(state)
    out.update(zip(keys, final, strict=True))
    return o, out
