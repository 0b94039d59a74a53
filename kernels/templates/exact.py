"""The scan of the exact chunk form: one sequential pass over chunks, forward and backward.

Unlike `linear` and `general` this module has no slots: the spec reaches the scan only through
tensors its torch preparation computed (docs/chunking.md, "The exact form"), so the kernels are
the same for every spec and are imported as they stand. Per batch*head, chunk i (R = n*c
window rows, X = 1 per head or Dv per channel):

    r_i     = base_i + F_i W_i^T - G_i S_i^T                 r, base: [R, Dv]; F, G: [R, Dphi]
    W_{i+1} = d_i * W_i - (r_i * lw_i)^T K_i - ce_i * S_i    W, S: [Dv, Dphi]; K_i: [R, Dphi]
    S_{i+1} = te_i * S_i + (r_i * ls_i)^T K_i                lw, ls: [R, X]; d, ce, te: [X]

With PER_CHANNEL the solved systems differ per value channel: F_i, G_i are [Dv, R, R] and
enter as r[a, v] += sum_b F[v, a, b] (K W^T)[b, v]. Every row of W (a value channel) evolves on
its own, so a program owns a block of BV value channels: grid (B*H, value blocks).

The backward walks the chunks in reverse from the stored chunk-start states, carrying
dW = dL/dW_{i+1} and dS:

    dM = -K dW^T, dN = K dS^T                      (M = r * lw, N = r * ls: [R, Dv])
    dr = dr_i + dM * lw + dN * ls;  dlw = dM * r;  dls = dN * r
    dK = -M dW + N dS + dP W (+ dQ S)              (P = K W^T, per channel only)
    dd = <dW, W_i>_row, dce = -<dW, S_i>_row, dte = <dS, S_i>_row
    dF = dr W_i (per channel: dF[v, a, b] = dr[a, v] P[b, v]), dG = -dr S_i
    dW_i = d dW + dr^T F (per channel: dP^T K) + dW_start_i
    dS_i = te dS - ce dW - dr^T G + dS_start_i

Gates are read through (width, channel stride): a per-head gate (width 1) with channel stride
0, so one code path serves both; their gradients are written per channel and the wrapper
(`miras.runtime.exact_triton`) sums them for a per-head gate. dK, dF and dG of the per-head
layout sum over all value channels: each program writes its block's part, the wrapper sums.
"""

import triton
import triton.language as tl

from miras.kernels.common.io import load_rows, store_rows
from miras.kernels.common.tuning import PRUNE, SCAN, configs


