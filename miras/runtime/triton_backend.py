"""The Triton backend: a spec's emitted chunk kernels behind a `torch.autograd.Function`.

    o, final = forward(program, seq, state, chunk_size)

Same semantics as the chunk backend (every inner gradient at the chunk-start state; the
optimizer and the retention map at every token), computed by the kernels that
`miras.compiler.triton` emits for the spec: `linear_*` (retention none or l2 with a per-head
decay, gd: masked matmuls per chunk) or `general_*` (anything else in the matrix family: the
step token by token). The feature map is applied before (in torch), so its parameters get
their gradients from autograd; the kernels see phi(q) and phi(k).

Every output buffer is filled with NaN before a launch; with MIRAS_TRITON_CHECK=1 each one is
checked afterwards to hold no NaN, so an element a kernel failed to write is an error.
On a machine without a GPU, set TRITON_INTERPRET=1 before triton is imported.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING

import torch

from miras.kernels.templates.choice import linear_applies
from miras.runtime.core import State, Tokens
from miras.runtime.inputs import DEFAULT_TRITON_PRECISION
from miras.runtime.triton_launch import (
    CHECK_ENV,
    CONFIG_ENV,
    HALF,
    accumulator,
    check_available,
    check_written,
    dot_precision,
    launcher,
    operands_dtype,
    poisoned,
    pow2,
    runs_on_cpu,
)

if TYPE_CHECKING:
    from miras.runtime.program import Program

# The linear kernel splits the value channels (rows of W) into blocks of at most this many,
# one program each, when the bias is elementwise (rows then evolve independently): a smaller
# state tile per program, and more programs. Tests lower it to exercise the split.
LINEAR_BLOCK_V = 64
# On tensor cores (tf32, tf32x3, half inputs) from Dphi = 64 on, at most this many
# (`choose_kernels`).
TF32_LINEAR_BLOCK_V = 32
# The linear state kernel holds W as [BV, 64] key tiles, at most four (Dphi <= 256), as fla's
# state kernel does; wider features run on the general kernels (which refuse them on a GPU).
LINEAR_KEY_TILE = 64
LINEAR_KEY_TILES = 4

# The general kernels split the value channels into blocks of GENERAL_BLOCK_V when the rows of
# W evolve apart (`choose_kernels`), as the linear kernels do: a [32, Dphi] state tile per
# program, and B x H x blocks programs.
GENERAL_BLOCK_V = 32
# Otherwise a program keeps the whole state tile W [Dv, Dphi], staged through shared memory
# for the block phase's products: compiled for sm_90, general_forward takes 96 KiB at 128 x 128
# and 320 KiB at 256 x 256, past the 227 KiB a block may use on an H100 (163 KiB on an A100).
# Larger tiles are refused before any launch.
GENERAL_MAX_TILE = 128 * 128


def general_refusal(d_k: int, block_v: int) -> str | None:
    """Why the general kernels cannot run on a GPU with a state tile [block_v, d_k] a program
    (`choose_kernels`' block), or None."""
    if pow2(d_k) * pow2(block_v) <= GENERAL_MAX_TILE:
        return None
    return (
        f"the general kernels hold a state tile [Dv, Dphi] = [{block_v}, {d_k}] in one "
        f"program, which above {GENERAL_MAX_TILE} entries (128 x 128) needs more shared memory "
        "than a GPU block has (320 KiB at 256 x 256; 227 KiB on sm_90, 163 KiB on sm_80)"
    )


@dataclass
class Launch:
    """One call's kernels, sizes and gate layout; the Function's forward and backward use it."""

    module: ModuleType
    linear: bool
    gate_names: tuple[str, ...]  # kernel order
    gate_widths: tuple[int, ...]  # 1 (per head) or Dv, per gate
    batch: int
    heads: int
    length: int
    past: int
    d_k: int
    d_v: int
    chunk_size: int
    block_v: int  # BV: value channels per program
    window_gates: tuple[str, ...]  # those read at the window's rows (PAST + T)
    precision: str = DEFAULT_TRITON_PRECISION  # tl.dot's input precision on float32 tiles (inputs.TRITON_PRECISIONS)

    @property
    def n_value_blocks(self) -> int:
        return -(-self.d_v // self.block_v)

    @property
    def n_chunks(self) -> int:
        return -(-self.length // self.chunk_size)

    @property
    def bh(self) -> int:
        return self.batch * self.heads

    @property
    def window(self) -> int:
        return self.past + 1

    @property
    def state_meta(self) -> dict:
        """The linear state kernel's own constexpr: KT, the width of its key tiles (64, or
        the whole feature block below 64; at most LINEAR_KEY_TILES of them)."""
        return dict(KT=min(pow2(self.d_k), LINEAR_KEY_TILE))

    @property
    def output_grid(self) -> tuple[int, int, int]:
        """The linear output kernel's grid: every chunk, head and value block at once."""
        return (self.n_chunks, self.bh, self.n_value_blocks)

    def meta(self, acc) -> dict:
        return dict(
            BT=pow2(self.chunk_size),
            BK=pow2(self.d_k),
            BV=self.block_v,
            ACC=acc,
            DOT_PRECISION=dot_precision(self.precision, acc),
            # num_warps and num_stages: the kernels' autotune configs (kernels/common/tuning.py)
        )

    def sizes(self) -> tuple[int, ...]:
        return (self.length, self.chunk_size, self.n_chunks, self.d_k, self.d_v)

    def gate_args(self, gates: tuple[torch.Tensor, ...]) -> list:
        """Each gate as (pointer, row stride, channel stride): a per-head gate is read as if
        per channel, with channel stride 0."""
        args = []
        for g, width in zip(gates, self.gate_widths, strict=True):
            args += [g, width, 0 if width == 1 else 1]
        return args


def _forward(launch: Launch, q, k, v, valid, w0, s0, gates):
    bh, nc, dv, dk = launch.bh, launch.n_chunks, launch.d_v, launch.d_k
    o = poisoned(bh, launch.length, dv, like=v)
    w_out = poisoned(bh, dv, dk, like=v)
    w_chunks = poisoned(bh, nc, dv, dk, like=v)
    meta = launch.meta(accumulator(v))
    grid = (bh, launch.n_value_blocks)
    if launch.linear:
        # fla's split: the state recurrence alone in a sequential kernel over (BH, blocks),
        # then every chunk's outputs at once, from the stored states and error signals.
        ghat = poisoned(bh, launch.window, launch.length, dv, like=v)
        gate_args = launch.gate_args(gates)
        launcher(launch.module.linear_state, grid)(
            k, v, valid, w0, *gate_args, ghat, w_out, w_chunks, *launch.sizes(), **meta,
            **launch.state_meta,
        )  # fmt: skip
        launcher(launch.module.linear_output, launch.output_grid)(
            q, k, w_chunks, ghat, *gate_args, o, *launch.sizes(), **meta,
        )  # fmt: skip
        s_out = torch.zeros_like(w_out)
        s_chunks = torch.zeros(1, dtype=v.dtype, device=v.device)
        check_written(
            {"o": o, "the final state": w_out, "the chunk states": w_chunks, "ghat": ghat}
        )
        return o, w_out, s_out, w_chunks, s_chunks
    momentum = launch.module.MOMENTUM.value
    if momentum:
        s_out = poisoned(bh, dv, dk, like=v)
        s_chunks = poisoned(bh, nc, dv, dk, like=v)
    else:  # never read or written by the kernels
        s_out = torch.zeros_like(w_out)
        s_chunks = torch.zeros(1, dtype=v.dtype, device=v.device)
    programs = bh * launch.n_value_blocks  # one scratch block each
    g_scratch = torch.empty(
        programs, launch.past + 1, meta["BT"], meta["BV"], dtype=v.dtype, device=v.device
    )
    launcher(launch.module.general_forward, grid)(
        q, k, v, valid, w0, s0, *launch.gate_args(gates), o, w_out, s_out, w_chunks, s_chunks,
        g_scratch, *launch.sizes(), **meta,
    )  # fmt: skip
    written = {"o": o, "the final state": w_out, "the chunk states": w_chunks}
    if momentum:
        written |= {"the final momentum": s_out, "the chunk momenta": s_chunks}
    check_written(written)
    return o, w_out, s_out, w_chunks, s_chunks


def _backward(launch: Launch, saved, do, dw_out, ds_out):
    q, k, v, valid, w_chunks, s_chunks, *gates = saved
    if launch.linear:
        return _linear_backward(launch, q, k, v, valid, w_chunks, gates, do, dw_out)
    bh, dv, dk = launch.bh, launch.d_v, launch.d_k
    rows_window = launch.past + launch.length
    parts = launch.n_value_blocks  # dq and dk: one part per block of value channels
    dq = poisoned(parts, bh, launch.length, dk, like=v)
    dk_ = poisoned(parts, bh, rows_window, dk, like=v)
    dv_ = poisoned(bh, rows_window, dv, like=v)
    dw0 = poisoned(bh, dv, dk, like=v)
    window = set(launch.window_gates)
    gate_grads = [
        poisoned(bh, rows_window if name in window else launch.length, dv, like=v)
        for name in launch.gate_names
    ]
    meta = launch.meta(accumulator(v))
    momentum = launch.module.MOMENTUM.value
    ds0 = poisoned(bh, dv, dk, like=v) if momentum else torch.zeros_like(dw0)
    bt, bv, bk = meta["BT"], meta["BV"], meta["BK"]
    scratch = dict(dtype=v.dtype, device=v.device)
    programs = bh * parts  # one scratch block each
    g_scratch = torch.empty(programs, launch.past + 1, bt, bv, **scratch)
    dg_scratch = torch.empty(programs, launch.past + 1, bt, bv, **scratch)
    w_scratch = torch.empty(programs, bt, bv, bk, **scratch)
    s_scratch = torch.empty(programs, bt, bv, bk, **scratch) if momentum else w_scratch[:1, :1]
    launcher(launch.module.general_backward, (bh, parts))(
        q, k, v, valid, w_chunks, s_chunks, do, dw_out, ds_out,
        *launch.gate_args(tuple(gates)), *gate_grads, dq, dk_, dv_, dw0, ds0,
        g_scratch, dg_scratch, w_scratch, s_scratch, *launch.sizes(), **meta,
    )  # fmt: skip
    written = {"dq": dq, "dk": dk_, "dv": dv_, "d initial state": dw0, "d initial momentum": ds0}
    written |= {f"d {n}": g for n, g in zip(launch.gate_names, gate_grads, strict=True)}
    check_written(written)
    return dq.sum(0), dk_.sum(0), dv_, dw0, ds0, _gate_widths(launch, gate_grads)


def _linear_backward(launch: Launch, q, k, v, valid, w_chunks, gates, do, dw_out):
    """fla's split of the backward: `linear_state_backward` carries dW through the chunks in
    reverse (grid (BH, value blocks)) and stores it at every chunk's end; then every chunk at
    once, `linear_scores` computes Q X_j^T (grid (chunks, BH)), `linear_backward` the value
    side (dv, the gates' gradients; grid (chunks, BH, value blocks)) and `linear_backward_keys`
    dq and dk from what it stores (grid (chunks, BH, key tiles)). A window row's gradients come
    back as one part per window offset j, at the token t that read row t + PAST - j; they are
    added here."""
    bh, nc, dv, dk, t = launch.bh, launch.n_chunks, launch.d_v, launch.d_k, launch.length
    window, parts = launch.window, launch.n_value_blocks
    meta = launch.meta(accumulator(v))
    gate_args = launch.gate_args(tuple(gates))
    curved = launch.module.CURVED.value
    decayed = launch.module.DECAY.value
    dy_scratch = poisoned(bh, window, t, dv, like=v) if curved else v.new_zeros(1)
    dw_chunks = poisoned(bh, nc, dv, dk, like=v)
    dw0 = poisoned(bh, dv, dk, like=v)
    launcher(launch.module.linear_state_backward, (bh, parts))(
        q, k, v, valid, w_chunks, do, dw_out, *gate_args, dy_scratch, dw_chunks, dw0,
        *launch.sizes(), **meta, **launch.state_meta,
    )  # fmt: skip
    dv_parts = poisoned(window, bh, t, dv, like=v)
    window_gates = set(launch.window_gates)
    gate_grads = [
        poisoned(window, bh, t, dv, like=v) if name in window_gates else poisoned(bh, t, dv, like=v)
        for name in launch.gate_names
    ]
    # Q X_j^T of every chunk, once for all value blocks ([BT, BT] a chunk, float32).
    bt = meta["BT"]
    qx_rows = poisoned(window, bh, nc, bt, bt, like=v)
    scores_meta = {name: meta[name] for name in ("BT", "BK", "ACC", "DOT_PRECISION")}
    launcher(launch.module.linear_scores, (nc, bh))(
        q, k, qx_rows, t, launch.chunk_size, nc, dk, **scores_meta, **launch.state_meta
    )
    # The key side's inputs: D, dQX_j per value block ([BT, BT] a chunk, float32: summed over
    # the blocks before it is an operand), -k_last Ghat_j and dY_j as operands (q's dtype).
    decays = poisoned(bh, t, like=v) if decayed else v.new_zeros(1)
    dqx_parts = poisoned(parts, window, bh, nc, bt, bt, like=v)
    gk_rows = poisoned(window, bh, t, dv, like=q)
    dy_rows = poisoned(window, bh, t, dv, like=q) if curved else q.new_zeros(1)
    launcher(launch.module.linear_backward, launch.output_grid)(
        q, k, v, valid, w_chunks, dw_chunks, do, qx_rows, *gate_args, *gate_grads, dv_parts,
        decays, dqx_parts, gk_rows, dy_rows, *launch.sizes(), **meta, **launch.state_meta,
    )  # fmt: skip
    dq = poisoned(bh, t, dk, like=v)
    dk_parts = poisoned(window, bh, t, dk, like=v)
    key_tiles = -(-dk // launch.state_meta["KT"])
    keys_meta = {name: meta[name] for name in ("BT", "BV", "ACC", "DOT_PRECISION")}
    launcher(launch.module.linear_backward_keys, (nc, bh, key_tiles))(
        q, k, w_chunks, dw_chunks, do, decays, dqx_parts, gk_rows, dy_rows, dq, dk_parts,
        *launch.sizes(), parts, **keys_meta, **launch.state_meta,
    )  # fmt: skip
    written = {"dq": dq, "dk": dk_parts, "dv": dv_parts, "d initial state": dw0}
    written |= {"the chunk ends' dW": dw_chunks, "QX": qx_rows, "dQX": dqx_parts}
    written["-k_last Ghat"] = gk_rows
    if decayed:
        written["the decay D"] = decays
    if curved:
        written["dY"] = dy_rows
    written |= {f"d {n}": g for n, g in zip(launch.gate_names, gate_grads, strict=True)}
    check_written(written)
    gate_grads = [
        _window_rows(launch, g) if name in window_gates else g
        for name, g in zip(launch.gate_names, gate_grads, strict=True)
    ]
    ds0 = torch.zeros_like(dw0)
    return (
        dq,
        _window_rows(launch, dk_parts),
        _window_rows(launch, dv_parts),
        dw0,
        ds0,
        _gate_widths(launch, gate_grads),
    )


def _window_rows(launch: Launch, parts: torch.Tensor) -> torch.Tensor:
    """[WINDOW, BH, T, C] parts (part j at the token t that read row t + PAST - j) -> the
    gradient of the window's rows [BH, PAST + T, C]."""
    if launch.past == 0:
        return parts[0]
    window, bh, t, c = parts.shape
    out = parts.new_zeros(bh, launch.past + t, c)
    for j in range(window):
        out[:, launch.past - j : launch.past - j + t] += parts[j]
    return out


def _gate_widths(launch: Launch, gate_grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per-channel gate gradients -> each gate's own width (a per-head gate: their sum)."""
    return [
        g.sum(-1, keepdim=True) if width == 1 else g
        for g, width in zip(gate_grads, launch.gate_widths, strict=True)
    ]


class ChunkKernels(torch.autograd.Function):
    """(q, k, v, valid, w0, s0, *gates) -> (o, final W, final S), all [BH, ...] contiguous."""

    @staticmethod
    def forward(ctx, launch: Launch, q, k, v, valid, w0, s0, *gates):
        o, w_out, s_out, w_chunks, s_chunks = _forward(launch, q, k, v, valid, w0, s0, gates)
        ctx.launch = launch
        ctx.save_for_backward(q, k, v, valid, w_chunks, s_chunks, *gates)
        return o, w_out, s_out

    @staticmethod
    def backward(ctx, do, dw_out, ds_out):
        launch: Launch = ctx.launch

        def dense(x, shape, like):
            return (
                torch.zeros(shape, dtype=like.dtype, device=like.device)
                if x is None
                else x.contiguous()
            )

        v = ctx.saved_tensors[2]  # the state's dtype (q and k may be half-precision operands)
        do = dense(do, (launch.bh, launch.length, launch.d_v), v)
        dw_out = dense(dw_out, (launch.bh, launch.d_v, launch.d_k), v)
        ds_out = dense(ds_out, (launch.bh, launch.d_v, launch.d_k), v)
        dq, dk, dv, dw0, ds0, gate_grads = _backward(launch, ctx.saved_tensors, do, dw_out, ds_out)
        return None, dq, dk, dv, None, dw0, ds0, *gate_grads


def choose_kernels(
    compiled,
    d_v: int,
    d_k: int,
    per_channel_decay: bool,
    precision: str = DEFAULT_TRITON_PRECISION,
) -> tuple[bool, int]:
    """(linear, BV): whether a call runs the linear kernels, and the value channels per
    program, for a compiled rule (anything with the IR's `spec`, `plan` and `bias`: a
    `CompiledRule`, a runtime `Program`) at value width d_v and feature width d_k under tl.dot's
    input `precision`. `miras.checks.gpu_compile` asks the same question to compile what a
    launch would run."""
    # A bias with channel sums keeps every value channel in one program; above 64 channels the
    # general kernels take it (the one-kernel linear backward needed 272 KB of shared memory at
    # Dv = Dphi = 128, past the 227 KB of an H100; the split kernels spill 0.8 to 1.7 KB
    # already at 64 channels a program).
    whole_rows = not compiled.bias.elementwise
    linear = (
        linear_applies(compiled)
        and not per_channel_decay
        and not (whole_rows and pow2(d_v) > LINEAR_BLOCK_V)
        and pow2(d_k) <= LINEAR_KEY_TILE * LINEAR_KEY_TILES
    )
    if not linear:
        # The general kernels' rows of W evolve apart when the bias is elementwise and every
        # read sees one row alone (not l_q's norm over the whole matrix; KL's softmax is per
        # row): then a program owns GENERAL_BLOCK_V of them.
        apart = not whole_rows and compiled.spec.retention.read_norm() is None
        return False, min(pow2(d_v), GENERAL_BLOCK_V) if apart else pow2(d_v)
    split = not whole_rows
    block = LINEAR_BLOCK_V
    if precision != "ieee" and pow2(d_k) >= 64:
        # Tensor-core tiles: compiled for sm_80 (retnet, chunk 64), 64 value channels a program
        # spill 28 to 40 B in the linear backward's value-side kernel at Dphi = 64, and 32
        # spill nothing (docs/kernels.md, "The GPU profile"); at Dphi = 128, 64 spilled 816 to
        # 1680 B on sm_90 in the backward before its split, and needed 272 KB of shared memory
        # before that.
        block = min(block, TF32_LINEAR_BLOCK_V)
    return linear, min(pow2(d_v), block) if split else pow2(d_v)


def forward(
    program: Program,
    seq: Tokens,
    state: State,
    chunk_size: int,
    precision: str = DEFAULT_TRITON_PRECISION,
    operand_dtype: torch.dtype | None = None,
):
    """Returns o [B, H, T, Dv] and the final memory state (W, and S.W with momentum).
    `precision`: tl.dot's input precision on float32 tiles, checked by the caller
    (`inputs.check_triton_precision`); `operand_dtype`: the caller's input dtype (None: the
    state's). The kernels come from `program.kernels`, emitted and
    loaded on its first use."""
    spec = program.spec
    if not spec.memory.linear:  # a deep memory: the dual form's kernel (dual_triton.py)
        from miras.runtime import dual_triton

        return dual_triton.forward(program, seq, state, chunk_size, precision, operand_dtype)
    check_available(seq.phi_q)
    module = program.kernels.module()
    plan = program.kernels.gate_plan()
    b, h, t, d_k = seq.phi_q.shape
    d_v = seq.v.shape[-1]
    rows = seq.past + t

    def flat(x: torch.Tensor, n_rows: int) -> torch.Tensor:
        return x.reshape(b * h, n_rows, x.shape[-1]).contiguous()

    gates = [
        flat(seq.window_gates[n], rows) if n in plan.window else flat(seq.step_gates[n], t)
        for n in plan.order
    ]
    widths = tuple(g.shape[-1] for g in gates)
    decay = spec.retention.decay_gate  # the retention's own gate name (None: no decay)
    per_channel_decay = decay in plan.step and widths[plan.order.index(decay)] != 1
    linear, block_v = choose_kernels(program, d_v, d_k, per_channel_decay, precision)
    refusal = None if linear else general_refusal(d_k, block_v)
    if refusal is not None:
        raise ValueError(
            f"backend: 'triton' cannot run spec '{spec.name}' at Dv = {d_v}, Dphi = {d_k}: "
            f"{refusal}; use backend='chunk' (parallel) or 'recurrent' (the exact reference)"
        )
    launch = Launch(
        module=module,
        linear=linear,
        gate_names=plan.order,
        gate_widths=widths,
        batch=b,
        heads=h,
        length=t,
        past=seq.past,
        d_k=d_k,
        d_v=d_v,
        chunk_size=chunk_size,
        block_v=block_v,
        window_gates=plan.window,
        precision=precision,
    )
    w0 = state["W"].reshape(b * h, d_v, d_k).contiguous()
    s0 = (
        state["S.W"].reshape(b * h, d_v, d_k).contiguous()
        if "S.W" in state
        else torch.zeros_like(w0)
    )
    # On a GPU the linear kernels multiply in the inputs' own dtype, as fla's kernels do:
    # bf16 or fp16 q and k are their products' operands, forward and backward (the state, its
    # gradient and the error signals cast to it for each product; accumulated in float32,
    # every other buffer the state's float32). Triton's
    # interpreter multiplies half-precision tiles wrongly (as integers), so there, and on the
    # general kernels, q and k stay float32 (`operands_dtype`).
    operands = operands_dtype(seq.phi_q.dtype, operand_dtype) if linear else seq.phi_q.dtype
    o, w_out, s_out = ChunkKernels.apply(
        launch,
        flat(seq.phi_q, t).to(operands),
        flat(seq.phi_k, rows).to(operands),
        flat(seq.v, rows),
        seq.valid.reshape(b * h, rows).contiguous(),
        w0,
        s0,
        *gates,
    )
    final = {"W": w_out.reshape(b, h, d_v, d_k)}
    if "S.W" in state:
        final["S.W"] = s_out.reshape(b, h, d_v, d_k)
    return o.reshape(b, h, t, d_v), final


__all__ = [
    "CHECK_ENV",
    "CONFIG_ENV",
    "HALF",
    "ChunkKernels",
    "Launch",
    "check_available",
    "choose_kernels",
    "dot_precision",
    "forward",
    "general_refusal",
    "launcher",
    "runs_on_cpu",
]
