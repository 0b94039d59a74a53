"""The general chunk template: any matrix-memory spec (every bias and retention, any update
linear in the gradient and one optimizer state, per-head or per-channel gates, any window).

One program per (batch, head) and block of BV value channels (rows of W; grid (BH, NVB))
walks the chunks in order with its rows of the state W [BV, Dphi] (and the optimizer state S)
in registers: the launcher splits the rows only where they evolve apart (an elementwise bias,
a read of one row at a time), else BV is all of Dv. dq and dk are then sums over the blocks:
each program writes its own part, and the caller adds them. Padded entries of W hold PAD, a
point of the retention's domain, so that no log or division in a printed step sees a value
outside it. Per chunk of CS
tokens starting at state W_S:

    block phase   for each window offset j: Y_j = X_j W_e^T (one matmul; W_e = read(W_S), times
                  the retained decay prod_{s<=t} a_s for grad_at: retained), the printed
                  bias gradient G_j = gamma valid bias_grad(Y_j - V_j, V_j), times `scale`
                  (the step size the update's gradient terms share, lr for gd and momentum):
                  Ghat_j [BT, Dv], kept in a scratch buffer
    token phase   for each token t: G_t = sum_j Ghat_j[t] x_{t,j}^T, the optimizer's lines
                  printed from the compiled linear step (S_t = theta_t S_{t-1} + beta_t G_t,
                  u_t = p_t S_t + q_t G_t: `miras.compiler.triton.OptimizerStep`), then the
                  printed step and map: W_t = retention_map(retention_step(W_{t-1}, u_t,
                  gates_t)), o_t = read(W_t) phi(q_t)

The backward walks the chunks in reverse, recomputes each one from its stored start state
(the token states go to a scratch buffer), runs the token phase backwards through the printed
VJPs and the optimizer's printed backward lines, then the block phase backwards (the printed
bias VJP and two matmuls). Gradients of window rows (k, v, the bias gates, gamma) are
accumulated into zero-filled buffers, because a window row feeds up to c tokens, possibly in
the previous chunk.
"""

