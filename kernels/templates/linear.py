"""The linear chunk template: matrix memory, retention none or l2 with a per-head decay, and an
update u_t = lr_t g_t with one step-size gate and no optimizer state (gd; `linear_applies`).

The step W_t = a_t W_{t-1} - lr_t g_t unrolls inside a chunk (docs/chunking.md, the fast path):
with L[t, s] = prod_{s<j<=t} a_j = exp(sum_{s<j<=t} log a_j) (s <= t), D_t = prod_{j<=t} a_j
(`miras.kernels.common.intra`: segment sums of log a, never differences of cumulative sums),

    o   = D (Q W_S^T) - sum_j (L * Q X_j^T) Ghat_j
    W_e = D_last W_S  - sum_j (k_last Ghat_j)^T X_j,      k_last[s] = L[last, s]

where X_j [BT, Dphi] are the keys of window offset j and Ghat_j [BT, Dv] = scale gamma valid
bias_grad(Y_j - V_j, V_j) (scale: the step-size gate lr_t), Y_j = X_j W_S^T (times D for
grad_at: retained). Every product is a
matmul; the only spec-specific code is the printed bias gradient and its VJP.

The backward runs the chunks in reverse from their stored start states and differentiates the
same expressions; the decay's gradient is d log a_j, summed over the factors that hold a_j
(`log_decay_vjp`), divided by a_j.
"""

FORWARD = '''
@triton.autotune(configs=configs(CHUNK), key=["CS", "DK", "DV"], prune_configs_by=PRUNE)
@triton.jit
def linear_forward(
    q, k, v, valid, w0,
    $gate_params
    o, w_out, w_chunks,
    T, CS, NC, DK, DV,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, ACC: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """q [BH, T, DK]; k [BH, PAST+T, DK]; v [BH, PAST+T, DV]; valid [BH, PAST+T]; w0
    [BH, DV, DK]. Writes o [BH, T, DV], the final state and the state at each chunk start.
    Grid (BH, NVB): with an elementwise bias the rows of W evolve independently, so each
    program may own a block of BV value channels (NVB = 1 otherwise)."""
    pid = tl.program_id(0).to(tl.int64)
    iv = tl.program_id(1)  # the block of value channels (rows of W) this program owns
    NR = T + PAST
    rows = tl.arange(0, BT)
    cv = iv * BV + tl.arange(0, BV)
    ck = tl.arange(0, BK)
    mv = cv < DV
    mk = ck < DK
    m2 = mv[:, None] & mk[None, :]
    cmask = mv[None, :]
    st = cv[:, None] * DK + ck[None, :]
    w = tl.load(w0 + pid * DV * DK + st, mask=m2, other=0.0).to(ACC)
    for ic in range(0, NC):
        start = ic * CS
        tl.store(w_chunks + (pid * NC + ic) * DV * DK + st, w.to(w_chunks.dtype.element_ty), mask=m2)
        tok = start + rows
        mt = (rows < CS) & (tok < T)
        $load_scale_block
        log_a = tl.zeros([BT], dtype=ACC)
        if DECAY:
            $load_decay_vector
            log_a = tl.log(a)
        cs = tl.cumsum(log_a, axis=0)
        cs_last = tl.sum(log_a, axis=0)
        decay = tl.exp(cs)
        mix = decay_matrix(log_a, rows)  # exp of segment sums, not of cs_t - cs_s
        k_last = decay_to_end(log_a, rows)
        qb = load_rows(q + pid * T * DK, tok, mt, ck, mk, DK, 1, 0.0, ACC)
        ob = decay[:, None] * tl.dot(qb, tl.trans(w), input_precision=DOT_PRECISION, out_dtype=ACC)
        w_new = tl.exp(cs_last) * w
        for j in range(0, WINDOW):
            wi = tok + PAST - j
            x = load_rows(k + pid * NR * DK, wi, mt, ck, mk, DK, 1, 0.0, ACC)
            vj = load_rows(v + pid * NR * DV, wi, mt, cv, mv, DV, 1, 0.0, ACC)
            y = tl.dot(x, tl.trans(w), input_precision=DOT_PRECISION, out_dtype=ACC)
            if RETAINED:
                y = decay[:, None] * y
            $load_window_block
            g = bias_grad(y - vj, vj, cmask$bias_args) * g_gamma
            if PAST > 0:
                g = g * tl.load(valid + pid * NR + wi, mask=mt, other=0.0).to(ACC)[:, None]
            gh = tl.where(mt[:, None] & cmask, g * scale, 0.0)
            scores = mix * tl.dot(qb, tl.trans(x), input_precision=DOT_PRECISION, out_dtype=ACC)
            ob -= tl.dot(scores, gh, input_precision=DOT_PRECISION, out_dtype=ACC)
            w_new -= tl.dot(tl.trans(gh * k_last[:, None]), x, input_precision=DOT_PRECISION, out_dtype=ACC)
        store_rows(o + pid * T * DV, tok, mt, cv, mv, DV, ob)
        w = tl.where(m2, w_new, 0.0)
    tl.store(w_out + pid * DV * DK + st, w.to(w_out.dtype.element_ty), mask=m2)
'''

