"""The exact chunk form on the Triton backend: exact_chunk's preparation (torch), the scan over
chunks as Triton kernels (`miras.kernels.templates.exact`), exact_chunk's reads (torch).

    r, w_starts, s_starts, w, s = scan(base, keys, f, g, lw, ls, d, ce, te, w0, s0)

The scan is the one sequential part of the exact form (docs/chunking.md, "The exact form";
docs/kernels.md derives its backward); the preparation and the reads are batched over all
chunks and stay in torch, so autograd flows through them and through `ExactScan`. Its
backward kernel carries only the state's gradient (as fla's chunk state backward does); the
gradients of the keys, systems and gates are batched products over all chunks, in torch
(`_chunk_gradients`). With bf16 or fp16 inputs (`operand_dtype`) the products take
half-precision copies of the keys and systems; the state, r and every gradient stay float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from miras.ir import ChunkForm
from miras.runtime import exact_chunk
from miras.runtime.core import Runtime, State, Tokens
from miras.runtime.triton_launch import (
    HALF,
    accumulator,
    check_available,
    check_written,
    dot_precision,
    launcher,
    poisoned,
    pow2,
    runs_on_cpu,
)

# ExactScan's tensor inputs, in order; the gates among them (width 1 per head, or Dv).
INPUTS = ("base", "f", "g", "keys", "lw", "ls", "d", "ce", "te", "w0", "s0")
GATES = ("lw", "ls", "d", "ce", "te")

# The kernels hold the state as at most this many key tiles (h1..h4), each BK = 64 key
# channels wide up to Dphi = 256 and wider past it.
KEY_TILES = 4
KEY_TILE = 64


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
    precision: str = "ieee"  # tl.dot's on float32 operands (inputs.TRITON_PRECISIONS)
    operand: torch.dtype | None = None  # the products' operand type (None: the state's)

    @property
    def key_tiles(self) -> tuple[int, int]:
        """(NK, BK): the state's key tiles [BK, BV] and their width."""
        count = min(KEY_TILES, -(-self.d_k // KEY_TILE))
        return count, pow2(-(-self.d_k // count))

    def grid(self, meta: dict) -> tuple[int, int]:
        """(value blocks, B*H): BV is the autotune config's."""
        return -(-self.d_v // meta["BV"]), self.bh

    def operand_type(self, like: torch.Tensor) -> torch.dtype:
        """What the keys and per-head systems are cast to for the products: a half type when
        the inputs were one and the state float32, else the state's own type."""
        if self.operand in HALF and like.dtype == torch.float32:
            return self.operand
        return like.dtype

    def meta(self, like: torch.Tensor) -> dict:
        """The constexprs for a state like `like` (float32 or float64); BV, num_warps and
        num_stages come from the kernels' autotune configs (kernels/common/tuning.py)."""
        acc = accumulator(like)
        half = self.operand_type(like) in HALF
        key_tiles, block_k = self.key_tiles
        gate_widths = {f"{name}_w": width for name, width in zip(GATES, self.widths, strict=True)}
        return gate_widths | dict(
            R=self.rows,
            DK=self.d_k,
            DV=self.d_v,
            HAS_F=self.has_f,
            MOMENTUM=self.momentum,
            PER_CHANNEL=self.per_channel,
            BR=pow2(self.rows),
            BK=block_k,
            NK=key_tiles,
            ACC=acc,
            # half operands: tensor cores whatever `precision` says (it names float32's)
            DOT_PRECISION="ieee" if half else dot_precision(self.precision, acc),
            UPCAST=half and runs_on_cpu(),
        )


class ExactScan(torch.autograd.Function):
    """(base, f, g, keys, lw, ls, d, ce, te, w0, s0), all [BH, N, ...] contiguous float32 or
    float64 (absent ones a placeholder) -> r [BH, N, R, Dv], W at each chunk start
    [BH, N, Dv, Dphi], the final W, and with momentum S at each chunk start and the final S.

    The kernels run the sequential part alone: the forward the whole scan, the backward the
    carried gradients dL/dW_{i+1} (and dS) at each chunk end and dL/dr; every other gradient
    is a product over all chunks at once (`_chunk_gradients`)."""

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
        keys_op, f_op, g_op = _operands(launch, base, keys, f, g)
        launcher(exact_scan_forward, launch.grid)(
            base, f_op, g_op, keys_op, lw, ls, d, ce, te, w0, s0,
            r, w_starts, s_starts, w_out, s_out,
            nc, **launch.meta(base),
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
        d_base = poisoned(bh, nc, rows, dv, like=r)
        dw_ends = poisoned(bh, nc, dv, dk, like=r)
        dw0 = poisoned(bh, dv, dk, like=r)
        written = {"d base": d_base, "d W at chunk ends": dw_ends, "d w0": dw0}
        ds_ends = ds0 = r.new_zeros(1)  # never written without momentum
        if launch.momentum:
            ds_ends = poisoned(bh, nc, dv, dk, like=r)
            ds0 = poisoned(bh, dv, dk, like=r)
            written |= {"d S at chunk ends": ds_ends, "d s0": ds0}
        keys_op, f_op, g_op = _operands(launch, r, keys, f, g)
        launcher(exact_scan_backward, launch.grid)(
            f_op, g_op, keys_op, lw, ls, d, ce, te,
            dr, dw_starts, ds_starts, dw_out, ds_out,
            d_base, dw_ends, ds_ends, dw0, ds0,
            nc, **launch.meta(r),
        )  # fmt: skip
        check_written(written)
        grads = _chunk_gradients(
            launch, f, g, keys, lw, ls, r, w_starts, s_starts, d_base, dw_ends, ds_ends
        )
        grads |= dict(base=d_base, w0=dw0)
        if launch.momentum:
            grads["s0"] = ds0
        return None, *(grads.get(name) for name in INPUTS)


def _operands(launch: ScanLaunch, like, keys, f, g):
    """The products' operands: the keys, and per head F and G, in the launch's operand type
    (half-precision copies for half inputs; the state and every stored tensor stay `like`'s)."""
    op = launch.operand_type(like)
    keys = keys.to(op)
    if launch.has_f and not launch.per_channel:
        f, g = f.to(op), g.to(op)
    return keys, f, g


def _chunk_gradients(launch, f, g, keys, lw, ls, r, w_starts, s_starts, dr, dw_ends, ds_ends):
    """Every gradient that is not carried, for all chunks at once (batched matmuls on a GPU),
    from the kernel's dL/dr and dL/dW_{i+1}, dL/dS_{i+1} [BH, N, Dv, Dphi] (gW, gS):

        W_{i+1} = d W_i - M^T K - ce S_i, M = r lw:  dM = -K gW^T, dK = -M gW, dd = <gW, W_i>_row
        S_{i+1} = te S_i + N^T K, N = r ls:         dN = K gS^T,  dK += N gS, dte = <gS, S_i>_row
                                                    dce = -<gW, S_i>_row
        r = base + F W_i^T - G S_i^T:  dF = dr W_i, dG = -dr S_i
        per channel, r[a, v] += sum_b F[v, a, b] P[b, v], P = K W_i^T:
            dF[v, a, b] = dr[a, v] P[b, v];  dK += dP W_i, dP[b, v] = sum_a F[v, a, b] dr[a, v]

    The gates' gradients are per channel, summed for a per-head gate (width 1)."""
    widths = dict(zip(GATES, launch.widths, strict=True))

    def gate(name, grad):  # per channel -> the gate's own width
        return grad.sum(-1, keepdim=True) if widths[name] == 1 else grad

    def row_dot(a, b):  # <a, b> over the key channels of each value channel: [BH, N, Dv]
        return (a * b).sum(-1)

    d_m = -(keys @ dw_ends.transpose(-1, -2))  # [BH, N, R, Dv]
    d_keys = -(r * lw) @ dw_ends
    out = dict(lw=gate("lw", d_m * r), d=gate("d", row_dot(dw_ends, w_starts)))
    if launch.momentum:
        d_n = keys @ ds_ends.transpose(-1, -2)
        d_keys = d_keys + (r * ls) @ ds_ends
        out |= dict(
            ls=gate("ls", d_n * r),
            ce=gate("ce", -row_dot(dw_ends, s_starts)),
            te=gate("te", row_dot(ds_ends, s_starts)),
        )
    if launch.has_f and launch.per_channel:
        p = keys @ w_starts.transpose(-1, -2)  # [BH, N, R, Dv]
        out["f"] = torch.einsum("znav,znbv->znvab", dr, p)
        d_keys = d_keys + torch.einsum("znvab,znav->znbv", f, dr) @ w_starts
        if launch.momentum:
            q = keys @ s_starts.transpose(-1, -2)
            out["g"] = -torch.einsum("znav,znbv->znvab", dr, q)
            d_keys = d_keys - torch.einsum("znvab,znav->znbv", g, dr) @ s_starts
    elif launch.has_f:
        out["f"] = dr @ w_starts
        if launch.momentum:
            out["g"] = -(dr @ s_starts)
    out["keys"] = d_keys
    return out


def scan(
    base, keys, from_w, from_s, last_w, last_s, d_end, carry_end, theta_end, w0, s0,
    precision="ieee", operand_dtype=None,
):  # fmt: skip
    """`exact_chunk.scan_chunks` on the Triton kernels: the same arguments and results, and
    `precision`, tl.dot's input precision on float32 operands; `operand_dtype` bf16 or fp16
    (the caller's inputs): the products take half-precision copies of the keys and systems and
    the state (float32) is cast to it at each product, accumulating in float32, as fla's
    kernels do. Per batch and head (R = n*c rows, X = 1 or Dv):

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
        b * h, chunks, rows, d_k, d_v, has_f, momentum, per_channel, widths, precision,
        operand_dtype,
    )  # fmt: skip
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
    `precision` on float32 operands, checked by the caller; `operand_dtype`, the caller's
    input dtype: bf16 or fp16 make the products' operands half precision, anything else (and
    None) leaves them in the state's type)."""
    check_available(seq.phi_q)
    prep = exact_chunk.prepare(rt, seq, chunk_size, form)
    scan_args = prep.scan_args(state["W"], state.get("S.W"))
    r, starts_w, starts_s, w, s = scan(*scan_args, precision, operand_dtype)
    o = exact_chunk.read(prep, r, starts_w, starts_s)
    final = dict(state)
    final["W"] = w
    if s is not None:
        final["S.W"] = s
    return o, final
