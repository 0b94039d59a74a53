"""The scan of the exact chunk form: one sequential pass over chunks, forward and backward.

Unlike `linear` and `general` this module has no slots: the spec reaches the scan only through
tensors its torch preparation computed (docs/chunking.md, "The exact form"), so the kernels are
the same for every spec and are imported as they stand. Per batch*head, chunk i (R = n*c
window rows, X = 1 per head or Dv per channel), with the state held transposed, h = W^T
[Dphi, Dv] (the layout of fla's chunk state kernels: keys on the rows, values on the columns):

    r_i     = base_i + F_i h_i - G_i s_i                      r, base: [R, Dv]; F, G: [R, Dphi]
    h_{i+1} = d_i * h_i - K_i^T (r_i * lw_i) - ce_i * s_i     h, s = S^T: [Dphi, Dv]; K_i: [R, Dphi]
    s_{i+1} = te_i * s_i + K_i^T (r_i * ls_i)                 lw, ls: [R, X]; d, ce, te: [X]

With PER_CHANNEL the solved systems differ per value channel: F_i, G_i are [Dv, R, R] and
enter as r[a, v] += sum_b F[v, a, b] (K h)[b, v], a different system per column, so not a
matmul: those products are elementwise [BV, BR, BR] tiles.

Every column of h (a value channel) evolves on its own, so a program owns BV value channels of
one head: grid (value blocks, B*H), BV an autotune parameter. Its state is NK tiles [BK, BV] in
the accumulator type (float32, or float64 for float64 inputs), one per BK = 64 key channels
(NK = 4 covers Dphi = 256; wider keys widen BK), held as separate variables h1..h4 under
constexpr `if NK > t` branches. Every product is a tl.dot with operands in the operand type OP
(the keys' and systems' element type: bf16, fp16, float32 or float64; the state and r * lw are
cast to it) and accumulates in place into the accumulator type: `h = tl.dot(k^T, -m, d * h)`.

The backward is the state part alone, in reverse from the last chunk: it carries dh = dL/dh_{i+1}
as NK tiles and writes what the chunk-parallel gradients need, dh at each chunk end and
dr = dL/dr_i (every other gradient is a batched product of these, the stored states and the
inputs, computed by the wrapper `miras.runtime.exact_triton`):

    dr_i = dr_in_i - (K dh) * lw + (K ds) * ls
    dh_i = d dh + F^T dr (per channel: K^T dP, dP[b, v] = sum_a F[v, a, b] dr[a, v]) + dh_start_i
    ds_i = te ds - ce dh - G^T dr (per channel: -K^T dQ, dQ likewise with G) + ds_start_i

Gate widths are constexprs (`lw_w`, ..., `te_w`: 1 per head, Dv per channel): a per-head
row gate is read as a [BR, 1] column and a per-head chunk gate as a scalar, broadcast over the
value channels. Loads are masked pointer tiles (triton 3.9 has no block pointers); per head
the forward reads K^T and the backward F^T, G^T transposed straight from memory into their
[BK, BR] operands, so no tile is transposed in registers. States in memory are [Dv, Dphi] (W itself, what the reads
take): a tile [BK, BV] of h is read and written at offsets v * DK + k.
"""

import triton
import triton.language as tl

from miras.kernels.common.tuning import SCAN_KEY, SCAN_PRUNE, scan_configs


@triton.jit
def _mma(a, b, acc, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """acc + a @ b with float32 (or float64) accumulation. UPCAST: the interpreter, whose tl.dot
    on 16-bit brain-float tiles multiplies their bit patterns as integers (triton 3.9): the
    half-precision operands go in as float32, exact products of the same rounded values
    (DOT_PRECISION is "ieee" for half operands)."""
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision=DOT_PRECISION, out_dtype=acc.dtype)