BACKWARD = '''
@triton.autotune(configs=configs(CHUNK), key=["CS", "DK", "DV"], prune_configs_by=PRUNE)
@triton.jit
def linear_backward(
    q, k, v, valid, w_chunks, do, dw_out,
    $gate_params
    $gate_grad_params
    dq, dk, dv, dw0,
    T, CS, NC, DK, DV,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, ACC: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Gradients of o and the final state with respect to q, k, v, every gate and the
    initial state. dq [NVB, BH, T, DK] and dk [NVB, BH, PAST+T, DK] hold one part per channel
    block, gate gradients are written per channel [BH, rows, DV] (the decay's, a per-head gate
    here, in each block's first channel); the caller sums parts and channels."""
    pid = tl.program_id(0).to(tl.int64)
    iv = tl.program_id(1)  # the block of value channels (rows of W) this program owns
    NR = T + PAST
    rows = tl.arange(0, BT)
    cv = iv * BV + tl.arange(0, BV)
    ck = tl.arange(0, BK)
    mv = cv < DV
    mk = ck < DK
    m2 = mv[:, None] & mk[None, :]
    cmask = mv[None, :]
    st = cv[:, None] * DK + ck[None, :]
    dw = tl.load(dw_out + pid * DV * DK + st, mask=m2, other=0.0).to(ACC)
    # Window rows collect gradients from up to WINDOW tokens: zero them first.
    # dq and dk are sums over the channel blocks: each block writes its own part.
    part = iv * tl.num_programs(0) + pid
    zero_block(dk + part * NR * DK, NR, DK, ck, mk, BT)
    zero_block(dv + pid * NR * DV, NR, DV, cv, mv, BT)
    $zero_window_grads
    tl.debug_barrier()
    for r in range(0, NC):
        ic = NC - 1 - r
        start = ic * CS
        w = tl.load(w_chunks + (pid * NC + ic) * DV * DK + st, mask=m2, other=0.0).to(ACC)
        tok = start + rows
        mt = (rows < CS) & (tok < T)
        $load_scale_block
        a = tl.zeros([BT], dtype=ACC) + 1.0
        if DECAY:
            $load_decay_vector
        log_a = tl.log(a)
        cs = tl.cumsum(log_a, axis=0)
        cs_last = tl.sum(log_a, axis=0)
        decay = tl.exp(cs)
        mix = decay_matrix(log_a, rows)
        k_last = decay_to_end(log_a, rows)
        qb = load_rows(q + pid * T * DK, tok, mt, ck, mk, DK, 1, 0.0, ACC)
        dob = load_rows(do + pid * T * DV, tok, mt, cv, mv, DV, 1, 0.0, ACC)
        # o = D (Q W^T) - ...; W_e = D_last W - ...
        dod = decay[:, None] * dob
        dqb = tl.dot(dod, w, input_precision=DOT_PRECISION, out_dtype=ACC)
        dw_s = tl.exp(cs_last) * dw + tl.dot(tl.trans(dod), qb, input_precision=DOT_PRECISION, out_dtype=ACC)
        qw = tl.dot(qb, tl.trans(w), input_precision=DOT_PRECISION, out_dtype=ACC)
        d_cs = decay * tl.sum(dob * qw, axis=1)
        d_last = tl.exp(cs_last) * tl.sum(tl.sum(tl.where(m2, dw * w, 0.0), axis=1), axis=0)
        d_mix = tl.zeros([BT, BT], dtype=ACC)
        d_k_last = tl.zeros([BT], dtype=ACC)
        d_scale = tl.zeros([BT, BV], dtype=ACC)
        for j in range(0, WINDOW):
            wi = tok + PAST - j
            x = load_rows(k + pid * NR * DK, wi, mt, ck, mk, DK, 1, 0.0, ACC)
            vj = load_rows(v + pid * NR * DV, wi, mt, cv, mv, DV, 1, 0.0, ACC)
            y0 = tl.dot(x, tl.trans(w), input_precision=DOT_PRECISION, out_dtype=ACC)
            y = y0
            if RETAINED:
                y = decay[:, None] * y0
            $load_window_block
            live = tl.zeros([BT], dtype=ACC) + 1.0
            if PAST > 0:
                live = tl.load(valid + pid * NR + wi, mask=mt, other=0.0).to(ACC)
            mb = mt[:, None] & cmask
            bg = tl.where(mb, bias_grad(y - vj, vj, cmask$bias_args) * live[:, None], 0.0)
            gh = bg * g_gamma * scale
            qx = tl.dot(qb, tl.trans(x), input_precision=DOT_PRECISION, out_dtype=ACC)
            d_scores = -tl.dot(dob, tl.trans(gh), input_precision=DOT_PRECISION, out_dtype=ACC)
            xdw = tl.dot(x, tl.trans(dw), input_precision=DOT_PRECISION, out_dtype=ACC)
            dgh = -tl.dot(tl.trans(mix * qx), dob, input_precision=DOT_PRECISION, out_dtype=ACC) - k_last[:, None] * xdw
            dqx = mix * d_scores
            dqb += tl.dot(dqx, x, input_precision=DOT_PRECISION, out_dtype=ACC)
            dx = tl.dot(tl.trans(dqx), qb, input_precision=DOT_PRECISION, out_dtype=ACC)
            dx -= k_last[:, None] * tl.dot(gh, dw, input_precision=DOT_PRECISION, out_dtype=ACC)
            d_mix += d_scores * qx
            d_k_last -= tl.sum(gh * xdw, axis=1)
            d_scale += dgh * g_gamma * bg
            dg = tl.where(mb, scale * dgh, 0.0)
            $add_gamma_grad
            dy, dvj$bias_grads = bias_vjp(y - vj, vj, cmask$bias_args, dg * g_gamma * live[:, None])
            dy = tl.where(mb, dy, 0.0)
            add_rows(dv + pid * NR * DV, wi, mt, cv, mv, DV, dvj)
            $add_bias_grads
            if RETAINED:
                d_cs += decay * tl.sum(dy * y0, axis=1)
                dy = decay[:, None] * dy
            dw_s += tl.dot(tl.trans(dy), x, input_precision=DOT_PRECISION, out_dtype=ACC)
            dx += tl.dot(dy, w, input_precision=DOT_PRECISION, out_dtype=ACC)
            add_rows(dk + part * NR * DK, wi, mt, ck, mk, DK, dx)
            tl.debug_barrier()
        store_rows(dq + part * T * DK, tok, mt, ck, mk, DK, dqb)
        $store_scale_grad
        if DECAY:
            # mix[t, s] = prod_{s<j<=t} a_j, k_last[s] = prod_{j>s} a_j, D_t = prod_{j<=t} a_j
            # (d_cs: dD * D) and prod_j a_j (d_last); each sum over the factors holding a_j.
            d_log_a = log_decay_vjp(d_mix * mix, d_k_last * k_last, d_cs, d_last, rows)
            d_a = d_log_a / a
            $store_decay_grad
        dw = tl.where(m2, dw_s, 0.0)
        tl.debug_barrier()
    tl.store(dw0 + pid * DV * DK + st, dw.to(dw0.dtype.element_ty), mask=m2)
'''