FORWARD = '''
@triton.autotune(configs=configs(CHUNK), key=["CS", "DK", "DV"], prune_configs_by=PRUNE)
@triton.jit
def general_forward(
    q, k, v, valid, w0, s0,
    $gate_params
    o, w_out, s_out, w_chunks, s_chunks, g_scratch,
    T, CS, NC, DK, DV,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, ACC: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """q [BH, T, DK]; k [BH, PAST+T, DK]; v [BH, PAST+T, DV]; valid [BH, PAST+T]; w0, s0
    [BH, DV, DK]. Writes o [BH, T, DV], the final state, and the state at each chunk start."""
    pid = tl.program_id(0).to(tl.int64)
    iv = tl.program_id(1)  # the block of value channels (rows of W) this program owns
    part = iv * tl.num_programs(0) + pid  # this program's scratch, and its dq / dk part
    NR = T + PAST
    rows = tl.arange(0, BT)
    lv = tl.arange(0, BV)  # the block's channels, as the scratch buffers index them
    cv = iv * BV + lv
    ck = tl.arange(0, BK)
    mv = cv < DV
    mk = ck < DK
    m2 = mv[:, None] & mk[None, :]
    cmask = mv[None, :]
    st = cv[:, None] * DK + ck[None, :]
    w = tl.load(w0 + pid * DV * DK + st, mask=m2, other=PAD).to(ACC)
    s = tl.zeros([BV, BK], dtype=ACC)
    if MOMENTUM:
        s = tl.load(s0 + pid * DV * DK + st, mask=m2, other=0.0).to(ACC)
    for ic in range(0, NC):
        start = ic * CS
        tl.store(w_chunks + (pid * NC + ic) * DV * DK + st, w.to(w_chunks.dtype.element_ty), mask=m2)
        if MOMENTUM:
            tl.store(s_chunks + (pid * NC + ic) * DV * DK + st, s.to(s_chunks.dtype.element_ty), mask=m2)
        w_e = retention_read(w, m2)
        tok = start + rows
        mt = (rows < CS) & (tok < T)
        # Block phase: every window term's error signal at the chunk-start state.
        $load_scale_block
        if RETAINED:
            $load_decay_block
            kept = tl.cumprod(decay_blk, axis=0)  # prod_{s<=t} a_s within the chunk
        for j in range(0, WINDOW):
            wi = tok + PAST - j
            x = load_rows(k + pid * NR * DK, wi, mt, ck, mk, DK, 1, 0.0, ACC)
            vj = load_rows(v + pid * NR * DV, wi, mt, cv, mv, DV, 1, 0.0, ACC)
            y = tl.dot(x, tl.trans(w_e), input_precision=DOT_PRECISION, out_dtype=ACC)
            if RETAINED:
                y = kept * y
            $load_window_block
            g = bias_grad(y - vj, vj, cmask$bias_args) * g_gamma
            if PAST > 0:
                g = g * tl.load(valid + pid * NR + wi, mask=mt, other=0.0).to(ACC)[:, None]
            g = tl.where(mt[:, None] & cmask, g * scale, 0.0)
            tl.store(g_scratch + ((part * WINDOW + j) * BT + rows[:, None]) * BV + lv[None, :], g)
        tl.debug_barrier()
        # Token phase: the optimizer and the retention step, in order.
        n = tl.minimum(CS, T - start)
        for tt in range(0, n):
            t = start + tt
            upd = tl.zeros([BV, BK], dtype=ACC)
            for j in range(0, WINDOW):
                gj = tl.load(g_scratch + ((part * WINDOW + j) * BT + tt) * BV + lv)
                xj = tl.load(k + (pid * NR + t + PAST - j) * DK + ck, mask=mk, other=0.0).to(ACC)
                upd += gj[:, None] * xj[None, :]
            $load_step_token
            $optimizer_step
            w = tl.where(m2, retention_map(retention_step(w, upd$retention_args), m2), PAD)
            qt = tl.load(q + (pid * T + t) * DK + ck, mask=mk, other=0.0).to(ACC)
            ot = tl.sum(tl.where(m2, retention_read(w, m2) * qt[None, :], 0.0), axis=1)
            tl.store(o + (pid * T + t) * DV + cv, ot.to(o.dtype.element_ty), mask=mv)
        tl.debug_barrier()
    tl.store(w_out + pid * DV * DK + st, w.to(w_out.dtype.element_ty), mask=m2)
    if MOMENTUM:
        tl.store(s_out + pid * DV * DK + st, s.to(s_out.dtype.element_ty), mask=m2)
'''