@triton.jit
def _state_tile(
    ptr,
    t: tl.constexpr,
    iv,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    ACC: tl.constexpr,
):
    ck = t * BK + tl.arange(0, BK)
    cv = iv * BV + tl.arange(0, BV)
    offsets = cv[None, :] * DK + ck[:, None]
    return tl.load(ptr + offsets, mask=(ck < DK)[:, None] & (cv < DV)[None, :], other=0.0).to(ACC)


@triton.jit
def _store_state_tile(
    ptr,
    t: tl.constexpr,
    tile,
    iv,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
):
    ck = t * BK + tl.arange(0, BK)
    cv = iv * BV + tl.arange(0, BV)
    offsets = cv[None, :] * DK + ck[:, None]
    tl.store(
        ptr + offsets, tile.to(ptr.dtype.element_ty), mask=(ck < DK)[:, None] & (cv < DV)[None, :]
    )


@triton.jit
def _row_tile(
    ptr, t: tl.constexpr, R: tl.constexpr, DK: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr
):
    rows = tl.arange(0, BR)
    ck = t * BK + tl.arange(0, BK)
    offsets = rows[:, None] * DK + ck[None, :]
    return tl.load(ptr + offsets, mask=(rows < R)[:, None] & (ck < DK)[None, :], other=0.0)


@triton.jit
def _row_tile_t(
    ptr, t: tl.constexpr, R: tl.constexpr, DK: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr
):
    """Key tile t of a chunk's [R, Dphi] operand, transposed: [BK, BR]."""
    rows = tl.arange(0, BR)
    ck = t * BK + tl.arange(0, BK)
    offsets = rows[None, :] * DK + ck[:, None]
    return tl.load(ptr + offsets, mask=(rows < R)[None, :] & (ck < DK)[:, None], other=0.0)


@triton.jit
def _value_rows(
    ptr,
    iv,
    R: tl.constexpr,
    DV: tl.constexpr,
    BR: tl.constexpr,
    BV: tl.constexpr,
    ACC: tl.constexpr,
):
    rows = tl.arange(0, BR)
    cv = iv * BV + tl.arange(0, BV)
    offsets = rows[:, None] * DV + cv[None, :]
    return tl.load(ptr + offsets, mask=(rows < R)[:, None] & (cv < DV)[None, :], other=0.0).to(ACC)


@triton.jit
def _store_value_rows(
    ptr, iv, R: tl.constexpr, DV: tl.constexpr, BR: tl.constexpr, BV: tl.constexpr, value
):
    rows = tl.arange(0, BR)
    cv = iv * BV + tl.arange(0, BV)
    offsets = rows[:, None] * DV + cv[None, :]
    tl.store(
        ptr + offsets, value.to(ptr.dtype.element_ty), mask=(rows < R)[:, None] & (cv < DV)[None, :]
    )


@triton.jit
def _row_weights(
    ptr,
    iv,
    R: tl.constexpr,
    WIDTH: tl.constexpr,
    BR: tl.constexpr,
    BV: tl.constexpr,
    ACC: tl.constexpr,
):
    """lw or ls of a chunk, [R, width]: [BR, BV] per channel, [BR, 1] per head (broadcast)."""
    if WIDTH == 1:
        rows = tl.arange(0, BR)
        out = tl.load(ptr + rows, mask=rows < R, other=0.0).to(ACC)[:, None]
    else:
        out = _value_rows(ptr, iv, R, WIDTH, BR, BV, ACC)
    return out


@triton.jit
def _row_gate(ptr, chunk, cv, mv, WIDTH: tl.constexpr, ACC: tl.constexpr):
    """d, ce or te of one chunk: [1, BV] per channel, [1, 1] per head."""
    if WIDTH == 1:
        out = tl.load(ptr + chunk).to(ACC)
    else:
        out = tl.load(ptr + chunk * WIDTH + cv, mask=mv, other=0.0).to(ACC)[None, :]
    return out


