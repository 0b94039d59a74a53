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
def dual_forward(
    q, k, v, gamma, dec, car, coeff, last, last_s, ends,
    wa, wb, sa, sb, wa_chunks, wb_chunks, sa_chunks, sb_chunks, scratch, o,
    T, CS, NC, DK, DH, DV,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, HB: tl.constexpr,
    ACC: tl.constexpr, DOT_PRECISION: tl.constexpr, STORE_STARTS: tl.constexpr,
):
    """The dual form's forward for one (batch, head) a program, walking its chunks.

    q, k [BH, T, DK] (the products' operand dtype), v [BH, T, DV]; gamma (the window's weight),
    dec (D_t) and car (C_t, zero without momentum) [BH, T]; coeff [BH, NC, BT, BT] (K[t, s]
    lr_s, zero outside the chunk), last and last_s [BH, NC, BT] (-K[n-1, s] lr_s and
    L^theta[n-1, s] lr_s), ends [BH, NC, 4] (a, c, theta at the chunk's last token).
    wa [BH, DH, DK], wb [BH, DV, DH] (and sa, sb with momentum): the start state on entry, the
    final state on exit (float32, updated in place). With STORE_STARTS, each chunk's start state
    goes to wa_chunks [BH, NC, DH, DK], wb_chunks [BH, NC, DV, DH] (sa_chunks, sb_chunks).
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
        if STORE_STARTS:
            for j0 in range(0, DH, HB):
                hj = j0 + ch
                mh = hj < DH
                cs = pid * NC + ic
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
        y = tl.zeros([BT, BV], dtype=ACC)
        for j0 in range(0, DH, HB):
            hj = j0 + ch
            mh = hj < DH
            m2 = mt[:, None] & mh[None, :]
            a_t = load_rows(wa_p, hj, mh, ck, mk, DK, 1, 0.0, OP)  # A[j] [HB, BK]
            z1 = tl.dot(x, tl.trans(a_t), input_precision=DOT_PRECISION, out_dtype=ACC)
            if RETAINED:
                z1 = d_t[:, None] * z1
            a1 = tl.where(m2, activation(z1), 0.0)  # [BT, HB]
            store_rows(z1_p, rows, every, hj, mh, DH, tl.where(m2, z1, 0.0))
            store_rows(a1_p, rows, every, hj, mh, DH, a1)
            b_t = load_rows(wb_p, cv, mv, hj, mh, DH, 1, 0.0, OP)  # B[:, j] [BV, HB]
            y = tl.dot(a1.to(OP), tl.trans(b_t), y, input_precision=DOT_PRECISION, out_dtype=ACC)
        if RETAINED:
            y = d_t[:, None] * y
        # Phase 2, the output error: the printed bias gradient, the window's weight.
        vv = load_rows(v + pid * T * DV, tok, mt, cv, mv, DV, 1, 0.0, ACC)  # [BT, BV]
        g_w = tl.load(gamma + pid * T + tok, mask=mt, other=0.0).to(ACC)
        e2 = tl.where(mt[:, None] & cmask, bias_grad(y - vv, vv, cmask) * g_w[:, None], 0.0)
        e2_op = e2.to(OP)
        tl.debug_barrier()  # phase 1's scratch stores are read back below
        # Phase 3, the hidden error e1 = (e2 B[:, j]) * act'(z1) (times D_t: retained).
        for j0 in range(0, DH, HB):
            hj = j0 + ch
            mh = hj < DH
            m2 = mt[:, None] & mh[None, :]
            b_t = load_rows(wb_p, cv, mv, hj, mh, DH, 1, 0.0, OP)  # [BV, HB]
            g1 = tl.dot(e2_op, b_t, input_precision=DOT_PRECISION, out_dtype=ACC)  # [BT, HB]
            if RETAINED:
                g1 = d_t[:, None] * g1
            z1 = load_rows(z1_p, rows, every, hj, mh, DH, 1, 0.0, ACC)
            store_rows(e1_p, rows, every, hj, mh, DH, tl.where(m2, g1 * activation_grad(z1), 0.0))
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
