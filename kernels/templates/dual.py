"""The dual form's forward kernel for a two-layer MLP memory (docs/kernels.md, "Deep memories on
the GPU"; the torch reference is `miras.runtime.dual`).

Per head, with the input layer A [DH, DK] (the spec's `W2`), the output layer B [DV, DH] (`W1`),
their momenta SA and SB, and a chunk's keys X [BT, DK], values V, queries Q, every gradient is
taken at the chunk-start weights (times D_t for grad_at: retained):

    gradient point  z1 = X A^T,  a1 = act(z1),  y = a1 B^T                [BT, DH], [BT, DV]
    errors          e2 = gamma bias_grad(y - V, V),  e1 = (e2 B) * act'(z1)
    read            zq = D (Q A^T) - C (Q SA^T) - (coeff * Q X^T) e1,  aq = act(zq)
                    o  = D (aq B^T) - C (aq SB^T) - (coeff * aq a1^T) e2
    chunk end       A' = a A - c SA + (last * e1)^T X,   SA' = theta SA + (last_s * e1)^T X
                    B' = a B - c SB + (last * e2)^T a1,  SB' = theta SB + (last_s * e2)^T a1

D, C, coeff, last, last_s and the chunk end's (a, c, theta) come from the step gates alone and
are computed in torch (`dual.unrolled_chunks`, the unrolling `dual._mixings` cuts), zero-padded
to [BT] rows. No slots: the module that holds this template defines `activation`,
`activation_grad` and `bias_grad` (printed from the spec) and the constants `RETAINED` and
`MOMENTUM` (`miras.compiler.triton_dual`).

The state does not fit on chip (Titans at d 64: A and B are 128 KiB in float32, twice that with
momentum), so it lives in float32 global memory, one private copy per (batch, head), updated in
place, and every phase streams it in [HB, DK] / [DV, HB] tiles over the hidden width (HB = 32
or less: `dual_triton.HIDDEN_BLOCK`). The chunk's z1, a1 and e1 ([BT, DH] each) go to a per-program scratch for the later
phases. A program's loads of a tile it has stored are ordered by `tl.debug_barrier()`.
"""

