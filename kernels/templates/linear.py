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

# The forward as fla's chunk kernels split it: the state recurrence alone in a sequential
# kernel (grid (BH, NVB): W_S -> Y_j = X_j W_S^T -> Ghat_j -> W_end, storing each chunk-start
# state and every Ghat_j), then the outputs in a chunk-parallel kernel (grid (NC, BH, NVB)) from
# the stored states and Ghat: o = D (Q W_S^T) - sum_j (L * Q X_j^T) Ghat_j, whose decay
# matrices and masked Q X_j^T products depend on no state and are computed there, per chunk.
# Ghat depends on W_S (through Y_j), so it must come from the state kernel.
FORWARD = '''
@triton.autotune(configs=configs(CHUNK), key=["CS", "DK", "DV"], prune_configs_by=PRUNE)
@triton.jit
def linear_state(
    k, v, valid, w0,
    $gate_params
    ghat, w_out, w_chunks,
    T, CS, NC, DK, DV,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, ACC: tl.constexpr,
    DOT_PRECISION: tl.constexpr, KT: tl.constexpr,
):
    """The sequential half of the forward. k [BH, PAST+T, DK]; v [BH, PAST+T, DV]; valid
    [BH, PAST+T]; w0 [BH, DV, DK]. Writes the error signals ghat [BH, WINDOW, T, DV] (Ghat_j
    at each token), the final state and the state at each chunk start [BH, NC, DV, DK].
    Grid (BH, NVB): with an elementwise bias the rows of W evolve independently, so each
    program may own a block of BV value channels (NVB = 1 otherwise).

    W is held transposed as up to four [KT, BV] key tiles w1..w4 (KT = min(BK, 64); BK <=
    4 KT; fla's state layout), each a variable of its own under a constexpr branch, updated in
    place by Wt_i -= X_i^T (k_last Ghat_j); the keys are read tile by tile as well: a [BV, BK]
    block and the [BT, BK] keys with their per-element pointers do not fit a thread's
    registers at BK = 128."""
    tl.static_assert(BK <= 4 * KT, "the linear state kernel holds at most four key tiles")
    OP: tl.constexpr = k.dtype.element_ty  # products' operands: the inputs' dtype (fla's)
    pid = tl.program_id(0).to(tl.int64)
    iv = tl.program_id(1)  # the block of value channels (rows of W) this program owns
    NR = T + PAST
    rows = tl.arange(0, BT)
    cv = iv * BV + tl.arange(0, BV)
    ckt = tl.arange(0, KT)
    mv = cv < DV
    cmask = mv[None, :]
    base = pid * DV * DK
    w1 = load_tile(w0 + base, cv, mv, 0, ckt, DK, ACC)
    w2 = tl.zeros([KT, BV], dtype=ACC)
    w3 = tl.zeros([KT, BV], dtype=ACC)
    w4 = tl.zeros([KT, BV], dtype=ACC)
    if BK > KT:
        w2 = load_tile(w0 + base, cv, mv, KT, ckt, DK, ACC)
    if BK > 2 * KT:
        w3 = load_tile(w0 + base, cv, mv, 2 * KT, ckt, DK, ACC)
        w4 = load_tile(w0 + base, cv, mv, 3 * KT, ckt, DK, ACC)
    for ic in range(0, NC):
        start = ic * CS
        chunk = w_chunks + (pid * NC + ic) * DV * DK
        store_tile(chunk, cv, mv, 0, ckt, DK, w1)
        if BK > KT:
            store_tile(chunk, cv, mv, KT, ckt, DK, w2)
        if BK > 2 * KT:
            store_tile(chunk, cv, mv, 2 * KT, ckt, DK, w3)
            store_tile(chunk, cv, mv, 3 * KT, ckt, DK, w4)
        tok = start + rows
        mt = (rows < CS) & (tok < T)
        $load_scale_block
        log_a = tl.zeros([BT], dtype=ACC)
        if DECAY:
            $load_decay_vector
            log_a = tl.log(a)
        cs_last = tl.sum(log_a, axis=0)
        k_last = decay_to_end(log_a, rows)  # exp of segment sums, not of cs_t - cs_s
        decay = tl.exp(tl.cumsum(log_a, axis=0))  # D_t, for grad_at: retained
        # Two passes, so one copy of the state is live at a time: every Ghat_j at W_S (stored),
        # then W_S updated in place from them (W_e = D_last W_S - sum_j (k_last Ghat_j)^T X_j).
        for j in range(0, WINDOW):
            wi = tok + PAST - j
            keys = k + pid * NR * DK
            x = load_rows(keys, wi, mt, ckt, ckt < DK, DK, 1, 0.0, OP)
            y = tl.dot(x, w1.to(OP), input_precision=DOT_PRECISION, out_dtype=ACC)
            if BK > KT:
                x = load_rows(keys + KT, wi, mt, ckt, KT + ckt < DK, DK, 1, 0.0, OP)
                y = tl.dot(x, w2.to(OP), y, input_precision=DOT_PRECISION, out_dtype=ACC)
            if BK > 2 * KT:
                x = load_rows(keys + 2 * KT, wi, mt, ckt, 2 * KT + ckt < DK, DK, 1, 0.0, OP)
                y = tl.dot(x, w3.to(OP), y, input_precision=DOT_PRECISION, out_dtype=ACC)
                x = load_rows(keys + 3 * KT, wi, mt, ckt, 3 * KT + ckt < DK, DK, 1, 0.0, OP)
                y = tl.dot(x, w4.to(OP), y, input_precision=DOT_PRECISION, out_dtype=ACC)
            if RETAINED:
                y = decay[:, None] * y
            vj = load_rows(v + pid * NR * DV, wi, mt, cv, mv, DV, 1, 0.0, ACC)
            $load_window_block
            g = bias_grad(y - vj, vj, cmask$bias_args) * g_gamma
            if PAST > 0:
                g = g * tl.load(valid + pid * NR + wi, mask=mt, other=0.0).to(ACC)[:, None]
            gh = tl.where(mt[:, None] & cmask, g * scale, 0.0)
            store_rows(ghat + (pid * WINDOW + j) * T * DV, tok, mt, cv, mv, DV, gh)
        tl.debug_barrier()  # this program's Ghat stores are read back below
        last = tl.exp(cs_last)
        w1 = last * w1
        if BK > KT:
            w2 = last * w2
        if BK > 2 * KT:
            w3 = last * w3
            w4 = last * w4
        for j in range(0, WINDOW):
            wi = tok + PAST - j
            keys = k + pid * NR * DK
            gh = load_rows(ghat + (pid * WINDOW + j) * T * DV, tok, mt, cv, mv, DV, 1, 0.0, ACC)
            ghk = (-gh * k_last[:, None]).to(OP)  # [BT, BV], an operand
            xt = tl.trans(load_rows(keys, wi, mt, ckt, ckt < DK, DK, 1, 0.0, OP))
            w1 = tl.dot(xt, ghk, w1, input_precision=DOT_PRECISION, out_dtype=ACC)
            if BK > KT:
                xt = tl.trans(load_rows(keys + KT, wi, mt, ckt, KT + ckt < DK, DK, 1, 0.0, OP))
                w2 = tl.dot(xt, ghk, w2, input_precision=DOT_PRECISION, out_dtype=ACC)
            if BK > 2 * KT:
                xt = tl.trans(load_rows(keys + 2 * KT, wi, mt, ckt, 2 * KT + ckt < DK, DK, 1, 0.0, OP))
                w3 = tl.dot(xt, ghk, w3, input_precision=DOT_PRECISION, out_dtype=ACC)
                xt = tl.trans(load_rows(keys + 3 * KT, wi, mt, ckt, 3 * KT + ckt < DK, DK, 1, 0.0, OP))
                w4 = tl.dot(xt, ghk, w4, input_precision=DOT_PRECISION, out_dtype=ACC)
    store_tile(w_out + base, cv, mv, 0, ckt, DK, w1)
    if BK > KT:
        store_tile(w_out + base, cv, mv, KT, ckt, DK, w2)
    if BK > 2 * KT:
        store_tile(w_out + base, cv, mv, 2 * KT, ckt, DK, w3)
        store_tile(w_out + base, cv, mv, 3 * KT, ckt, DK, w4)


@triton.autotune(configs=configs(CHUNK), key=["CS", "DK", "DV"], prune_configs_by=PRUNE)
@triton.jit
def linear_output(
    q, k, w_chunks, ghat,
    $gate_params
    o,
    T, CS, NC, DK, DV,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, ACC: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """The chunk-parallel half of the forward: o [BH, T, DV] of one chunk from its start
    state w_chunks [BH, NC, DV, DK] and the error signals ghat [BH, WINDOW, T, DV] (both from
    `linear_state`); q [BH, T, DK], k [BH, PAST+T, DK]. Grid (NC, BH, NVB)."""
    OP: tl.constexpr = q.dtype.element_ty  # products' operands: the inputs' dtype (fla's)
    ic = tl.program_id(0)
    pid = tl.program_id(1).to(tl.int64)
    iv = tl.program_id(2)
    NR = T + PAST
    rows = tl.arange(0, BT)
    cv = iv * BV + tl.arange(0, BV)
    ck = tl.arange(0, BK)
    mv = cv < DV
    mk = ck < DK
    m2 = mv[:, None] & mk[None, :]
    st = cv[:, None] * DK + ck[None, :]
    w = tl.load(w_chunks + (pid * NC + ic) * DV * DK + st, mask=m2, other=0.0).to(ACC)
    start = ic * CS
    tok = start + rows
    mt = (rows < CS) & (tok < T)
    log_a = tl.zeros([BT], dtype=ACC)
    if DECAY:
        $load_decay_vector
        log_a = tl.log(a)
    decay = tl.exp(tl.cumsum(log_a, axis=0))
    mix = decay_matrix(log_a, rows)  # exp of segment sums, not of cs_t - cs_s
    qb = load_rows(q + pid * T * DK, tok, mt, ck, mk, DK, 1, 0.0, OP)
    ob = decay[:, None] * tl.dot(qb, tl.trans(w.to(OP)), input_precision=DOT_PRECISION, out_dtype=ACC)
    for j in range(0, WINDOW):
        x = load_rows(k + pid * NR * DK, tok + PAST - j, mt, ck, mk, DK, 1, 0.0, OP)
        gh = load_rows(ghat + (pid * WINDOW + j) * T * DV, tok, mt, cv, mv, DV, 1, 0.0, OP)
        scores = mix * tl.dot(qb, tl.trans(x), input_precision=DOT_PRECISION, out_dtype=ACC)
        ob -= tl.dot(scores.to(OP), gh, input_precision=DOT_PRECISION, out_dtype=ACC)
    store_rows(o + pid * T * DV, tok, mt, cv, mv, DV, ob)
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