@triton.jit
def _channel_systems(
    ptr, chunk, cv, mv, rows, mr, R: tl.constexpr, DV: tl.constexpr, ACC: tl.constexpr
):
    """Per-channel F or G of one chunk: [BV, BR, BR] (F[v, a, b]) of a [BH, NC, DV, R, R] tensor."""
    offsets = chunk * DV * R * R + cv[:, None, None] * R * R
    offsets += rows[None, :, None] * R + rows[None, None, :]
    mask = mv[:, None, None] & mr[None, :, None] & mr[None, None, :]
    return tl.load(ptr + offsets, mask=mask, other=0.0).to(ACC)


@triton.jit
def _apply_systems(f, p):
    """sum_b f[v, a, b] p[b, v] -> [BR, BV] (a, v)."""
    return tl.trans(tl.sum(f * tl.trans(p)[:, None, :], axis=2))


@triton.jit
def _apply_systems_t(f, q):
    """sum_a f[v, a, b] q[a, v] -> [BR, BV] (b, v)."""
    return tl.trans(tl.sum(f * tl.trans(q)[:, :, None], axis=1))


@triton.autotune(configs=scan_configs(), key=SCAN_KEY, prune_configs_by=SCAN_PRUNE)
@triton.jit
def exact_scan_forward(
    base, f, g, keys, lw, ls, d, ce, te, w0, s0,
    r_out, w_starts, s_starts, w_out, s_out,
    NC,
    lw_w: tl.constexpr, ls_w: tl.constexpr, d_w: tl.constexpr, ce_w: tl.constexpr, te_w: tl.constexpr,
    R: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    HAS_F: tl.constexpr, MOMENTUM: tl.constexpr, PER_CHANNEL: tl.constexpr,
    BR: tl.constexpr, BK: tl.constexpr, NK: tl.constexpr, BV: tl.constexpr,
    ACC: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """base [BH, NC, R, DV] (ACC); keys [BH, NC, R, DK] and f, g [BH, NC, R, DK] (PER_CHANNEL:
    [BH, NC, DV, R, R], ACC) in the operand type; lw, ls [BH, NC, R, X]; d, ce, te [BH, NC, X];
    w0, s0 [BH, DV, DK]. Writes r_out [BH, NC, R, DV], the chunk-start states [BH, NC, DV, DK]
    and the final ones."""
    iv = tl.program_id(0)
    pid = tl.program_id(1).to(tl.int64)
    OP: tl.constexpr = keys.dtype.element_ty
    rows = tl.arange(0, BR)
    mr = rows < R
    cv = iv * BV + tl.arange(0, BV)
    mv = cv < DV
    state = pid * DV * DK
    h1 = _state_tile(w0 + state, 0, iv, DK, DV, BK, BV, ACC)
    if NK > 1:
        h2 = _state_tile(w0 + state, 1, iv, DK, DV, BK, BV, ACC)
    if NK > 2:
        h3 = _state_tile(w0 + state, 2, iv, DK, DV, BK, BV, ACC)
    if NK > 3:
        h4 = _state_tile(w0 + state, 3, iv, DK, DV, BK, BV, ACC)
    if MOMENTUM:
        s1 = _state_tile(s0 + state, 0, iv, DK, DV, BK, BV, ACC)
        if NK > 1:
            s2 = _state_tile(s0 + state, 1, iv, DK, DV, BK, BV, ACC)
        if NK > 2:
            s3 = _state_tile(s0 + state, 2, iv, DK, DV, BK, BV, ACC)
        if NK > 3:
            s4 = _state_tile(s0 + state, 3, iv, DK, DV, BK, BV, ACC)
    for i in range(0, NC):
        chunk = pid * NC + i
        starts = w_starts + chunk * DV * DK
        _store_state_tile(starts, 0, h1, iv, DK, DV, BK, BV)
        if NK > 1:
            _store_state_tile(starts, 1, h2, iv, DK, DV, BK, BV)
        if NK > 2:
            _store_state_tile(starts, 2, h3, iv, DK, DV, BK, BV)
        if NK > 3:
            _store_state_tile(starts, 3, h4, iv, DK, DV, BK, BV)
        if MOMENTUM:
            starts = s_starts + chunk * DV * DK
            _store_state_tile(starts, 0, s1, iv, DK, DV, BK, BV)
            if NK > 1:
                _store_state_tile(starts, 1, s2, iv, DK, DV, BK, BV)
            if NK > 2:
                _store_state_tile(starts, 2, s3, iv, DK, DV, BK, BV)
            if NK > 3:
                _store_state_tile(starts, 3, s4, iv, DK, DV, BK, BV)
        x = keys + chunk * R * DK
        if PER_CHANNEL:  # K [BR, BK] for p = K h, its transpose for the update
            k1 = _row_tile(x, 0, R, DK, BR, BK)
            kt1 = tl.trans(k1)
            if NK > 1:
                k2 = _row_tile(x, 1, R, DK, BR, BK)
                kt2 = tl.trans(k2)
            if NK > 2:
                k3 = _row_tile(x, 2, R, DK, BR, BK)
                kt3 = tl.trans(k3)
            if NK > 3:
                k4 = _row_tile(x, 3, R, DK, BR, BK)
                kt4 = tl.trans(k4)
        else:  # K^T [BK, BR] alone, read transposed
            kt1 = _row_tile_t(x, 0, R, DK, BR, BK)
            if NK > 1:
                kt2 = _row_tile_t(x, 1, R, DK, BR, BK)
            if NK > 2:
                kt3 = _row_tile_t(x, 2, R, DK, BR, BK)
            if NK > 3:
                kt4 = _row_tile_t(x, 3, R, DK, BR, BK)
        r = _value_rows(base + chunk * R * DV, iv, R, DV, BR, BV, ACC)  # [BR, BV]
        if HAS_F:
            if PER_CHANNEL:  # p = K h, then a system per value channel
                p = _mma(k1, h1.to(OP), tl.zeros([BR, BV], ACC), DOT_PRECISION, UPCAST)
                if NK > 1:
                    p = _mma(k2, h2.to(OP), p, DOT_PRECISION, UPCAST)
                if NK > 2:
                    p = _mma(k3, h3.to(OP), p, DOT_PRECISION, UPCAST)
                if NK > 3:
                    p = _mma(k4, h4.to(OP), p, DOT_PRECISION, UPCAST)
                r += _apply_systems(_channel_systems(f, chunk, cv, mv, rows, mr, R, DV, ACC), p)
                if MOMENTUM:
                    q = _mma(k1, s1.to(OP), tl.zeros([BR, BV], ACC), DOT_PRECISION, UPCAST)
                    if NK > 1:
                        q = _mma(k2, s2.to(OP), q, DOT_PRECISION, UPCAST)
                    if NK > 2:
                        q = _mma(k3, s3.to(OP), q, DOT_PRECISION, UPCAST)
                    if NK > 3:
                        q = _mma(k4, s4.to(OP), q, DOT_PRECISION, UPCAST)
                    gm = _channel_systems(g, chunk, cv, mv, rows, mr, R, DV, ACC)
                    r -= _apply_systems(gm, q)
            else:  # r += F h - G s, in place
                fm = f + chunk * R * DK
                r = _mma(_row_tile(fm, 0, R, DK, BR, BK), h1.to(OP), r, DOT_PRECISION, UPCAST)
                if NK > 1:
                    r = _mma(_row_tile(fm, 1, R, DK, BR, BK), h2.to(OP), r, DOT_PRECISION, UPCAST)
                if NK > 2:
                    r = _mma(_row_tile(fm, 2, R, DK, BR, BK), h3.to(OP), r, DOT_PRECISION, UPCAST)
                if NK > 3:
                    r = _mma(_row_tile(fm, 3, R, DK, BR, BK), h4.to(OP), r, DOT_PRECISION, UPCAST)
                if MOMENTUM:
                    gm = g + chunk * R * DK
                    r = _mma(
                        _row_tile(gm, 0, R, DK, BR, BK), (-s1).to(OP), r, DOT_PRECISION, UPCAST
                    )
                    if NK > 1:
                        r = _mma(
                            _row_tile(gm, 1, R, DK, BR, BK),
                            (-s2).to(OP),
                            r,
                            DOT_PRECISION,
                            UPCAST,
                        )
                    if NK > 2:
                        r = _mma(
                            _row_tile(gm, 2, R, DK, BR, BK),
                            (-s3).to(OP),
                            r,
                            DOT_PRECISION,
                            UPCAST,
                        )
                    if NK > 3:
                        r = _mma(
                            _row_tile(gm, 3, R, DK, BR, BK),
                            (-s4).to(OP),
                            r,
                            DOT_PRECISION,
                            UPCAST,
                        )
        _store_value_rows(r_out + chunk * R * DV, iv, R, DV, BR, BV, r)
        # h <- d h - K^T (r lw) - ce s;  s <- te s + K^T (r ls)
        m = -(r * _row_weights(lw + chunk * R * lw_w, iv, R, lw_w, BR, BV, ACC))
        m = m.to(OP)
        dd = _row_gate(d, chunk, cv, mv, d_w, ACC)
        if MOMENTUM:
            n = r * _row_weights(ls + chunk * R * ls_w, iv, R, ls_w, BR, BV, ACC)
            n = n.to(OP)
            ce_ = _row_gate(ce, chunk, cv, mv, ce_w, ACC)
            te_ = _row_gate(te, chunk, cv, mv, te_w, ACC)
            h1 = _mma(kt1, m, dd * h1 - ce_ * s1, DOT_PRECISION, UPCAST)
            s1 = _mma(kt1, n, te_ * s1, DOT_PRECISION, UPCAST)
            if NK > 1:
                h2 = _mma(kt2, m, dd * h2 - ce_ * s2, DOT_PRECISION, UPCAST)
                s2 = _mma(kt2, n, te_ * s2, DOT_PRECISION, UPCAST)
            if NK > 2:
                h3 = _mma(kt3, m, dd * h3 - ce_ * s3, DOT_PRECISION, UPCAST)
                s3 = _mma(kt3, n, te_ * s3, DOT_PRECISION, UPCAST)
            if NK > 3:
                h4 = _mma(kt4, m, dd * h4 - ce_ * s4, DOT_PRECISION, UPCAST)
                s4 = _mma(kt4, n, te_ * s4, DOT_PRECISION, UPCAST)
        else:
            h1 = _mma(kt1, m, dd * h1, DOT_PRECISION, UPCAST)
            if NK > 1:
                h2 = _mma(kt2, m, dd * h2, DOT_PRECISION, UPCAST)
            if NK > 2:
                h3 = _mma(kt3, m, dd * h3, DOT_PRECISION, UPCAST)
            if NK > 3:
                h4 = _mma(kt4, m, dd * h4, DOT_PRECISION, UPCAST)
    _store_state_tile(w_out + state, 0, h1, iv, DK, DV, BK, BV)
    if NK > 1:
        _store_state_tile(w_out + state, 1, h2, iv, DK, DV, BK, BV)
    if NK > 2:
        _store_state_tile(w_out + state, 2, h3, iv, DK, DV, BK, BV)
    if NK > 3:
        _store_state_tile(w_out + state, 3, h4, iv, DK, DV, BK, BV)
    if MOMENTUM:
        _store_state_tile(s_out + state, 0, s1, iv, DK, DV, BK, BV)
        if NK > 1:
            _store_state_tile(s_out + state, 1, s2, iv, DK, DV, BK, BV)
        if NK > 2:
            _store_state_tile(s_out + state, 2, s3, iv, DK, DV, BK, BV)
        if NK > 3:
            _store_state_tile(s_out + state, 3, s4, iv, DK, DV, BK, BV)


@triton.autotune(configs=scan_configs(), key=SCAN_KEY, prune_configs_by=SCAN_PRUNE)
@triton.jit
def exact_scan_backward(
    f, g, keys, lw, ls, d, ce, te,
    dr_in, dw_starts, ds_starts, dw_out, ds_out,
    dr_out, dw_ends, ds_ends, dw0, ds0,
    NC,
    lw_w: tl.constexpr, ls_w: tl.constexpr, d_w: tl.constexpr, ce_w: tl.constexpr, te_w: tl.constexpr,
    R: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    HAS_F: tl.constexpr, MOMENTUM: tl.constexpr, PER_CHANNEL: tl.constexpr,
    BR: tl.constexpr, BK: tl.constexpr, NK: tl.constexpr, BV: tl.constexpr,
    ACC: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """Inputs as the forward's and the gradients of its outputs: dr_in [BH, NC, R, DV],
    dw_starts, ds_starts [BH, NC, DV, DK], dw_out, ds_out [BH, DV, DK]. Writes dr_out = dL/dr
    [BH, NC, R, DV] (the gradient of base), dw_ends, ds_ends = dL/dW_{i+1}, dL/dS_{i+1}
    [BH, NC, DV, DK] (everything downstream of chunk i's end) and dw0, ds0 [BH, DV, DK]."""
    iv = tl.program_id(0)
    pid = tl.program_id(1).to(tl.int64)
    OP: tl.constexpr = keys.dtype.element_ty
    rows = tl.arange(0, BR)
    mr = rows < R
    cv = iv * BV + tl.arange(0, BV)
    mv = cv < DV
    state = pid * DV * DK
    dh1 = _state_tile(dw_out + state, 0, iv, DK, DV, BK, BV, ACC)
    if NK > 1:
        dh2 = _state_tile(dw_out + state, 1, iv, DK, DV, BK, BV, ACC)
    if NK > 2:
        dh3 = _state_tile(dw_out + state, 2, iv, DK, DV, BK, BV, ACC)
    if NK > 3:
        dh4 = _state_tile(dw_out + state, 3, iv, DK, DV, BK, BV, ACC)
    if MOMENTUM:
        ds1 = _state_tile(ds_out + state, 0, iv, DK, DV, BK, BV, ACC)
        if NK > 1:
            ds2 = _state_tile(ds_out + state, 1, iv, DK, DV, BK, BV, ACC)
        if NK > 2:
            ds3 = _state_tile(ds_out + state, 2, iv, DK, DV, BK, BV, ACC)
        if NK > 3:
            ds4 = _state_tile(ds_out + state, 3, iv, DK, DV, BK, BV, ACC)
    for back in range(0, NC):
        chunk = pid * NC + NC - 1 - back
        ends = dw_ends + chunk * DV * DK
        _store_state_tile(ends, 0, dh1, iv, DK, DV, BK, BV)
        if NK > 1:
            _store_state_tile(ends, 1, dh2, iv, DK, DV, BK, BV)
        if NK > 2:
            _store_state_tile(ends, 2, dh3, iv, DK, DV, BK, BV)
        if NK > 3:
            _store_state_tile(ends, 3, dh4, iv, DK, DV, BK, BV)
        x = keys + chunk * R * DK
        k1 = _row_tile(x, 0, R, DK, BR, BK)
        if NK > 1:
            k2 = _row_tile(x, 1, R, DK, BR, BK)
        if NK > 2:
            k3 = _row_tile(x, 2, R, DK, BR, BK)
        if NK > 3:
            k4 = _row_tile(x, 3, R, DK, BR, BK)
        # dr = dr_in - (K dh) lw + (K ds) ls
        dm = _mma(k1, dh1.to(OP), tl.zeros([BR, BV], ACC), DOT_PRECISION, UPCAST)
        if NK > 1:
            dm = _mma(k2, dh2.to(OP), dm, DOT_PRECISION, UPCAST)
        if NK > 2:
            dm = _mma(k3, dh3.to(OP), dm, DOT_PRECISION, UPCAST)
        if NK > 3:
            dm = _mma(k4, dh4.to(OP), dm, DOT_PRECISION, UPCAST)
        dr = _value_rows(dr_in + chunk * R * DV, iv, R, DV, BR, BV, ACC)
        dr -= dm * _row_weights(lw + chunk * R * lw_w, iv, R, lw_w, BR, BV, ACC)
        dd = _row_gate(d, chunk, cv, mv, d_w, ACC)
        starts = dw_starts + chunk * DV * DK
        if MOMENTUM:
            ends = ds_ends + chunk * DV * DK
            _store_state_tile(ends, 0, ds1, iv, DK, DV, BK, BV)
            if NK > 1:
                _store_state_tile(ends, 1, ds2, iv, DK, DV, BK, BV)
            if NK > 2:
                _store_state_tile(ends, 2, ds3, iv, DK, DV, BK, BV)
            if NK > 3:
                _store_state_tile(ends, 3, ds4, iv, DK, DV, BK, BV)
            dn = _mma(k1, ds1.to(OP), tl.zeros([BR, BV], ACC), DOT_PRECISION, UPCAST)
            if NK > 1:
                dn = _mma(k2, ds2.to(OP), dn, DOT_PRECISION, UPCAST)
            if NK > 2:
                dn = _mma(k3, ds3.to(OP), dn, DOT_PRECISION, UPCAST)
            if NK > 3:
                dn = _mma(k4, ds4.to(OP), dn, DOT_PRECISION, UPCAST)
            dr += dn * _row_weights(ls + chunk * R * ls_w, iv, R, ls_w, BR, BV, ACC)
            ce_ = _row_gate(ce, chunk, cv, mv, ce_w, ACC)
            te_ = _row_gate(te, chunk, cv, mv, te_w, ACC)
            # ds <- te ds - ce dh - G^T dr + ds_start (before dh moves on: it reads dh)
            s_starts = ds_starts + chunk * DV * DK
            ds1 = te_ * ds1 - ce_ * dh1 + _state_tile(s_starts, 0, iv, DK, DV, BK, BV, ACC)
            if NK > 1:
                ds2 = te_ * ds2 - ce_ * dh2 + _state_tile(s_starts, 1, iv, DK, DV, BK, BV, ACC)
            if NK > 2:
                ds3 = te_ * ds3 - ce_ * dh3 + _state_tile(s_starts, 2, iv, DK, DV, BK, BV, ACC)
            if NK > 3:
                ds4 = te_ * ds4 - ce_ * dh4 + _state_tile(s_starts, 3, iv, DK, DV, BK, BV, ACC)
        _store_value_rows(dr_out + chunk * R * DV, iv, R, DV, BR, BV, dr)
        # dh <- d dh + F^T dr + dh_start
        dh1 = dd * dh1 + _state_tile(starts, 0, iv, DK, DV, BK, BV, ACC)
        if NK > 1:
            dh2 = dd * dh2 + _state_tile(starts, 1, iv, DK, DV, BK, BV, ACC)
        if NK > 2:
            dh3 = dd * dh3 + _state_tile(starts, 2, iv, DK, DV, BK, BV, ACC)
        if NK > 3:
            dh4 = dd * dh4 + _state_tile(starts, 3, iv, DK, DV, BK, BV, ACC)
        if HAS_F:
            if PER_CHANNEL:  # through p = K h: dh += K^T dP, dP = sum_a F[v, a, b] dr[a, v]
                fm = _channel_systems(f, chunk, cv, mv, rows, mr, R, DV, ACC)
                dp = _apply_systems_t(fm, dr).to(OP)
                dh1 = _mma(tl.trans(k1), dp, dh1, DOT_PRECISION, UPCAST)
                if NK > 1:
                    dh2 = _mma(tl.trans(k2), dp, dh2, DOT_PRECISION, UPCAST)
                if NK > 2:
                    dh3 = _mma(tl.trans(k3), dp, dh3, DOT_PRECISION, UPCAST)
                if NK > 3:
                    dh4 = _mma(tl.trans(k4), dp, dh4, DOT_PRECISION, UPCAST)
                if MOMENTUM:
                    gm = _channel_systems(g, chunk, cv, mv, rows, mr, R, DV, ACC)
                    dq = (-_apply_systems_t(gm, dr)).to(OP)
                    ds1 = _mma(tl.trans(k1), dq, ds1, DOT_PRECISION, UPCAST)
                    if NK > 1:
                        ds2 = _mma(tl.trans(k2), dq, ds2, DOT_PRECISION, UPCAST)
                    if NK > 2:
                        ds3 = _mma(tl.trans(k3), dq, ds3, DOT_PRECISION, UPCAST)
                    if NK > 3:
                        ds4 = _mma(tl.trans(k4), dq, ds4, DOT_PRECISION, UPCAST)
            else:
                fm = f + chunk * R * DK
                dro = dr.to(OP)
                dh1 = _mma(_row_tile_t(fm, 0, R, DK, BR, BK), dro, dh1, DOT_PRECISION, UPCAST)
                if NK > 1:
                    dh2 = _mma(
                        _row_tile_t(fm, 1, R, DK, BR, BK),
                        dro,
                        dh2,
                        DOT_PRECISION,
                        UPCAST,
                    )
                if NK > 2:
                    dh3 = _mma(
                        _row_tile_t(fm, 2, R, DK, BR, BK),
                        dro,
                        dh3,
                        DOT_PRECISION,
                        UPCAST,
                    )
                if NK > 3:
                    dh4 = _mma(
                        _row_tile_t(fm, 3, R, DK, BR, BK),
                        dro,
                        dh4,
                        DOT_PRECISION,
                        UPCAST,
                    )
                if MOMENTUM:
                    gm = g + chunk * R * DK
                    dro = (-dr).to(OP)
                    ds1 = _mma(
                        _row_tile_t(gm, 0, R, DK, BR, BK),
                        dro,
                        ds1,
                        DOT_PRECISION,
                        UPCAST,
                    )
                    if NK > 1:
                        ds2 = _mma(
                            _row_tile_t(gm, 1, R, DK, BR, BK),
                            dro,
                            ds2,
                            DOT_PRECISION,
                            UPCAST,
                        )
                    if NK > 2:
                        ds3 = _mma(
                            _row_tile_t(gm, 2, R, DK, BR, BK),
                            dro,
                            ds3,
                            DOT_PRECISION,
                            UPCAST,
                        )
                    if NK > 3:
                        ds4 = _mma(
                            _row_tile_t(gm, 3, R, DK, BR, BK),
                            dro,
                            ds4,
                            DOT_PRECISION,
                            UPCAST,
                        )
    _store_state_tile(dw0 + state, 0, dh1, iv, DK, DV, BK, BV)
    if NK > 1:
        _store_state_tile(dw0 + state, 1, dh2, iv, DK, DV, BK, BV)
    if NK > 2:
        _store_state_tile(dw0 + state, 2, dh3, iv, DK, DV, BK, BV)
    if NK > 3:
        _store_state_tile(dw0 + state, 3, dh4, iv, DK, DV, BK, BV)
    if MOMENTUM:
        _store_state_tile(ds0 + state, 0, ds1, iv, DK, DV, BK, BV)
        if NK > 1:
            _store_state_tile(ds0 + state, 1, ds2, iv, DK, DV, BK, BV)
        if NK > 2:
            _store_state_tile(ds0 + state, 2, ds3, iv, DK, DV, BK, BV)
        if NK > 3:
            _store_state_tile(ds0 + state, 3, ds4, iv, DK, DV, BK, BV)