FORWARD = '''
@triton.jit
def chunk_end_tile(w, s, ew, es, x, a_end, c_end, th_end, ACC: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One state tile at a chunk's end: W' = a W - c S + ew x and, with momentum,
    S' = theta S + es x, where ew and es are the layer's errors scaled by the last token's
    mixings (last, last_s), transposed, as operands, and x the layer's inputs [BT, *]. Both
    layers' tiles take this step (A with e1 and X, B with e2 and a1)."""
    new = a_end * w
    if MOMENTUM:
        new -= c_end * s
        s = tl.dot(es, x, th_end * s, input_precision=DOT_PRECISION, out_dtype=ACC)
    new = tl.dot(ew, x, new, input_precision=DOT_PRECISION, out_dtype=ACC)
    return new, s


@triton.jit
def gradient_point(x, d_t, mt, wa_p, wb_p, z1_p, a1_p, DK, DH, DV,
                   BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, HB: tl.constexpr,
                   ACC: tl.constexpr, DOT_PRECISION: tl.constexpr):  # fmt: skip
    """The chunk's gradient point by hidden blocks: z1 = P X A^T and a1 = act(z1) to scratch
    [BT, DH] (zero past the chunk's rows), and y = a1 B^T summed over the blocks, returned
    before the retained point's P (x [BT, BK] keys, d_t [BT] the point's D_t)."""
    OP: tl.constexpr = x.dtype
    rows = tl.arange(0, BT)
    ck = tl.arange(0, BK)
    cv = tl.arange(0, BV)
    ch = tl.arange(0, HB)
    every = rows < BT
    y = tl.zeros([BT, BV], dtype=ACC)
    for j0 in range(0, DH, HB):
        hj = j0 + ch
        mh = hj < DH
        m2 = mt[:, None] & mh[None, :]
        a_t = load_rows(wa_p, hj, mh, ck, ck < DK, DK, 1, 0.0, OP)  # A[j] [HB, BK]
        z1 = tl.dot(x, tl.trans(a_t), input_precision=DOT_PRECISION, out_dtype=ACC)
        if RETAINED:
            z1 = d_t[:, None] * z1
        a1 = tl.where(m2, activation(z1), 0.0)  # [BT, HB]
        store_rows(z1_p, rows, every, hj, mh, DH, tl.where(m2, z1, 0.0))
        store_rows(a1_p, rows, every, hj, mh, DH, a1)
        b_t = load_rows(wb_p, cv, cv < DV, hj, mh, DH, 1, 0.0, OP)  # B[:, j] [BV, HB]
        y = tl.dot(a1.to(OP), tl.trans(b_t), y, input_precision=DOT_PRECISION, out_dtype=ACC)
    return y


@triton.jit
def hidden_error(e2_op, d_t, mt, wb_p, z1_p, e1_p, g1_p, DH, DV,
                 BT: tl.constexpr, BV: tl.constexpr, HB: tl.constexpr, ACC: tl.constexpr,
                 DOT_PRECISION: tl.constexpr, KEEP_G1: tl.constexpr):  # fmt: skip
    """e1 = P (e2 B) act'(z1) by hidden blocks to scratch [BT, DH], z1 read back from it;
    with KEEP_G1 also g1 = e2 B (before P) to g1_p, for the backward's second derivative."""
    rows = tl.arange(0, BT)
    cv = tl.arange(0, BV)
    ch = tl.arange(0, HB)
    every = rows < BT
    for j0 in range(0, DH, HB):
        hj = j0 + ch
        mh = hj < DH
        m2 = mt[:, None] & mh[None, :]
        b_t = load_rows(wb_p, cv, cv < DV, hj, mh, DH, 1, 0.0, e2_op.dtype)  # [BV, HB]
        g1 = tl.dot(e2_op, b_t, input_precision=DOT_PRECISION, out_dtype=ACC)  # [BT, HB]
        g1 = tl.where(m2, g1, 0.0)
        if KEEP_G1:
            store_rows(g1_p, rows, every, hj, mh, DH, g1)
        z1 = load_rows(z1_p, rows, every, hj, mh, DH, 1, 0.0, ACC)
        e1 = g1 * activation_grad(z1)
        if RETAINED:
            e1 = d_t[:, None] * e1
        store_rows(e1_p, rows, every, hj, mh, DH, e1)


@triton.jit
def dual_forward(
    q, k, v, gamma, dec, car, coeff, last, last_s, ends,
    wa, wb, sa, sb, wa_chunks, wb_chunks, sa_chunks, sb_chunks, scratch, o,
    T, CS, NC, DK, DH, DV, EVERY,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, HB: tl.constexpr,
    ACC: tl.constexpr, DOT_PRECISION: tl.constexpr, STORE_STARTS: tl.constexpr,
):
    """The dual form's forward for one (batch, head) a program, walking its chunks.

    q, k [BH, T, DK] (the products' operand dtype), v [BH, T, DV]; gamma (the window's weight),
    dec (D_t) and car (C_t, zero without momentum) [BH, T]; coeff [BH, NC, BT, BT] (K[t, s]
    lr_s, zero outside the chunk), last and last_s [BH, NC, BT] (-K[n-1, s] lr_s and
    L^theta[n-1, s] lr_s), ends [BH, NC, 4] (a, c, theta at the chunk's last token).
    wa [BH, DH, DK], wb [BH, DV, DH] (and sa, sb with momentum): the start state on entry, the
    final state on exit (float32, updated in place). With STORE_STARTS, the start state of every
    EVERY-th chunk (0, EVERY, 2 EVERY, ...) goes to wa_chunks [BH, NS, DH, DK], wb_chunks
    [BH, NS, DV, DH] (sa_chunks, sb_chunks), NS = ceil(NC / EVERY).
    scratch [BH, 3, BT, DH]: z1, a1, e1 of the current chunk. o [BH, T, DV]. Grid (BH,)."""
    OP: tl.constexpr = k.dtype.element_ty  # products' operands: the inputs' dtype (fla's)
    pid = tl.program_id(0).to(tl.int64)
    rows = tl.arange(0, BT)
    ck = tl.arange(0, BK)
    cv = tl.arange(0, BV)
    ch = tl.arange(0, HB)
    mk = ck < DK
    mv = cv < DV
    cmask = mv[None, :]
    wa_p = wa + pid * DH * DK
    wb_p = wb + pid * DV * DH
    sa_p = sa + pid * DH * DK
    sb_p = sb + pid * DV * DH
    z1_p = scratch + pid * 3 * BT * DH
    a1_p = z1_p + BT * DH
    e1_p = a1_p + BT * DH
    every = rows < BT  # scratch rows: all BT (rows past the chunk hold zeros)
    for ic in range(0, NC):
        tok = ic * CS + rows
        mt = (rows < CS) & (tok < T)
        if STORE_STARTS and ic % EVERY == 0:
            cs = pid * tl.cdiv(NC, EVERY) + ic // EVERY  # the start's slot
            for j0 in range(0, DH, HB):
                hj = j0 + ch
                mh = hj < DH
                store_rows(wa_chunks + cs * DH * DK, hj, mh, ck, mk, DK,
                           load_rows(wa_p, hj, mh, ck, mk, DK, 1, 0.0, ACC))
                store_rows(wb_chunks + cs * DV * DH, cv, mv, hj, mh, DH,
                           load_rows(wb_p, cv, mv, hj, mh, DH, 1, 0.0, ACC))
                if MOMENTUM:
                    store_rows(sa_chunks + cs * DH * DK, hj, mh, ck, mk, DK,
                               load_rows(sa_p, hj, mh, ck, mk, DK, 1, 0.0, ACC))
                    store_rows(sb_chunks + cs * DV * DH, cv, mv, hj, mh, DH,
                               load_rows(sb_p, cv, mv, hj, mh, DH, 1, 0.0, ACC))
        x = load_rows(k + pid * T * DK, tok, mt, ck, mk, DK, 1, 0.0, OP)  # [BT, BK]
        d_t = tl.load(dec + pid * T + tok, mask=mt, other=0.0).to(ACC)  # [BT]
        # Phase 1, the gradient point: z1, a1 by hidden blocks (to scratch), y summed over them.
        y = gradient_point(x, d_t, mt, wa_p, wb_p, z1_p, a1_p, DK, DH, DV,
                           BT, BK, BV, HB, ACC, DOT_PRECISION)  # fmt: skip
        if RETAINED:
            y = d_t[:, None] * y
        # Phase 2, the output error: the printed bias gradient, the window's weight.
        vv = load_rows(v + pid * T * DV, tok, mt, cv, mv, DV, 1, 0.0, ACC)  # [BT, BV]
        g_w = tl.load(gamma + pid * T + tok, mask=mt, other=0.0).to(ACC)
        e2 = tl.where(mt[:, None] & cmask, bias_grad(y - vv, vv, cmask) * g_w[:, None], 0.0)
        e2_op = e2.to(OP)
        tl.debug_barrier()  # phase 1's scratch stores are read back below
        # Phase 3, the hidden error e1 = (e2 B[:, j]) * act'(z1) (times D_t: retained).
        hidden_error(e2_op, d_t, mt, wb_p, z1_p, e1_p, e1_p, DH, DV, BT, BV, HB, ACC,
                     DOT_PRECISION, False)  # fmt: skip
        tl.debug_barrier()  # phase 3's e1 stores are read back below
        # Phase 4, the read: both layers' D, C and masked-score terms, by hidden blocks. The
        # row scalings go onto the operands (D_t q, -C_t q, -coeff * Q X^T) so each layer's
        # read is one accumulator chained through its dots.
        qq = load_rows(q + pid * T * DK, tok, mt, ck, mk, DK, 1, 0.0, ACC)  # [BT, BK]
        c_t = tl.load(car + pid * T + tok, mask=mt, other=0.0).to(ACC)
        q_d = (d_t[:, None] * qq).to(OP)
        q_c = (-c_t[:, None] * qq).to(OP)
        mix = load_rows(coeff + (pid * NC + ic) * BT * BT, rows, every, rows, every, BT, 1, 0.0, ACC)
        qx = tl.dot(qq.to(OP), tl.trans(x), input_precision=DOT_PRECISION, out_dtype=ACC)  # [BT, BT]
        qx_op = (-mix * qx).to(OP)
        out = tl.zeros([BT, BV], dtype=ACC)  # D aq B^T - C aq SB^T
        aa = tl.zeros([BT, BT], dtype=ACC)  # aq a1^T
        for j0 in range(0, DH, HB):
            hj = j0 + ch
            mh = hj < DH
            m2 = mt[:, None] & mh[None, :]
            a_t = load_rows(wa_p, hj, mh, ck, mk, DK, 1, 0.0, OP)  # [HB, BK]
            zq = tl.dot(q_d, tl.trans(a_t), input_precision=DOT_PRECISION, out_dtype=ACC)
            if MOMENTUM:
                s_t = load_rows(sa_p, hj, mh, ck, mk, DK, 1, 0.0, OP)
                zq = tl.dot(q_c, tl.trans(s_t), zq, input_precision=DOT_PRECISION, out_dtype=ACC)
            e1 = load_rows(e1_p, rows, every, hj, mh, DH, 1, 0.0, OP)  # [BT, HB]
            zq = tl.dot(qx_op, e1, zq, input_precision=DOT_PRECISION, out_dtype=ACC)
            aq = tl.where(m2, activation(zq), 0.0)  # [BT, HB]
            b_t = load_rows(wb_p, cv, mv, hj, mh, DH, 1, 0.0, OP)  # [BV, HB]
            out = tl.dot((d_t[:, None] * aq).to(OP), tl.trans(b_t), out,
                         input_precision=DOT_PRECISION, out_dtype=ACC)
            if MOMENTUM:
                s_t = load_rows(sb_p, cv, mv, hj, mh, DH, 1, 0.0, OP)
                out = tl.dot((-c_t[:, None] * aq).to(OP), tl.trans(s_t), out,
                             input_precision=DOT_PRECISION, out_dtype=ACC)
            a1 = load_rows(a1_p, rows, every, hj, mh, DH, 1, 0.0, OP)
            aa = tl.dot(aq.to(OP), tl.trans(a1), aa, input_precision=DOT_PRECISION, out_dtype=ACC)
        out = tl.dot((-mix * aa).to(OP), e2_op, out, input_precision=DOT_PRECISION, out_dtype=ACC)
        store_rows(o + pid * T * DV, tok, mt, cv, mv, DV, out)
        tl.debug_barrier()  # phase 4 read every state tile; phase 5 writes them
        # Phase 5, the chunk end, tile by tile in place: the input layer's tiles, then the
        # output layer's (two passes, so that at most two state tiles are live at a time).
        cs = pid * NC + ic
        a_end = tl.load(ends + cs * 4).to(ACC)
        c_end = tl.load(ends + cs * 4 + 1).to(ACC)
        th_end = tl.load(ends + cs * 4 + 2).to(ACC)
        lw = tl.load(last + cs * BT + rows).to(ACC)  # [BT]
        ls = tl.load(last_s + cs * BT + rows).to(ACC)
        for j0 in range(0, DH, HB):
            hj = j0 + ch
            mh = hj < DH
            e1 = load_rows(e1_p, rows, every, hj, mh, DH, 1, 0.0, ACC)  # [BT, HB]
            a_t = load_rows(wa_p, hj, mh, ck, mk, DK, 1, 0.0, ACC)  # [HB, BK]
            s_t = a_t  # read only with momentum
            if MOMENTUM:
                s_t = load_rows(sa_p, hj, mh, ck, mk, DK, 1, 0.0, ACC)
            a_new, s_t = chunk_end_tile(
                a_t, s_t, tl.trans((lw[:, None] * e1).to(OP)), tl.trans((ls[:, None] * e1).to(OP)),
                x, a_end, c_end, th_end, ACC, DOT_PRECISION,
            )
            tl.debug_barrier()  # every thread has read tile j before any writes it
            store_rows(wa_p, hj, mh, ck, mk, DK, a_new)
            if MOMENTUM:
                store_rows(sa_p, hj, mh, ck, mk, DK, s_t)
        e2w = tl.trans((lw[:, None] * e2).to(OP))  # [BV, BT]
        e2s = tl.trans((ls[:, None] * e2).to(OP))
        for j0 in range(0, DH, HB):
            hj = j0 + ch
            mh = hj < DH
            a1 = load_rows(a1_p, rows, every, hj, mh, DH, 1, 0.0, OP)  # [BT, HB]
            b_t = load_rows(wb_p, cv, mv, hj, mh, DH, 1, 0.0, ACC)  # [BV, HB]
            s_t = b_t  # read only with momentum
            if MOMENTUM:
                s_t = load_rows(sb_p, cv, mv, hj, mh, DH, 1, 0.0, ACC)
            b_new, s_t = chunk_end_tile(b_t, s_t, e2w, e2s, a1, a_end, c_end, th_end, ACC, DOT_PRECISION)
            tl.debug_barrier()  # every thread has read tile j before any writes it
            store_rows(wb_p, cv, mv, hj, mh, DH, b_new)
            if MOMENTUM:
                store_rows(sb_p, cv, mv, hj, mh, DH, s_t)
        tl.debug_barrier()  # the next chunk reads the tiles stored above
'''