@triton.jit
def _blocks(iv, R, DK, DV, BR: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """A program's indices and masks: rows [BR], its value channels cv [BV] (block iv), the
    feature channels ck [BK], the state tile's mask m2 and offsets st [BV, BK]."""
    rows = tl.arange(0, BR)
    cv = iv * BV + tl.arange(0, BV)
    ck = tl.arange(0, BK)
    mv = cv < DV
    mk = ck < DK
    return rows, rows < R, cv, mv, ck, mk, mv[:, None] & mk[None, :], cv[:, None] * DK + ck[None, :]


@triton.jit
def _row_gate(ptr, chunk, cv, mv, WIDTH, CSTRIDE, ACC: tl.constexpr):
    """d, ce or te of one chunk: [BV] (a per-head gate repeated over the channels)."""
    return tl.load(ptr + chunk * WIDTH + cv * CSTRIDE, mask=mv, other=0.0).to(ACC)


@triton.jit
def _system_block(chunk, cv, mv, rows, mr, R, DV):
    """Offsets and mask of a chunk's per-channel systems [BV, BR, BR] (F[v, a, b]) in a
    [BH, NC, DV, R, R] tensor."""
    offsets = chunk * DV * R * R + cv[:, None, None] * R * R
    offsets += rows[None, :, None] * R + rows[None, None, :]
    return offsets, mv[:, None, None] & mr[None, :, None] & mr[None, None, :]


@triton.jit
def _channel_systems(ptr, chunk, cv, mv, rows, mr, R, DV, ACC: tl.constexpr):
    """Per-channel F or G of one chunk: [BV, BR, BR]."""
    offsets, mask = _system_block(chunk, cv, mv, rows, mr, R, DV)
    return tl.load(ptr + offsets, mask=mask, other=0.0).to(ACC)


@triton.jit
def _apply_systems(f, p):
    """sum_b f[v, a, b] p[b, v] -> [BR, BV] (a, v)."""
    return tl.trans(tl.sum(f * tl.trans(p)[:, None, :], axis=2))


@triton.autotune(configs=configs(SCAN), key=["R", "DK", "DV"], prune_configs_by=PRUNE)
@triton.jit
def exact_scan_forward(
    base, f, g, keys, lw, ls, d, ce, te, w0, s0,
    r_out, w_starts, s_starts, w_out, s_out,
    lw_w, lw_c, ls_w, ls_c, d_w, d_c, ce_w, ce_c, te_w, te_c,
    NC, R, DK, DV,
    HAS_F: tl.constexpr, MOMENTUM: tl.constexpr, PER_CHANNEL: tl.constexpr,
    BR: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, ACC: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """base [BH, NC, R, DV]; f, g [BH, NC, R, DK] (PER_CHANNEL: [BH, NC, DV, R, R]); keys
    [BH, NC, R, DK]; lw, ls [BH, NC, R, X]; d, ce, te [BH, NC, X]; w0, s0 [BH, DV, DK].
    Writes r_out [BH, NC, R, DV], the chunk-start states [BH, NC, DV, DK] and the final ones."""
    pid = tl.program_id(0).to(tl.int64)
    iv = tl.program_id(1)
    rows, mr, cv, mv, ck, mk, m2, st = _blocks(iv, R, DK, DV, BR, BK, BV)
    w = tl.load(w0 + pid * DV * DK + st, mask=m2, other=0.0).to(ACC)
    s = tl.zeros([BV, BK], dtype=ACC)
    if MOMENTUM:
        s = tl.load(s0 + pid * DV * DK + st, mask=m2, other=0.0).to(ACC)
    for i in range(0, NC):
        chunk = pid * NC + i
        tl.store(w_starts + chunk * DV * DK + st, w.to(w_starts.dtype.element_ty), mask=m2)
        if MOMENTUM:
            tl.store(s_starts + chunk * DV * DK + st, s.to(s_starts.dtype.element_ty), mask=m2)
        x = load_rows(keys + chunk * R * DK, rows, mr, ck, mk, DK, 1, 0.0, ACC)  # [BR, BK]
        r = load_rows(base + chunk * R * DV, rows, mr, cv, mv, DV, 1, 0.0, ACC)  # [BR, BV]
        if HAS_F:
            if PER_CHANNEL:
                p = tl.dot(x, tl.trans(w), input_precision=DOT_PRECISION, out_dtype=ACC)
                r += _apply_systems(_channel_systems(f, chunk, cv, mv, rows, mr, R, DV, ACC), p)
                if MOMENTUM:
                    p = tl.dot(x, tl.trans(s), input_precision=DOT_PRECISION, out_dtype=ACC)
                    r -= _apply_systems(_channel_systems(g, chunk, cv, mv, rows, mr, R, DV, ACC), p)
            else:
                fm = load_rows(f + chunk * R * DK, rows, mr, ck, mk, DK, 1, 0.0, ACC)
                r += tl.dot(fm, tl.trans(w), input_precision=DOT_PRECISION, out_dtype=ACC)
                if MOMENTUM:
                    gm = load_rows(g + chunk * R * DK, rows, mr, ck, mk, DK, 1, 0.0, ACC)
                    r -= tl.dot(gm, tl.trans(s), input_precision=DOT_PRECISION, out_dtype=ACC)
        store_rows(r_out + chunk * R * DV, rows, mr, cv, mv, DV, r)
        lwb = load_rows(lw + chunk * R * lw_w, rows, mr, cv, mv, lw_w, lw_c, 0.0, ACC)
        dd = _row_gate(d, chunk, cv, mv, d_w, d_c, ACC)
        w_new = dd[:, None] * w - tl.dot(
            tl.trans(r * lwb), x, input_precision=DOT_PRECISION, out_dtype=ACC
        )
        if MOMENTUM:
            lsb = load_rows(ls + chunk * R * ls_w, rows, mr, cv, mv, ls_w, ls_c, 0.0, ACC)
            ce_ = _row_gate(ce, chunk, cv, mv, ce_w, ce_c, ACC)
            te_ = _row_gate(te, chunk, cv, mv, te_w, te_c, ACC)
            w_new -= ce_[:, None] * s
            s = te_[:, None] * s + tl.dot(
                tl.trans(r * lsb), x, input_precision=DOT_PRECISION, out_dtype=ACC
            )
            s = tl.where(m2, s, 0.0)
        w = tl.where(m2, w_new, 0.0)
    tl.store(w_out + pid * DV * DK + st, w.to(w_out.dtype.element_ty), mask=m2)
    if MOMENTUM:
        tl.store(s_out + pid * DV * DK + st, s.to(s_out.dtype.element_ty), mask=m2)


@triton.autotune(configs=configs(SCAN), key=["R", "DK", "DV"], prune_configs_by=PRUNE)
@triton.jit
def exact_scan_backward(
    f, g, keys, lw, ls, d, ce, te, r_saved, w_starts, s_starts,
    dr_in, dw_starts, ds_starts, dw_out, ds_out,
    d_base, d_f, d_g, d_keys, d_lw, d_ls, d_d, d_ce, d_te, dw0, ds0,
    lw_w, lw_c, ls_w, ls_c, d_w, d_c, ce_w, ce_c, te_w, te_c,
    BH, NC, R, DK, DV,
    HAS_F: tl.constexpr, MOMENTUM: tl.constexpr, PER_CHANNEL: tl.constexpr,
    BR: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, ACC: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Inputs as the forward's, with r_saved and the chunk-start states it wrote, and the
    gradients of its outputs. Writes d_base [BH, NC, R, DV]; d_lw, d_ls [BH, NC, R, DV] and d_d,
    d_ce, d_te [BH, NC, DV] per channel; d_keys [NVB, BH, NC, R, DK] and (per head) d_f, d_g
    [NVB, BH, NC, R, DK], one part per value block (PER_CHANNEL: d_f, d_g [BH, NC, DV, R, R]);
    dw0, ds0 [BH, DV, DK]."""
    pid = tl.program_id(0).to(tl.int64)
    iv = tl.program_id(1)
    rows, mr, cv, mv, ck, mk, m2, st = _blocks(iv, R, DK, DV, BR, BK, BV)
    part = (iv * BH + pid) * NC  # this block's part of the summed gradients, in chunks
    gw = tl.load(dw_out + pid * DV * DK + st, mask=m2, other=0.0).to(ACC)
    gs = tl.zeros([BV, BK], dtype=ACC)
    s = tl.zeros([BV, BK], dtype=ACC)
    if MOMENTUM:
        gs = tl.load(ds_out + pid * DV * DK + st, mask=m2, other=0.0).to(ACC)
    for back in range(0, NC):
        i = NC - 1 - back
        chunk = pid * NC + i
        w = tl.load(w_starts + chunk * DV * DK + st, mask=m2, other=0.0).to(ACC)
        x = load_rows(keys + chunk * R * DK, rows, mr, ck, mk, DK, 1, 0.0, ACC)
        r = load_rows(r_saved + chunk * R * DV, rows, mr, cv, mv, DV, 1, 0.0, ACC)
        lwb = load_rows(lw + chunk * R * lw_w, rows, mr, cv, mv, lw_w, lw_c, 0.0, ACC)
        dd = _row_gate(d, chunk, cv, mv, d_w, d_c, ACC)
        # W_{i+1} = d W_i - M^T K (- ce S_i)
        d_m = -tl.dot(x, tl.trans(gw), input_precision=DOT_PRECISION, out_dtype=ACC)
        dx = -tl.dot(r * lwb, gw, input_precision=DOT_PRECISION, out_dtype=ACC)
        dr = load_rows(dr_in + chunk * R * DV, rows, mr, cv, mv, DV, 1, 0.0, ACC) + d_m * lwb
        store_rows(d_lw + chunk * R * DV, rows, mr, cv, mv, DV, d_m * r)
        tl.store(d_d + chunk * DV + cv, tl.sum(gw * w, axis=1).to(d_d.dtype.element_ty), mask=mv)
        gw_prev = dd[:, None] * gw
        gs_prev = gs
        if MOMENTUM:
            s = tl.load(s_starts + chunk * DV * DK + st, mask=m2, other=0.0).to(ACC)
            lsb = load_rows(ls + chunk * R * ls_w, rows, mr, cv, mv, ls_w, ls_c, 0.0, ACC)
            ce_ = _row_gate(ce, chunk, cv, mv, ce_w, ce_c, ACC)
            te_ = _row_gate(te, chunk, cv, mv, te_w, te_c, ACC)
            # S_{i+1} = te S_i + N^T K
            d_n = tl.dot(x, tl.trans(gs), input_precision=DOT_PRECISION, out_dtype=ACC)
            dx += tl.dot(r * lsb, gs, input_precision=DOT_PRECISION, out_dtype=ACC)
            dr += d_n * lsb
            store_rows(d_ls + chunk * R * DV, rows, mr, cv, mv, DV, d_n * r)
            d_ce_ = -tl.sum(gw * s, axis=1)
            tl.store(d_ce + chunk * DV + cv, d_ce_.to(d_ce.dtype.element_ty), mask=mv)
            d_te_ = tl.sum(gs * s, axis=1)
            tl.store(d_te + chunk * DV + cv, d_te_.to(d_te.dtype.element_ty), mask=mv)
            gs_prev = te_[:, None] * gs - ce_[:, None] * gw
        store_rows(d_base + chunk * R * DV, rows, mr, cv, mv, DV, dr)
        # r_i = base + F W_i^T - G S_i^T
        if HAS_F:
            if PER_CHANNEL:
                sys_off, sys_mask = _system_block(chunk, cv, mv, rows, mr, R, DV)
                dr_t = tl.trans(dr)  # [BV, BR]
                p = tl.dot(x, tl.trans(w), input_precision=DOT_PRECISION, out_dtype=ACC)
                d_fm = dr_t[:, :, None] * tl.trans(p)[:, None, :]
                tl.store(d_f + sys_off, d_fm.to(d_f.dtype.element_ty), mask=sys_mask)
                fm = _channel_systems(f, chunk, cv, mv, rows, mr, R, DV, ACC)
                d_p = tl.trans(tl.sum(fm * dr_t[:, :, None], axis=1))  # [BR, BV]
                dx += tl.dot(d_p, w, input_precision=DOT_PRECISION, out_dtype=ACC)
                gw_prev += tl.dot(tl.trans(d_p), x, input_precision=DOT_PRECISION, out_dtype=ACC)
                if MOMENTUM:
                    p = tl.dot(x, tl.trans(s), input_precision=DOT_PRECISION, out_dtype=ACC)
                    d_gm = -dr_t[:, :, None] * tl.trans(p)[:, None, :]
                    tl.store(d_g + sys_off, d_gm.to(d_g.dtype.element_ty), mask=sys_mask)
                    gm = _channel_systems(g, chunk, cv, mv, rows, mr, R, DV, ACC)
                    d_q = -tl.trans(tl.sum(gm * dr_t[:, :, None], axis=1))
                    dx += tl.dot(d_q, s, input_precision=DOT_PRECISION, out_dtype=ACC)
                    gs_prev += tl.dot(
                        tl.trans(d_q), x, input_precision=DOT_PRECISION, out_dtype=ACC
                    )
            else:
                fm = load_rows(f + chunk * R * DK, rows, mr, ck, mk, DK, 1, 0.0, ACC)
                d_fm = tl.dot(dr, w, input_precision=DOT_PRECISION, out_dtype=ACC)
                store_rows(d_f + (part + i) * R * DK, rows, mr, ck, mk, DK, d_fm)
                gw_prev += tl.dot(tl.trans(dr), fm, input_precision=DOT_PRECISION, out_dtype=ACC)
                if MOMENTUM:
                    gm = load_rows(g + chunk * R * DK, rows, mr, ck, mk, DK, 1, 0.0, ACC)
                    d_gm = -tl.dot(dr, s, input_precision=DOT_PRECISION, out_dtype=ACC)
                    store_rows(d_g + (part + i) * R * DK, rows, mr, ck, mk, DK, d_gm)
                    gs_prev -= tl.dot(
                        tl.trans(dr), gm, input_precision=DOT_PRECISION, out_dtype=ACC
                    )
        store_rows(d_keys + (part + i) * R * DK, rows, mr, ck, mk, DK, dx)
        gw = gw_prev + tl.load(dw_starts + chunk * DV * DK + st, mask=m2, other=0.0).to(ACC)
        if MOMENTUM:
            gs = gs_prev + tl.load(ds_starts + chunk * DV * DK + st, mask=m2, other=0.0).to(ACC)
    tl.store(dw0 + pid * DV * DK + st, gw.to(dw0.dtype.element_ty), mask=m2)
    if MOMENTUM:
        tl.store(ds0 + pid * DV * DK + st, gs.to(ds0.dtype.element_ty), mask=m2)
