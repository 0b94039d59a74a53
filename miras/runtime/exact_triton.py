"""The exact chunk form on the Triton backend: exact_chunk's preparation (torch), the scan over
chunks as Triton kernels (`miras.kernels.templates.exact`), exact_chunk's reads (torch).

    r, w_starts, s_starts, w, s = scan(base, keys, lw, d, w0, f=..., g=..., ls=..., ...)

The scan is the one sequential part of the exact form (docs/chunking.md, "The exact form";
docs/kernels.md derives its backward); the preparation and the reads are batched over all
chunks and stay in torch, so autograd flows through them and through `ExactScan`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from miras.ir import ChunkForm
from miras.runtime import exact_chunk
from miras.runtime.core import Runtime, State, Tokens
from miras.runtime.triton_launch import (
    accumulator,
    check_available,
    check_written,
    dot_precision,
    launcher,
    poisoned,
    pow2,
)

# Value channels per program. Per head the state tile is [BV, BK]; per channel each program
# also holds its channels' systems, [BV, BR, BR], so fewer channels per program.
BLOCK_V = 64
BLOCK_V_PER_CHANNEL = 16

# ExactScan's tensor inputs, in order; the gates among them (width 1 per head, or Dv).
INPUTS = ("base", "f", "g", "keys", "lw", "ls", "d", "ce", "te", "w0", "s0")
GATES = ("lw", "ls", "d", "ce", "te")


@dataclass(frozen=True)
class ScanLaunch:
    """Sizes and layout of one scan; the Function's forward and backward use it."""

    bh: int
    chunks: int
    rows: int  # R = n * c window rows per chunk
    d_k: int
    d_v: int
    has_f: bool
    momentum: bool
    per_channel: bool  # F, G: [Dv, R, R] systems per chunk
    widths: tuple[int, ...]  # GATES': 1 (per head) or Dv
    precision: str = "ieee"  # tl.dot's input precision on float32 tiles (inputs.TRITON_PRECISIONS)

    @property
    def block_v(self) -> int:
        return min(pow2(self.d_v), BLOCK_V_PER_CHANNEL if self.per_channel else BLOCK_V)

    @property
    def value_blocks(self) -> int:
        return -(-self.d_v // self.block_v)

    def gate_strides(self) -> list[int]:
        """(width, channel stride) per gate: a per-head gate is read with channel stride 0."""
        out = []
        for width in self.widths:
            out += [width, 0 if width == 1 else 1]
        return out

    def meta(self, like: torch.Tensor) -> dict:
        acc = accumulator(like)
        return dict(
            HAS_F=self.has_f,
            MOMENTUM=self.momentum,
            PER_CHANNEL=self.per_channel,
            BR=pow2(self.rows),
            BK=pow2(self.d_k),
            BV=self.block_v,
            ACC=acc,
            DOT_PRECISION=dot_precision(self.precision, acc),
            # num_warps and num_stages: the kernels' autotune configs (kernels/common/tuning.py)
        )


class ExactScan(torch.autograd.Function):
    """(base, f, g, keys, lw, ls, d, ce, te, w0, s0), all [BH, N, ...] contiguous (absent ones
    a placeholder) -> r [BH, N, R, Dv], W at each chunk start [BH, N, Dv, Dphi], the final W,
    and with momentum S at each chunk start and the final S."""

    @staticmethod
    def forward(ctx, launch: ScanLaunch, base, f, g, keys, lw, ls, d, ce, te, w0, s0):
        from miras.kernels.templates.exact import exact_scan_forward

        bh, nc, rows, dk, dv = launch.bh, launch.chunks, launch.rows, launch.d_k, launch.d_v
        r = poisoned(bh, nc, rows, dv, like=base)
        w_starts = poisoned(bh, nc, dv, dk, like=base)
        w_out = poisoned(bh, dv, dk, like=base)
        if launch.momentum:
            s_starts = poisoned(bh, nc, dv, dk, like=base)
            s_out = poisoned(bh, dv, dk, like=base)
        else:  # never written
            s_starts = s_out = base.new_zeros(1)
        launcher(exact_scan_forward, (bh, launch.value_blocks))(
            base, f, g, keys, lw, ls, d, ce, te, w0, s0,
            r, w_starts, s_starts, w_out, s_out,
            *launch.gate_strides(), nc, rows, dk, dv, **launch.meta(base),
        )  # fmt: skip
        written = {"the signals": r, "the chunk states": w_starts, "the final state": w_out}
        if launch.momentum:
            written |= {"the chunk momenta": s_starts, "the final momentum": s_out}
        check_written(written)
        ctx.launch = launch
        ctx.save_for_backward(f, g, keys, lw, ls, d, ce, te, r, w_starts, s_starts)
        if launch.momentum:
            return r, w_starts, w_out, s_starts, s_out
        return r, w_starts, w_out

    @staticmethod
    def backward(ctx, dr, dw_starts, dw_out, ds_starts=None, ds_out=None):
        from miras.kernels.templates.exact import exact_scan_backward

        launch: ScanLaunch = ctx.launch
        f, g, keys, lw, ls, d, ce, te, r, w_starts, s_starts = ctx.saved_tensors
        bh, nc, rows, dk, dv = launch.bh, launch.chunks, launch.rows, launch.d_k, launch.d_v

        def dense(grad, like):
            return torch.zeros_like(like) if grad is None else grad.contiguous()

        dr, dw_starts, dw_out = (
            dense(dr, r),
            dense(dw_starts, w_starts),
            dense(dw_out, w_starts[:, 0]),
        )
        if launch.momentum:
            ds_starts, ds_out = dense(ds_starts, s_starts), dense(ds_out, s_starts[:, 0])
        else:
            ds_starts = ds_out = s_starts
        parts = launch.value_blocks
        d_base = poisoned(bh, nc, rows, dv, like=r)
        d_keys = poisoned(parts, bh, nc, rows, dk, like=r)
        d_lw = poisoned(bh, nc, rows, dv, like=r)
        d_d = poisoned(bh, nc, dv, like=r)
        dw0 = poisoned(bh, dv, dk, like=r)
        written = {"d base": d_base, "d keys": d_keys, "d lw": d_lw, "d d": d_d, "d w0": dw0}
        unused = r.new_zeros(1)
        d_f = d_g = d_ls = d_ce = d_te = ds0 = unused
        if launch.has_f:
            d_f = (
                poisoned(bh, nc, dv, rows, rows, like=r)
                if launch.per_channel
                else (poisoned(parts, bh, nc, rows, dk, like=r))
            )
            written["d f"] = d_f
        if launch.momentum:
            d_ls, d_ce, d_te = (poisoned(*x.shape, like=r) for x in (d_lw, d_d, d_d))
            ds0 = poisoned(bh, dv, dk, like=r)
            written |= {"d ls": d_ls, "d ce": d_ce, "d te": d_te, "d s0": ds0}
            if launch.has_f:
                d_g = poisoned(*d_f.shape, like=r)
                written["d g"] = d_g
        launcher(exact_scan_backward, (bh, parts))(
            f, g, keys, lw, ls, d, ce, te, r, w_starts, s_starts,
            dr, dw_starts, ds_starts, dw_out, ds_out,
            d_base, d_f, d_g, d_keys, d_lw, d_ls, d_d, d_ce, d_te, dw0, ds0,
            *launch.gate_strides(), bh, nc, rows, dk, dv, **launch.meta(r),
        )  # fmt: skip
        check_written(written)

        widths = dict(zip(GATES, launch.widths, strict=True))

        def gate(name, grad):  # written per channel -> the gate's own width
            return grad.sum(-1, keepdim=True) if widths[name] == 1 else grad

        grads = dict(base=d_base, keys=d_keys.sum(0), lw=gate("lw", d_lw), d=gate("d", d_d), w0=dw0)
        if launch.has_f:
            grads["f"] = d_f if launch.per_channel else d_f.sum(0)
        if launch.momentum:
            grads |= dict(ls=gate("ls", d_ls), ce=gate("ce", d_ce), te=gate("te", d_te), s0=ds0)
            if launch.has_f:
                grads["g"] = d_g if launch.per_channel else d_g.sum(0)
        return None, *(grads.get(name) for name in INPUTS)


def scan(
    base, keys, from_w, from_s, last_w, last_s, d_end, carry_end, theta_end, w0, s0,
    precision="ieee",
):  # fmt: skip
    """`exact_chunk.scan_chunks` on the Triton kernels: the same arguments and results, and
    `precision`, tl.dot's input precision on float32 tiles. Per batch and head (R = n*c rows,
    X = 1 or Dv):

        r_i     = base_i + F_i W_i^T - G_i S_i^T
        W_{i+1} = d_i * W_i - (r_i * lw_i)^T K_i - ce_i * S_i
        S_{i+1} = te_i * S_i + (r_i * ls_i)^T K_i

    base [B, H, N, R, Dv]; keys [B, H, N, R, Dphi]; last_w, last_s (lw, ls) [B, H, N, R, X];
    d_end, carry_end, theta_end (d, ce, te) [B, H, N, X]; w0, s0 [B, H, Dv, Dphi]; from_w,
    from_s (F, G) [B, H, N, R, Dphi] or, per channel, [B, H, N, Dv, R, R] (r[a, v] +=
    sum_b F[v, a, b] (K W^T)[b, v]). from_w None: a zero slope; s0 None: no momentum (from_s,
    last_s, carry_end, theta_end None too). Returns r [B, H, N, R, Dv], W at each chunk start
    [B, H, N, Dv, Dphi], S at each chunk start (or None), the final W and S (or None)."""
    b, h, chunks, rows, d_v = base.shape
    d_k = keys.shape[-1]
    momentum = s0 is not None
    has_f = from_w is not None
    per_channel = has_f and from_w.dim() == 6
    placeholder = base.new_zeros(1)

    def flat(x):
        if x is None:
            return placeholder
        return x.expand(b, h, *x.shape[2:]).reshape(b * h, *x.shape[2:]).contiguous()

    gates = (last_w, last_s, d_end, carry_end, theta_end)
    widths = tuple(1 if x is None else x.shape[-1] for x in gates)
    launch = ScanLaunch(
        b * h, chunks, rows, d_k, d_v, has_f, momentum, per_channel, widths, precision
    )
    inputs = (base, from_w, from_s, keys, last_w, last_s, d_end, carry_end, theta_end, w0, s0)
    out = ExactScan.apply(launch, *(flat(x) for x in inputs))
    r = out[0].reshape(b, h, chunks, rows, d_v)
    starts_w = out[1].reshape(b, h, chunks, d_v, d_k)
    w = out[2].reshape(b, h, d_v, d_k)
    if not momentum:
        return r, starts_w, None, w, None
    return r, starts_w, out[3].reshape(b, h, chunks, d_v, d_k), w, out[4].reshape(b, h, d_v, d_k)


def applies(form: ChunkForm, chunk_size: int) -> bool:
    """Whether the exact form needs its own scan here. At chunk size 1, and for a zero slope
    (the dot bias: the signals do not read the state), the exact and chunk-start forms are one
    model, and the emitted chunk kernels (`triton_backend`) compute it in one pass."""
    return form.form == "exact" and form.slope != 0.0 and chunk_size > 1


def forward(
    rt: Runtime,
    seq: Tokens,
    state: State,
    chunk_size: int,
    form: ChunkForm,
    precision="ieee",
    operand_dtype: torch.dtype | None = None,
):
    """Returns o [B, H, T, Dv] and the final memory state, like `exact_chunk.forward`: its
    preparation and reads (torch) around the scan on the Triton kernels (tl.dot at
    `precision` on float32 tiles, checked by the caller; `operand_dtype`, the caller's input
    dtype, None: the state's)."""
    check_available(seq.phi_q)
    prep = exact_chunk.prepare(rt, seq, chunk_size, form)
    scan_args = prep.scan_args(state["W"], state.get("S.W"))
    r, starts_w, starts_s, w, s = scan(*scan_args, precision)
    o = exact_chunk.read(prep, r, starts_w, starts_s)
    final = dict(state)
    final["W"] = w
    if s is not None:
        final["S.W"] = s
    return o, final