# The backward, one program per (batch, head) walking the chunks in reverse from the stored
# chunk starts (docs/kernels.md, "Deep memories on the GPU"). Per chunk it recomputes the
# forward's intermediates (z1, a1, e2, g1 = e2 B unscaled, e1, zq, aq a1^T) from the chunk's
# start state, then differentiates the chunk end, the read, the hidden error, the output error
# and the gradient point, in that order: each consumes a gradient the ones before it completed.
# With P the retained point's D_t (1 otherwise):
#
#   chunk end   dA = a dA' (+ -c dA' + theta dSA' into dSA), de1 = lw (X dA'^T) + ls (X dSA'^T),
#               dX += (lw e1) dA' + (ls e1) dSA', da1 = (lw e2) dB' + (ls e2) dSB', de2 likewise
#   read        dR = -dO e2^T: dAA = M dR, dM += AA dR, de2 -= (M AA)^T dO;
#               daq = D (dO B) - C (dO SB) + dAA a1, dzq = daq act'(zq);
#               dB += (D dO)^T aq, dSB -= (C dO)^T aq, dA += (D dzq)^T Q, dSA -= (C dzq)^T Q,
#               dR1 = -dzq e1^T: dM += QX dR1, dQ += (M dR1) X, dX += (M dR1)^T Q,
#               de1 -= (M QX)^T dzq, da1 += dAA^T aq
#   hidden      dg1 = de1 act'(z1), dz1 = de1 P g1 act''(z1), de2 += P dg1 B^T, dB += e2^T P dg1
#   output      dgamma = <de2, bias_grad>, (dy, dV) = bias_vjp(y - V, V, gamma de2)
#   grad point  da1 += P dy B, dB += (P dy)^T a1, dz1 += da1 act'(z1), dA += (P dz1)^T X,
#               dX += P dz1 A  (and dD_t collects every term D_t or P multiplies)
#
# The carried gradients dA, dB, dSA, dSB live in float32 global memory (the program's own copy,
# the final state's gradient on entry and the initial state's on exit), read-modify-written
# tile by tile; the chunk's per-hidden-unit intermediates and gradients go to a per-program
# scratch [7, BT, DH]. Every gate's gradient is written per token or per chunk for torch to
# carry back through the mixing matrices (`dual.unrolled_chunks` under autograd).
BACKWARD = '''
@triton.jit
def dual_backward(
    q, k, v, gamma, dec, car, coeff, last, last_s, ends,
    wa_chunks, wb_chunks, sa_chunks, sb_chunks, do,
    dwa, dwb, dsa, dsb, scratch,
    dq, dk, dv, dgamma, ddec, dcar, dcoeff, dlast, dlast_s, dends,
    T, CS, NC, DK, DH, DV,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, HB: tl.constexpr,
    ACC: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """The dual form's backward for one (batch, head) a program (the block above the kernel).

    Inputs as `dual_forward`'s, the chunk starts it stored (wa_chunks [BH, NC, DH, DK], ...),
    do [BH, T, DV]. dwa [BH, DH, DK], dwb [BH, DV, DH] (dsa, dsb with momentum): the final
    state's gradient on entry, the initial state's on exit (float32, in place). scratch
    [BH, 7, BT, DH]: z1, a1, e1, g1, zq, de1 (then dz1), da1 of the current chunk. Outputs,
    every element written: dq, dk [BH, T, DK], dv [BH, T, DV], dgamma, ddec, dcar [BH, T],
    dcoeff [BH, NC, BT, BT], dlast, dlast_s [BH, NC, BT], dends [BH, NC, 4]. Grid (BH,)."""
    OP: tl.constexpr = k.dtype.element_ty
    pid = tl.program_id(0).to(tl.int64)
    rows = tl.arange(0, BT)
    ck = tl.arange(0, BK)
    cv = tl.arange(0, BV)
    ch = tl.arange(0, HB)
    mk = ck < DK
    mv = cv < DV
    cmask = mv[None, :]
    every = rows < BT
    dwa_p = dwa + pid * DH * DK
    dwb_p = dwb + pid * DV * DH
    dsa_p = dsa + pid * DH * DK
    dsb_p = dsb + pid * DV * DH
    z1_p = scratch + pid * 7 * BT * DH
    a1_p = z1_p + BT * DH
    e1_p = a1_p + BT * DH
    g1_p = e1_p + BT * DH
    zq_p = g1_p + BT * DH
    de1_p = zq_p + BT * DH  # de1, then dz1's second-derivative term
    da1_p = de1_p + BT * DH
    for back in range(0, NC):
        ic = NC - 1 - back
        cs = pid * NC + ic
        tok = ic * CS + rows
        mt = (rows < CS) & (tok < T)
        wa_p = wa_chunks + cs * DH * DK  # the chunk's start state
        wb_p = wb_chunks + cs * DV * DH
        sa_p = sa_chunks + cs * DH * DK
        sb_p = sb_chunks + cs * DV * DH
        x = load_rows(k + pid * T * DK, tok, mt, ck, mk, DK, 1, 0.0, OP)  # [BT, BK]
        qq = load_rows(q + pid * T * DK, tok, mt, ck, mk, DK, 1, 0.0, ACC)
        d_t = tl.load(dec + pid * T + tok, mask=mt, other=0.0).to(ACC)  # [BT]
        c_t = tl.load(car + pid * T + tok, mask=mt, other=0.0).to(ACC)
        g_w = tl.load(gamma + pid * T + tok, mask=mt, other=0.0).to(ACC)
        vv = load_rows(v + pid * T * DV, tok, mt, cv, mv, DV, 1, 0.0, ACC)  # [BT, BV]
        mix = load_rows(coeff + cs * BT * BT, rows, every, rows, every, BT, 1, 0.0, ACC)
        # The forward again, from the chunk's start state: z1, a1, y, e2, g1, e1, zq, aq a1^T.
        y = gradient_point(x, d_t, mt, wa_p, wb_p, z1_p, a1_p, DK, DH, DV,
                           BT, BK, BV, HB, ACC, DOT_PRECISION)  # before the retained point's D_t
        yp = y
        if RETAINED:
            yp = d_t[:, None] * y
        live = mt[:, None] & cmask
        grad_b = tl.where(live, bias_grad(yp - vv, vv, cmask), 0.0)  # [BT, BV]
        e2 = grad_b * g_w[:, None]
        e2_op = e2.to(OP)
        tl.debug_barrier()
        hidden_error(e2_op, d_t, mt, wb_p, z1_p, e1_p, g1_p, DH, DV, BT, BV, HB, ACC,
                     DOT_PRECISION, True)  # fmt: skip
        tl.debug_barrier()
        qx = tl.dot(qq.to(OP), tl.trans(x), input_precision=DOT_PRECISION, out_dtype=ACC)  # [BT, BT]
        q_d = (d_t[:, None] * qq).to(OP)
        q_c = (-c_t[:, None] * qq).to(OP)
        qx_op = (-mix * qx).to(OP)
        aa = tl.zeros([BT, BT], dtype=ACC)  # aq a1^T
        for j0 in range(0, DH, HB):
            hj = j0 + ch
            mh = hj < DH
            m2 = mt[:, None] & mh[None, :]
            a_t = load_rows(wa_p, hj, mh, ck, mk, DK, 1, 0.0, OP)
            zq = tl.dot(q_d, tl.trans(a_t), input_precision=DOT_PRECISION, out_dtype=ACC)
            if MOMENTUM:
                s_t = load_rows(sa_p, hj, mh, ck, mk, DK, 1, 0.0, OP)
                zq = tl.dot(q_c, tl.trans(s_t), zq, input_precision=DOT_PRECISION, out_dtype=ACC)
            e1 = load_rows(e1_p, rows, every, hj, mh, DH, 1, 0.0, OP)
            zq = tl.where(m2, tl.dot(qx_op, e1, zq, input_precision=DOT_PRECISION, out_dtype=ACC), 0.0)
            store_rows(zq_p, rows, every, hj, mh, DH, zq)
            aq = tl.where(m2, activation(zq), 0.0)
            a1 = load_rows(a1_p, rows, every, hj, mh, DH, 1, 0.0, OP)
            aa = tl.dot(aq.to(OP), tl.trans(a1), aa, input_precision=DOT_PRECISION, out_dtype=ACC)
        tl.debug_barrier()
        # The chunk end: W' = a W - c S + (lw e)^T x, S' = theta S + (ls e)^T x per layer.
        a_end = tl.load(ends + cs * 4).to(ACC)
        c_end = tl.load(ends + cs * 4 + 1).to(ACC)
        th_end = tl.load(ends + cs * 4 + 2).to(ACC)
        lw = tl.load(last + cs * BT + rows).to(ACC)  # [BT]
        ls = tl.load(last_s + cs * BT + rows).to(ACC)
        d_a = tl.sum(tl.zeros([BT], dtype=ACC), axis=0)  # the end gates' gradients
        d_c = d_a
        d_th = d_a
        d_lw = tl.zeros([BT], dtype=ACC)
        d_ls = tl.zeros([BT], dtype=ACC)
        dx = tl.zeros([BT, BK], dtype=ACC)
        for j0 in range(0, DH, HB):
            hj = j0 + ch
            mh = hj < DH
            g_a = load_rows(dwa_p, hj, mh, ck, mk, DK, 1, 0.0, ACC)  # dA' [HB, BK]
            a_t = load_rows(wa_p, hj, mh, ck, mk, DK, 1, 0.0, ACC)
            e1 = load_rows(e1_p, rows, every, hj, mh, DH, 1, 0.0, ACC)  # [BT, HB]
            d_a += tl.sum(tl.sum(g_a * a_t, axis=1), axis=0)
            t_w = tl.dot(x, tl.trans(g_a.to(OP)), input_precision=DOT_PRECISION, out_dtype=ACC)
            d_lw += tl.sum(e1 * t_w, axis=1)
            de1 = lw[:, None] * t_w  # [BT, HB]
            dx = tl.dot((lw[:, None] * e1).to(OP), g_a.to(OP), dx,
                        input_precision=DOT_PRECISION, out_dtype=ACC)
            new_a = a_end * g_a
            if MOMENTUM:
                g_s = load_rows(dsa_p, hj, mh, ck, mk, DK, 1, 0.0, ACC)
                s_t = load_rows(sa_p, hj, mh, ck, mk, DK, 1, 0.0, ACC)
                d_c -= tl.sum(tl.sum(g_a * s_t, axis=1), axis=0)
                d_th += tl.sum(tl.sum(g_s * s_t, axis=1), axis=0)
                t_s = tl.dot(x, tl.trans(g_s.to(OP)), input_precision=DOT_PRECISION, out_dtype=ACC)
                d_ls += tl.sum(e1 * t_s, axis=1)
                de1 += ls[:, None] * t_s
                dx = tl.dot((ls[:, None] * e1).to(OP), g_s.to(OP), dx,
                            input_precision=DOT_PRECISION, out_dtype=ACC)
                new_s = th_end * g_s - c_end * g_a
                store_rows(dsa_p, hj, mh, ck, mk, DK, new_s)
            store_rows(dwa_p, hj, mh, ck, mk, DK, new_a)
            store_rows(de1_p, rows, every, hj, mh, DH, de1)
        tb_w = tl.zeros([BT, BV], dtype=ACC)  # a1 dB'^T
        tb_s = tl.zeros([BT, BV], dtype=ACC)  # a1 dSB'^T
        e2w = (lw[:, None] * e2).to(OP)
        e2s = (ls[:, None] * e2).to(OP)
        for j0 in range(0, DH, HB):
            hj = j0 + ch
            mh = hj < DH
            g_b = load_rows(dwb_p, cv, mv, hj, mh, DH, 1, 0.0, ACC)  # dB' [BV, HB]
            b_t = load_rows(wb_p, cv, mv, hj, mh, DH, 1, 0.0, ACC)
            a1 = load_rows(a1_p, rows, every, hj, mh, DH, 1, 0.0, OP)
            d_a += tl.sum(tl.sum(g_b * b_t, axis=1), axis=0)
            tb_w = tl.dot(a1, tl.trans(g_b.to(OP)), tb_w, input_precision=DOT_PRECISION, out_dtype=ACC)
            da1 = tl.dot(e2w, g_b.to(OP), input_precision=DOT_PRECISION, out_dtype=ACC)  # [BT, HB]
            new_b = a_end * g_b
            if MOMENTUM:
                g_s = load_rows(dsb_p, cv, mv, hj, mh, DH, 1, 0.0, ACC)
                s_t = load_rows(sb_p, cv, mv, hj, mh, DH, 1, 0.0, ACC)
                d_c -= tl.sum(tl.sum(g_b * s_t, axis=1), axis=0)
                d_th += tl.sum(tl.sum(g_s * s_t, axis=1), axis=0)
                tb_s = tl.dot(a1, tl.trans(g_s.to(OP)), tb_s, input_precision=DOT_PRECISION, out_dtype=ACC)
                da1 = tl.dot(e2s, g_s.to(OP), da1, input_precision=DOT_PRECISION, out_dtype=ACC)
                new_s = th_end * g_s - c_end * g_b
                store_rows(dsb_p, cv, mv, hj, mh, DH, new_s)
            store_rows(dwb_p, cv, mv, hj, mh, DH, new_b)
            store_rows(da1_p, rows, every, hj, mh, DH, da1)
        d_lw += tl.sum(e2 * tb_w, axis=1)
        d_ls += tl.sum(e2 * tb_s, axis=1)
        de2 = lw[:, None] * tb_w + ls[:, None] * tb_s  # [BT, BV]
        tl.store(dlast + cs * BT + rows, d_lw)
        tl.store(dlast_s + cs * BT + rows, d_ls)
        tl.store(dends + cs * 4, d_a)
        tl.store(dends + cs * 4 + 1, d_c)
        tl.store(dends + cs * 4 + 2, d_th)
        tl.store(dends + cs * 4 + 3, d_a * 0.0)
        tl.debug_barrier()
        # The read: o = D (aq B^T) - C (aq SB^T) - (M AA) e2, zq = D (Q A^T) - C (Q SA^T) - (M QX) e1.
        g_o = load_rows(do + pid * T * DV, tok, mt, cv, mv, DV, 1, 0.0, ACC)  # [BT, BV]
        d_r = -tl.dot(g_o.to(OP), tl.trans(e2_op), input_precision=DOT_PRECISION, out_dtype=ACC)
        d_mix = d_r * aa  # [BT, BT]
        d_aa = (d_r * mix).to(OP)
        de2 = tl.dot(tl.trans((-mix * aa).to(OP)), g_o.to(OP), de2,
                     input_precision=DOT_PRECISION, out_dtype=ACC)
        go_d = tl.trans((d_t[:, None] * g_o).to(OP))  # [BV, BT]
        go_c = tl.trans((-c_t[:, None] * g_o).to(OP))
        g_op = g_o.to(OP)
        d_d = tl.zeros([BT], dtype=ACC)
        d_car = tl.zeros([BT], dtype=ACC)
        qa = tl.zeros([BT, BK], dtype=ACC)  # sum_j dzq_j A_j
        qs = tl.zeros([BT, BK], dtype=ACC)  # sum_j dzq_j SA_j
        d_r1 = tl.zeros([BT, BT], dtype=ACC)  # -dzq e1^T
        for j0 in range(0, DH, HB):
            hj = j0 + ch
            mh = hj < DH
            m2 = mt[:, None] & mh[None, :]
            zq = load_rows(zq_p, rows, every, hj, mh, DH, 1, 0.0, ACC)
            aq = tl.where(m2, activation(zq), 0.0)  # [BT, HB]
            b_t = load_rows(wb_p, cv, mv, hj, mh, DH, 1, 0.0, OP)  # [BV, HB]
            u = tl.dot(g_op, b_t, input_precision=DOT_PRECISION, out_dtype=ACC)  # dO B_j
            d_d += tl.sum(u * aq, axis=1)
            d_aq = d_t[:, None] * u
            a1 = load_rows(a1_p, rows, every, hj, mh, DH, 1, 0.0, OP)
            d_aq = tl.dot(d_aa, a1, d_aq, input_precision=DOT_PRECISION, out_dtype=ACC)
            add_rows(dwb_p, cv, mv, hj, mh, DH,
                     tl.dot(go_d, aq.to(OP), input_precision=DOT_PRECISION, out_dtype=ACC))
            if MOMENTUM:
                s_t = load_rows(sb_p, cv, mv, hj, mh, DH, 1, 0.0, OP)
                w = tl.dot(g_op, s_t, input_precision=DOT_PRECISION, out_dtype=ACC)  # dO SB_j
                d_car -= tl.sum(w * aq, axis=1)
                d_aq -= c_t[:, None] * w
                add_rows(dsb_p, cv, mv, hj, mh, DH,
                         tl.dot(go_c, aq.to(OP), input_precision=DOT_PRECISION, out_dtype=ACC))
            add_rows(da1_p, rows, every, hj, mh, DH,
                     tl.dot(tl.trans(d_aa), aq.to(OP), input_precision=DOT_PRECISION, out_dtype=ACC))
            d_zq = tl.where(m2, d_aq * activation_grad(zq), 0.0)  # [BT, HB]
            dz_op = d_zq.to(OP)
            a_t = load_rows(wa_p, hj, mh, ck, mk, DK, 1, 0.0, OP)  # [HB, BK]
            qa = tl.dot(dz_op, a_t, qa, input_precision=DOT_PRECISION, out_dtype=ACC)
            add_rows(dwa_p, hj, mh, ck, mk, DK,
                     tl.dot(tl.trans((d_t[:, None] * d_zq).to(OP)), qq.to(OP),
                            input_precision=DOT_PRECISION, out_dtype=ACC))
            if MOMENTUM:
                s_t = load_rows(sa_p, hj, mh, ck, mk, DK, 1, 0.0, OP)
                qs = tl.dot(dz_op, s_t, qs, input_precision=DOT_PRECISION, out_dtype=ACC)
                add_rows(dsa_p, hj, mh, ck, mk, DK,
                         tl.dot(tl.trans((-c_t[:, None] * d_zq).to(OP)), qq.to(OP),
                                input_precision=DOT_PRECISION, out_dtype=ACC))
            e1 = load_rows(e1_p, rows, every, hj, mh, DH, 1, 0.0, OP)
            d_r1 = tl.dot(-dz_op, tl.trans(e1), d_r1, input_precision=DOT_PRECISION, out_dtype=ACC)
            add_rows(de1_p, rows, every, hj, mh, DH,
                     tl.dot(tl.trans(qx_op), dz_op, input_precision=DOT_PRECISION, out_dtype=ACC))
        d_mix += d_r1 * qx
        tl.store(dcoeff + cs * BT * BT + rows[:, None] * BT + rows[None, :], d_mix)
        d_qx = (d_r1 * mix).to(OP)  # [BT, BT]
        g_q = d_t[:, None] * qa - c_t[:, None] * qs
        g_q = tl.dot(d_qx, x, g_q, input_precision=DOT_PRECISION, out_dtype=ACC)
        store_rows(dq + pid * T * DK, tok, mt, ck, mk, DK, g_q)
        d_d += tl.sum(qq * qa, axis=1)
        d_car -= tl.sum(qq * qs, axis=1)
        dx = tl.dot(tl.trans(d_qx), qq.to(OP), dx, input_precision=DOT_PRECISION, out_dtype=ACC)
        tl.debug_barrier()
        # The hidden error e1 = P g1 act'(z1), g1 = e2 B.
        for j0 in range(0, DH, HB):
            hj = j0 + ch
            mh = hj < DH
            m2 = mt[:, None] & mh[None, :]
            de1 = load_rows(de1_p, rows, every, hj, mh, DH, 1, 0.0, ACC)
            g1 = load_rows(g1_p, rows, every, hj, mh, DH, 1, 0.0, ACC)
            z1 = load_rows(z1_p, rows, every, hj, mh, DH, 1, 0.0, ACC)
            d_g1 = tl.where(m2, de1 * activation_grad(z1), 0.0)
            dz1 = de1 * g1 * activation_grad2(z1)
            if RETAINED:
                d_d += tl.sum(d_g1 * g1, axis=1)
                d_g1 = d_t[:, None] * d_g1
                dz1 = d_t[:, None] * dz1
            store_rows(de1_p, rows, every, hj, mh, DH, tl.where(m2, dz1, 0.0))
            b_t = load_rows(wb_p, cv, mv, hj, mh, DH, 1, 0.0, OP)  # [BV, HB]
            dg_op = d_g1.to(OP)
            de2 = tl.dot(dg_op, tl.trans(b_t), de2, input_precision=DOT_PRECISION, out_dtype=ACC)
            add_rows(dwb_p, cv, mv, hj, mh, DH,
                     tl.dot(tl.trans(e2_op), dg_op, input_precision=DOT_PRECISION, out_dtype=ACC))
        # The output error e2 = gamma bias_grad(y - V, V).
        de2 = tl.where(live, de2, 0.0)
        tl.store(dgamma + pid * T + tok, tl.sum(de2 * grad_b, axis=1), mask=mt)
        d_y, d_v = bias_vjp(yp - vv, vv, cmask, de2 * g_w[:, None])
        d_y = tl.where(live, d_y, 0.0)
        store_rows(dv + pid * T * DV, tok, mt, cv, mv, DV, tl.where(live, d_v, 0.0))
        if RETAINED:
            d_d += tl.sum(d_y * y, axis=1)
            d_y = d_t[:, None] * d_y
        dy_op = d_y.to(OP)
        dy_t = tl.trans(dy_op)  # [BV, BT]
        tl.debug_barrier()
        # The gradient point z1 = P X A^T, a1 = act(z1), y = P a1 B^T.
        xa = tl.zeros([BT, BK], dtype=ACC)  # sum_j dz1_j A_j
        for j0 in range(0, DH, HB):
            hj = j0 + ch
            mh = hj < DH
            m2 = mt[:, None] & mh[None, :]
            b_t = load_rows(wb_p, cv, mv, hj, mh, DH, 1, 0.0, OP)
            a1 = load_rows(a1_p, rows, every, hj, mh, DH, 1, 0.0, OP)
            add_rows(dwb_p, cv, mv, hj, mh, DH,
                     tl.dot(dy_t, a1, input_precision=DOT_PRECISION, out_dtype=ACC))
            da1 = load_rows(da1_p, rows, every, hj, mh, DH, 1, 0.0, ACC)
            da1 = tl.dot(dy_op, b_t, da1, input_precision=DOT_PRECISION, out_dtype=ACC)
            z1 = load_rows(z1_p, rows, every, hj, mh, DH, 1, 0.0, ACC)
            dz1 = load_rows(de1_p, rows, every, hj, mh, DH, 1, 0.0, ACC)
            dz1 = tl.where(m2, dz1 + da1 * activation_grad(z1), 0.0)  # dL/dz1
            a_t = load_rows(wa_p, hj, mh, ck, mk, DK, 1, 0.0, OP)
            xa = tl.dot(dz1.to(OP), a_t, xa, input_precision=DOT_PRECISION, out_dtype=ACC)
            if RETAINED:
                dz1 = d_t[:, None] * dz1  # dL/d(X A^T)
            add_rows(dwa_p, hj, mh, ck, mk, DK,
                     tl.dot(tl.trans(dz1.to(OP)), x, input_precision=DOT_PRECISION, out_dtype=ACC))
        if RETAINED:  # z1 = P (X A^T): dP = <dz1, X A^T> = <X, dz1 A> per row
            d_d += tl.sum(x.to(ACC) * xa, axis=1)
            xa = d_t[:, None] * xa
        dx += xa
        store_rows(dk + pid * T * DK, tok, mt, ck, mk, DK, dx)
        tl.store(ddec + pid * T + tok, d_d, mask=mt)
        tl.store(dcar + pid * T + tok, d_car, mask=mt)
        tl.debug_barrier()  # the previous chunk reads the gradients stored above
'''