BACKWARD = '''
@triton.autotune(configs=configs(CHUNK_WIDE), key=["CS", "DK", "DV"], prune_configs_by=PRUNE)
@triton.jit
def general_backward(
    q, k, v, valid, w_chunks, s_chunks, do, dw_out, ds_out,
    $gate_params
    $gate_grad_params
    dq, dk, dv, dw0, ds0,
    g_scratch, dg_scratch, w_scratch, s_scratch,
    T, CS, NC, DK, DV,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, ACC: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Gradients of o and the final state with respect to q, k, v, every gate and the
    initial state. Gate gradients are written per channel [BH, rows, DV]; the caller sums
    them over the channels for a per-head gate."""
    pid = tl.program_id(0).to(tl.int64)
    iv = tl.program_id(1)  # the block of value channels (rows of W) this program owns
    part = iv * tl.num_programs(0) + pid  # this program's scratch, and its dq / dk part
    NR = T + PAST
    rows = tl.arange(0, BT)
    lv = tl.arange(0, BV)  # the block's channels, as the scratch buffers index them
    cv = iv * BV + lv
    ck = tl.arange(0, BK)
    mv = cv < DV
    mk = ck < DK
    m2 = mv[:, None] & mk[None, :]
    cmask = mv[None, :]
    st = cv[:, None] * DK + ck[None, :]
    sst = lv[:, None] * BK + ck[None, :]  # the padded layout of the token-state scratch
    dw = tl.load(dw_out + pid * DV * DK + st, mask=m2, other=0.0).to(ACC)
    ds = tl.zeros([BV, BK], dtype=ACC)
    if MOMENTUM:
        ds = tl.load(ds_out + pid * DV * DK + st, mask=m2, other=0.0).to(ACC)
    # Window rows collect gradients from up to WINDOW tokens: zero them first.
    zero_block(dk + part * NR * DK, NR, DK, ck, mk, BT)
    zero_block(dv + pid * NR * DV, NR, DV, cv, mv, BT)
    $zero_window_grads
    tl.debug_barrier()
    for r in range(0, NC):
        ic = NC - 1 - r
        start = ic * CS
        w_s = tl.load(w_chunks + (pid * NC + ic) * DV * DK + st, mask=m2, other=PAD).to(ACC)
        s_s = tl.zeros([BV, BK], dtype=ACC)
        if MOMENTUM:
            s_s = tl.load(s_chunks + (pid * NC + ic) * DV * DK + st, mask=m2, other=0.0).to(ACC)
        w_e = retention_read(w_s, m2)
        tok = start + rows
        mt = (rows < CS) & (tok < T)
        $load_scale_block
        kept = tl.zeros([BT, BV], dtype=ACC) + 1.0
        if RETAINED:
            $load_decay_block
            kept = tl.cumprod(decay_blk, axis=0)
        # Recompute the block phase.
        for j in range(0, WINDOW):
            wi = tok + PAST - j
            x = load_rows(k + pid * NR * DK, wi, mt, ck, mk, DK, 1, 0.0, ACC)
            vj = load_rows(v + pid * NR * DV, wi, mt, cv, mv, DV, 1, 0.0, ACC)
            y = tl.dot(x, tl.trans(w_e), input_precision=DOT_PRECISION, out_dtype=ACC)
            if RETAINED:
                y = kept * y
            $load_window_block
            g = bias_grad(y - vj, vj, cmask$bias_args) * g_gamma
            if PAST > 0:
                g = g * tl.load(valid + pid * NR + wi, mask=mt, other=0.0).to(ACC)[:, None]
            g = tl.where(mt[:, None] & cmask, g * scale, 0.0)
            tl.store(g_scratch + ((part * WINDOW + j) * BT + rows[:, None]) * BV + lv[None, :], g)
        tl.debug_barrier()
        # Recompute the token states W_t (and S_t) of the chunk into the scratch.
        n = tl.minimum(CS, T - start)
        w = w_s
        s = s_s
        for tt in range(0, n):
            t = start + tt
            upd = tl.zeros([BV, BK], dtype=ACC)
            for j in range(0, WINDOW):
                gj = tl.load(g_scratch + ((part * WINDOW + j) * BT + tt) * BV + lv)
                xj = tl.load(k + (pid * NR + t + PAST - j) * DK + ck, mask=mk, other=0.0).to(ACC)
                upd += gj[:, None] * xj[None, :]
            $load_step_token
            $optimizer_step
            if MOMENTUM:
                tl.store(s_scratch + (part * BT + tt) * BV * BK + sst, s)
            w = tl.where(m2, retention_map(retention_step(w, upd$retention_args), m2), PAD)
            tl.store(w_scratch + (part * BT + tt) * BV * BK + sst, w)
        tl.debug_barrier()
        # The token phase, backwards.
        for i in range(0, n):
            tt = n - 1 - i
            t = start + tt
            w_t = tl.load(w_scratch + (part * BT + tt) * BV * BK + sst)
            w_p = tl.load(w_scratch + (part * BT + tl.maximum(tt - 1, 0)) * BV * BK + sst)
            w_p = tl.where(tt > 0, w_p, w_s)
            qt = tl.load(q + (pid * T + t) * DK + ck, mask=mk, other=0.0).to(ACC)
            dot_ = tl.load(do + (pid * T + t) * DV + cv, mask=mv, other=0.0).to(ACC)
            dqt = tl.sum(tl.where(m2, retention_read(w_t, m2) * dot_[:, None], 0.0), axis=0)
            tl.store(dq + (part * T + t) * DK + ck, dqt.to(dq.dtype.element_ty), mask=mk)
            dw = dw + retention_read_vjp(w_t, m2, dot_[:, None] * qt[None, :])
            upd = tl.zeros([BV, BK], dtype=ACC)
            for j in range(0, WINDOW):
                gj = tl.load(g_scratch + ((part * WINDOW + j) * BT + tt) * BV + lv)
                xj = tl.load(k + (pid * NR + t + PAST - j) * DK + ck, mask=mk, other=0.0).to(ACC)
                upd += gj[:, None] * xj[None, :]
            $load_step_token
            s_p = s_s
            if MOMENTUM:
                s_p = tl.load(s_scratch + (part * BT + tl.maximum(tt - 1, 0)) * BV * BK + sst)
                s_p = tl.where(tt > 0, s_p, s_s)
            $optimizer_restep
            dz = retention_map_vjp(w_t, m2, dw)
            dw_p, du$retention_grads = retention_vjp(w_p, upd$retention_args, dz)
            $store_step_token_grads
            dw = tl.where(m2, dw_p, 0.0)
            du = tl.where(m2, du, 0.0)
            $optimizer_vjp
            for j in range(0, WINDOW):
                xj = tl.load(k + (pid * NR + t + PAST - j) * DK + ck, mask=mk, other=0.0).to(ACC)
                gj = tl.load(g_scratch + ((part * WINDOW + j) * BT + tt) * BV + lv)
                dgj = tl.sum(du * xj[None, :], axis=1)
                tl.store(dg_scratch + ((part * WINDOW + j) * BT + tt) * BV + lv, dgj)
                add_row(dk + (part * NR + t + PAST - j) * DK, ck, mk, tl.sum(du * gj[:, None], axis=0))
            tl.debug_barrier()
        tl.debug_barrier()
        # The block phase, backwards.
        dw_e = tl.zeros([BV, BK], dtype=ACC)
        d_scale = tl.zeros([BT, BV], dtype=ACC)
        d_kept = tl.zeros([BT, BV], dtype=ACC)
        for j in range(0, WINDOW):
            wi = tok + PAST - j
            x = load_rows(k + pid * NR * DK, wi, mt, ck, mk, DK, 1, 0.0, ACC)
            vj = load_rows(v + pid * NR * DV, wi, mt, cv, mv, DV, 1, 0.0, ACC)
            y0 = tl.dot(x, tl.trans(w_e), input_precision=DOT_PRECISION, out_dtype=ACC)
            y = y0
            if RETAINED:
                y = kept * y0
            $load_window_block
            live = tl.zeros([BT], dtype=ACC) + 1.0
            if PAST > 0:
                live = tl.load(valid + pid * NR + wi, mask=mt, other=0.0).to(ACC)
            mb = mt[:, None] & cmask
            bg = tl.where(mb, bias_grad(y - vj, vj, cmask$bias_args) * live[:, None], 0.0)
            dgh = tl.load(dg_scratch + ((part * WINDOW + j) * BT + rows[:, None]) * BV + lv[None, :], mask=mb, other=0.0)
            d_scale += dgh * g_gamma * bg
            dg = tl.where(mb, scale * dgh, 0.0)
            $add_gamma_grad
            dy, dvj$bias_grads = bias_vjp(y - vj, vj, cmask$bias_args, dg * g_gamma * live[:, None])
            dy = tl.where(mb, dy, 0.0)
            add_rows(dv + pid * NR * DV, wi, mt, cv, mv, DV, dvj)
            $add_bias_grads
            if RETAINED:
                d_kept += dy * y0
                dy = kept * dy
            dw_e += tl.dot(tl.trans(dy), x, input_precision=DOT_PRECISION, out_dtype=ACC)
            add_rows(dk + part * NR * DK, wi, mt, ck, mk, DK, tl.dot(dy, w_e, input_precision=DOT_PRECISION, out_dtype=ACC))
            tl.debug_barrier()
        $store_scale_grad
        if RETAINED:
            # kept_t = prod_{s<=t} a_s: d a_s = sum_{t>=s} d kept_t kept_t / a_s.
            $add_retained_decay_grad
        dw = tl.where(m2, dw + retention_read_vjp(w_s, m2, dw_e), 0.0)
        tl.debug_barrier()
    tl.store(dw0 + pid * DV * DK + st, dw.to(dw0.dtype.element_ty), mask=m2)
    if MOMENTUM:
        tl.store(ds0 + pid * DV * DK + st, ds.to(ds0.dtype.element_ty), mask=m2)
'''
