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
    w1, w2, w3, w4 = load_tiles(w0 + base, cv, mv, ckt, DK, BK, KT, ACC)
    for ic in range(0, NC):
        start = ic * CS
        chunk = w_chunks + (pid * NC + ic) * DV * DK
        store_tiles(chunk, cv, mv, ckt, DK, w1, w2, w3, w4, BK, KT)
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
    store_tiles(w_out + base, cv, mv, ckt, DK, w1, w2, w3, w4, BK, KT)


@triton.autotune(configs=configs(CHUNK_WIDE), key=["CS", "DK", "DV"], prune_configs_by=PRUNE)
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

# The backward as fla's chunk kernels split it (chunk_bwd_dh, then chunk_bwd_dv and
# chunk_bwd_dqkwg): the gradient of the carried state alone in a sequential kernel over
# (BH, NVB) that walks the chunks in reverse with dW as [KT, BV] key tiles updated in place and
# stores dW at every chunk's end, then every other gradient in chunk-parallel kernels from the
# stored states and their gradients: Q X_j^T over (NC, BH), the value side over (NC, BH, NVB),
# the key side (dq, dk) over (NC, BH, key tiles). The carried gradient is
#
#     dW_S = D_last dW_e + (D dO)^T Q + sum_j dY_j^T X_j
#
# (dW_e at the chunk's end, dW_S at its start): dY_j is the bias VJP's gradient in the
# prediction, zero for a bias whose gradient does not depend on it (CURVED false: dot), where
# the kernel is fla's chunk_bwd_dh. Otherwise it needs the chunk's own
# dGhat_j = -(L * Q X_j^T)^T dO - k_last (X_j dW_e^T), so the sequential kernel computes it
# there, storing dY_j in a scratch buffer between its two passes (one copy of the state's
# gradient is live at a time, as in `linear_state`).
BACKWARD = '''
@triton.autotune(configs=configs(CHUNK), key=["CS", "DK", "DV"], prune_configs_by=PRUNE)
@triton.jit
def linear_state_backward(
    q, k, v, valid, w_chunks, do, dw_out,
    $gate_params
    dy_scratch, dw_chunks, dw0,
    T, CS, NC, DK, DV,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, ACC: tl.constexpr,
    DOT_PRECISION: tl.constexpr, KT: tl.constexpr,
):
    """The sequential half of the backward. q [BH, T, DK], k [BH, PAST+T, DK] (the forward's
    operands), v [BH, PAST+T, DV], w_chunks [BH, NC, DV, DK] (the forward's chunk-start
    states), do [BH, T, DV], dw_out [BH, DV, DK] (the final state's gradient). Writes dW at
    every chunk's end, dw_chunks [BH, NC, DV, DK], and the initial state's, dw0 [BH, DV, DK];
    dy_scratch [BH, WINDOW, T, DV] holds dY_j between the two passes (CURVED only).
    Grid (BH, NVB); dW^T as up to four [KT, BV] key tiles d1..d4 (`linear_state`'s layout)."""
    tl.static_assert(BK <= 4 * KT, "the linear state kernels hold at most four key tiles")
    OP: tl.constexpr = q.dtype.element_ty  # products' operands: the inputs' dtype (fla's)
    pid = tl.program_id(0).to(tl.int64)
    iv = tl.program_id(1)  # the block of value channels (rows of W) this program owns
    NR = T + PAST
    rows = tl.arange(0, BT)
    cv = iv * BV + tl.arange(0, BV)
    ckt = tl.arange(0, KT)
    ck = tl.arange(0, BK)
    mv = cv < DV
    mk = ck < DK
    cmask = mv[None, :]
    base = pid * DV * DK
    d1, d2, d3, d4 = load_tiles(dw_out + base, cv, mv, ckt, DK, BK, KT, ACC)
    queries = q + pid * T * DK
    keys = k + pid * NR * DK
    for r in range(0, NC):
        ic = NC - 1 - r
        start = ic * CS
        chunk = (pid * NC + ic) * DV * DK
        store_tiles(dw_chunks + chunk, cv, mv, ckt, DK, d1, d2, d3, d4, BK, KT)
        tok = start + rows
        mt = (rows < CS) & (tok < T)
        log_a = tl.zeros([BT], dtype=ACC)
        if DECAY:
            $load_decay_vector
            log_a = tl.log(a)
        cs_last = tl.sum(log_a, axis=0)
        decay = tl.exp(tl.cumsum(log_a, axis=0))  # D_t
        dob = load_rows(do + pid * T * DV, tok, mt, cv, mv, DV, 1, 0.0, ACC)
        if CURVED:
            # Pass 1, at dW_e: every dY_j, stored.
            $load_scale_block
            mix = decay_matrix(log_a, rows)
            k_last = decay_to_end(log_a, rows)
            qb = load_rows(queries, tok, mt, ck, mk, DK, 1, 0.0, OP)
            w1, w2, w3, w4 = load_tiles(w_chunks + chunk, cv, mv, ckt, DK, BK, KT, ACC)
            for j in range(0, WINDOW):
                wi = tok + PAST - j
                y = rows_by_tiles(keys, wi, mt, ckt, DK, w1, w2, w3, w4, BK, KT, OP, ACC, DOT_PRECISION)
                if RETAINED:
                    y = decay[:, None] * y
                xdw = rows_by_tiles(keys, wi, mt, ckt, DK, d1, d2, d3, d4, BK, KT, OP, ACC, DOT_PRECISION)
                x = load_rows(keys, wi, mt, ck, mk, DK, 1, 0.0, OP)
                qx = tl.dot(qb, tl.trans(x), input_precision=DOT_PRECISION, out_dtype=ACC)
                dgh = -tl.dot(tl.trans(mix * qx), dob, input_precision=DOT_PRECISION, out_dtype=ACC)
                dgh -= k_last[:, None] * xdw
                vj = load_rows(v + pid * NR * DV, wi, mt, cv, mv, DV, 1, 0.0, ACC)
                $load_window_block
                live = tl.zeros([BT], dtype=ACC) + 1.0
                if PAST > 0:
                    live = tl.load(valid + pid * NR + wi, mask=mt, other=0.0).to(ACC)
                mb = mt[:, None] & cmask
                dg = tl.where(mb, scale * dgh, 0.0)
                dy, dvj$bias_grads = bias_vjp(y - vj, vj, cmask$bias_args, dg * g_gamma * live[:, None])
                dy = tl.where(mb, dy, 0.0)
                if RETAINED:
                    dy = decay[:, None] * dy
                store_rows(dy_scratch + (pid * WINDOW + j) * T * DV, tok, mt, cv, mv, DV, dy)
            tl.debug_barrier()  # this program's dY stores are read back below
        # Pass 2: dW_S = D_last dW_e + (D dO)^T Q + sum_j dY_j^T X_j, in place.
        last = tl.exp(cs_last)
        dod = (decay[:, None] * dob).to(OP)
        d1 = tile_plus_rows_t(last * d1, queries, tok, mt, 0, ckt, DK, dod, OP, ACC, DOT_PRECISION)
        if BK > KT:
            d2 = tile_plus_rows_t(last * d2, queries, tok, mt, KT, ckt, DK, dod, OP, ACC, DOT_PRECISION)
        if BK > 2 * KT:
            d3 = tile_plus_rows_t(last * d3, queries, tok, mt, 2 * KT, ckt, DK, dod, OP, ACC, DOT_PRECISION)
            d4 = tile_plus_rows_t(last * d4, queries, tok, mt, 3 * KT, ckt, DK, dod, OP, ACC, DOT_PRECISION)
        if CURVED:
            for j in range(0, WINDOW):
                wi = tok + PAST - j
                dy = load_rows(dy_scratch + (pid * WINDOW + j) * T * DV, tok, mt, cv, mv, DV, 1, 0.0, OP)
                d1 = tile_plus_rows_t(d1, keys, wi, mt, 0, ckt, DK, dy, OP, ACC, DOT_PRECISION)
                if BK > KT:
                    d2 = tile_plus_rows_t(d2, keys, wi, mt, KT, ckt, DK, dy, OP, ACC, DOT_PRECISION)
                if BK > 2 * KT:
                    d3 = tile_plus_rows_t(d3, keys, wi, mt, 2 * KT, ckt, DK, dy, OP, ACC, DOT_PRECISION)
                    d4 = tile_plus_rows_t(d4, keys, wi, mt, 3 * KT, ckt, DK, dy, OP, ACC, DOT_PRECISION)
    store_tiles(dw0 + base, cv, mv, ckt, DK, d1, d2, d3, d4, BK, KT)


@triton.autotune(configs=configs(CHUNK), key=["CS", "DK"], prune_configs_by=PRUNE)
@triton.jit
def linear_scores(
    q, k, qx_rows,
    T, CS, NC, DK,
    BT: tl.constexpr, BK: tl.constexpr, ACC: tl.constexpr, DOT_PRECISION: tl.constexpr,
    KT: tl.constexpr,
):
    """Q X_j^T [BT, BT] of one chunk for every window offset j (fla's A = Q K^T of its
    backward), into qx_rows [WINDOW, BH, NC, BT, BT]: the product no value block changes,
    computed once for `linear_backward`'s value blocks, which read it instead of each
    contracting the key axis for it. Grid (NC, BH)."""
    OP: tl.constexpr = q.dtype.element_ty  # products' operands: the inputs' dtype (fla's)
    ic = tl.program_id(0)
    pid = tl.program_id(1).to(tl.int64)
    BH = tl.num_programs(1)
    NR = T + PAST
    rows = tl.arange(0, BT)
    ckt = tl.arange(0, KT)
    tok = ic * CS + rows
    mt = (rows < CS) & (tok < T)
    for j in range(0, WINDOW):
        qx = tl.zeros([BT, BT], dtype=ACC)
        for c0 in range(0, BK, KT):
            cols = c0 + ckt
            mc = cols < DK
            qt = load_rows(q + pid * T * DK, tok, mt, cols, mc, DK, 1, 0.0, OP)
            xt = load_rows(k + pid * NR * DK, tok + PAST - j, mt, cols, mc, DK, 1, 0.0, OP)
            qx = tl.dot(qt, tl.trans(xt), qx, input_precision=DOT_PRECISION, out_dtype=ACC)
        block = qx_rows + ((j * BH + pid) * NC + ic) * BT * BT
        tl.store(block + rows[:, None] * BT + rows[None, :], qx)


@triton.autotune(configs=configs(CHUNK_WIDE), key=["CS", "DK", "DV"], prune_configs_by=PRUNE)
@triton.jit
def linear_backward(
    q, k, v, valid, w_chunks, dw_chunks, do, qx_rows,
    $gate_params
    $gate_grad_params
    dv, decays, dqx_parts, gk_rows, dy_rows,
    T, CS, NC, DK, DV,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, ACC: tl.constexpr,
    DOT_PRECISION: tl.constexpr, KT: tl.constexpr,
):
    """The chunk-parallel value side of the backward (fla's chunk_bwd_dv with the gates'
    gradients): for one chunk, from its start state w_chunks and the gradient at its end
    dw_chunks (both [BH, NC, DV, DK]), every gradient on the value side, and what
    `linear_backward_keys` needs for dq and dk. Grid (NC, BH, NVB). Each program writes only
    its own chunk's rows: dv [WINDOW, BH, T, DV] and the window gates' gradients
    [WINDOW, BH, T, DV] one part per window offset j at the token t that reads row
    t + PAST - j (the caller adds them there); the step gates' [BH, T, DV] per channel (the
    decay's, a per-head gate, in each block's first channel). For the keys' kernel: the decay
    D [BH, T] (first value block), dQX_j [NVB, WINDOW, BH, NC, BT, BT] (this block's part),
    -k_last Ghat_j and dY_j (D-scaled where retained) in gk_rows and dy_rows
    [WINDOW, BH, T, DV] (dy_rows: CURVED only).

    The key axis is walked in [*, KT] tiles to contract it (Q W^T, X W^T, X dW^T); Q X_j^T
    comes from `linear_scores`. No key-wide block is ever live, nor any dq or dk tile: they
    spilled beside the [BT, BT] decay and score matrices on sm_80."""
    OP: tl.constexpr = q.dtype.element_ty  # products' operands: the inputs' dtype (fla's)
    ic = tl.program_id(0)
    pid = tl.program_id(1).to(tl.int64)
    iv = tl.program_id(2)  # the block of value channels (rows of W) this program owns
    BH = tl.num_programs(1)
    NR = T + PAST
    rows = tl.arange(0, BT)
    cv = iv * BV + tl.arange(0, BV)
    ckt = tl.arange(0, KT)
    mv = cv < DV
    cmask = mv[None, :]
    state = (pid * NC + ic) * DV * DK  # W_S and dW_e of this chunk: [DV, DK] row-major
    queries = q + pid * T * DK
    keys = k + pid * NR * DK
    start = ic * CS
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
    if DECAY:
        if iv == 0:
            tl.store(decays + pid * T + tok, decay, mask=mt)
    dob = load_rows(do + pid * T * DV, tok, mt, cv, mv, DV, 1, 0.0, ACC)
    # o = D (Q W^T) - ...; W_e = D_last W - ...
    qw = tl.zeros([BT, BV], dtype=ACC)
    wdw = tl.zeros([BV], dtype=ACC)
    for c0 in range(0, BK, KT):
        cols = c0 + ckt
        mc = cols < DK
        qt = load_rows(queries, tok, mt, cols, mc, DK, 1, 0.0, OP)
        wt = load_rows(w_chunks + state, cv, mv, cols, mc, DK, 1, 0.0, ACC)
        qw = tl.dot(qt, tl.trans(wt.to(OP)), qw, input_precision=DOT_PRECISION, out_dtype=ACC)
        dwt = load_rows(dw_chunks + state, cv, mv, cols, mc, DK, 1, 0.0, ACC)
        wdw += tl.sum(dwt * wt, axis=1)
    d_cs = decay * tl.sum(dob * qw, axis=1)
    d_last = tl.exp(cs_last) * tl.sum(wdw, axis=0)
    d_mix = tl.zeros([BT], dtype=ACC)  # the decay matrix's part of d log a (decay_matrix_vjp)
    d_k_last = tl.zeros([BT], dtype=ACC)
    d_scale = tl.zeros([BT, BV], dtype=ACC)
    for j in range(0, WINDOW):
        wi = tok + PAST - j
        y0 = tl.zeros([BT, BV], dtype=ACC)
        xdw = tl.zeros([BT, BV], dtype=ACC)
        for c0 in range(0, BK, KT):
            cols = c0 + ckt
            mc = cols < DK
            xt = load_rows(keys, wi, mt, cols, mc, DK, 1, 0.0, OP)
            if CURVED:  # the bias gradient reads the prediction
                wt = load_rows(w_chunks + state, cv, mv, cols, mc, DK, 1, 0.0, OP)
                y0 = tl.dot(xt, tl.trans(wt), y0, input_precision=DOT_PRECISION, out_dtype=ACC)
            dwt = load_rows(dw_chunks + state, cv, mv, cols, mc, DK, 1, 0.0, OP)
            xdw = tl.dot(xt, tl.trans(dwt), xdw, input_precision=DOT_PRECISION, out_dtype=ACC)
        # The decay matrices, here: live from the contraction on, not across it.
        mix = decay_matrix(log_a, rows)
        k_last = decay_to_end(log_a, rows)
        vj = load_rows(v + pid * NR * DV, wi, mt, cv, mv, DV, 1, 0.0, ACC)
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
        # o -= (L * Q X_j^T) Ghat_j: each [BT, BT] factor dies as soon as it is used
        qx = qx_rows + ((j * BH + pid) * NC + ic) * BT * BT
        scores = mix * tl.load(qx + rows[:, None] * BT + rows[None, :])
        dscores = tl.dot(dob, tl.trans(gh), input_precision=DOT_PRECISION, out_dtype=ACC)
        # dq += dQX X_j and dX_j = dQX^T Q - k_last (Ghat_j dW_e) + dY_j W_S: the keys' kernel
        part = j * BH + pid  # this window offset's part of a window row's gradient
        block = dqx_parts + (((iv * WINDOW + j) * BH + pid) * NC + ic) * BT * BT
        tl.store(block + rows[:, None] * BT + rows[None, :], -mix * dscores)
        store_rows(gk_rows + part * T * DV, tok, mt, cv, mv, DV, -k_last[:, None] * gh)
        if DECAY:
            d_mix -= decay_matrix_vjp(scores * dscores, rows)  # dL * L, dL = -dscores * QX
        dgh = -tl.dot(tl.trans(scores), dob, input_precision=DOT_PRECISION, out_dtype=ACC) - k_last[:, None] * xdw
        d_k_last -= tl.sum(gh * xdw, axis=1)
        d_scale += dgh * g_gamma * bg
        dg = tl.where(mb, scale * dgh, 0.0)
        $store_gamma_grad_part
        dy, dvj$bias_grads = bias_vjp(y - vj, vj, cmask$bias_args, dg * g_gamma * live[:, None])
        dy = tl.where(mb, dy, 0.0)
        store_rows(dv + part * T * DV, tok, mt, cv, mv, DV, dvj)
        $store_bias_grad_parts
        if RETAINED:
            d_cs += decay * tl.sum(dy * y0, axis=1)
            dy = decay[:, None] * dy
        if CURVED:
            store_rows(dy_rows + part * T * DV, tok, mt, cv, mv, DV, dy)
    $store_scale_grad
    if DECAY:
        # mix[t, s] = prod_{s<j<=t} a_j, k_last[s] = prod_{j>s} a_j, D_t = prod_{j<=t} a_j
        # (d_cs: dD * D) and prod_j a_j (d_last); each sum over the factors holding a_j.
        d_log_a = log_decay_vjp(d_mix, d_k_last * decay_to_end(log_a, rows), d_cs, d_last, rows)
        d_a = d_log_a / a
        $store_decay_grad


@triton.autotune(configs=configs(CHUNK), key=["CS", "DK", "DV"], prune_configs_by=PRUNE)
@triton.jit
def linear_backward_keys(
    q, k, w_chunks, dw_chunks, do, decays, dqx_parts, gk_rows, dy_rows,
    dq, dk,
    T, CS, NC, DK, DV, NVB,
    BT: tl.constexpr, BV: tl.constexpr, ACC: tl.constexpr,
    DOT_PRECISION: tl.constexpr, KT: tl.constexpr,
):
    """The chunk-parallel key side of the backward (fla's chunk_bwd_dqkwg): dq [BH, T, DK]
    and dk [WINDOW, BH, T, DK] (one part per window offset, as `linear_backward`'s dv) of one
    chunk and one [*, KT] key tile, contracting the value axis BV channels at a time:

        dq   = (D dO) W_S + sum_j dQX_j X_j
        dX_j = dQX_j^T Q + (-k_last Ghat_j) dW_e + dY_j W_S      (dY_j: CURVED only)

    from `linear_backward`'s D, dQX_j (summed over its NVB value-block parts), -k_last Ghat_j
    and dY_j. Grid (NC, BH, key tiles); no two programs write the same element."""
    OP: tl.constexpr = q.dtype.element_ty  # products' operands: the inputs' dtype (fla's)
    ic = tl.program_id(0)
    pid = tl.program_id(1).to(tl.int64)
    ik = tl.program_id(2)  # the key tile (columns of W) this program owns
    BH = tl.num_programs(1)
    NR = T + PAST
    rows = tl.arange(0, BT)
    cols = ik * KT + tl.arange(0, KT)
    mc = cols < DK
    cbv = tl.arange(0, BV)
    state = (pid * NC + ic) * DV * DK  # W_S and dW_e of this chunk: [DV, DK] row-major
    queries = q + pid * T * DK
    keys = k + pid * NR * DK
    tok = ic * CS + rows
    mt = (rows < CS) & (tok < T)
    decay = tl.zeros([BT], dtype=ACC) + 1.0
    if DECAY:
        decay = tl.load(decays + pid * T + tok, mask=mt, other=0.0).to(ACC)
    dqb = tl.zeros([BT, KT], dtype=ACC)
    for v0 in range(0, DV, BV):
        cv = v0 + cbv
        mv = cv < DV
        dod = decay[:, None] * load_rows(do + pid * T * DV, tok, mt, cv, mv, DV, 1, 0.0, ACC)
        wt = load_rows(w_chunks + state, cv, mv, cols, mc, DK, 1, 0.0, OP)  # [BV, KT]
        dqb = tl.dot(dod.to(OP), wt, dqb, input_precision=DOT_PRECISION, out_dtype=ACC)
    qb = load_rows(queries, tok, mt, cols, mc, DK, 1, 0.0, OP)
    for j in range(0, WINDOW):
        wi = tok + PAST - j
        part = j * BH + pid
        dqx = tl.zeros([BT, BT], dtype=ACC)
        for b in range(0, NVB):
            block = dqx_parts + (((b * WINDOW + j) * BH + pid) * NC + ic) * BT * BT
            dqx += tl.load(block + rows[:, None] * BT + rows[None, :])
        dqx = dqx.to(OP)
        xb = load_rows(keys, wi, mt, cols, mc, DK, 1, 0.0, OP)
        dqb = tl.dot(dqx, xb, dqb, input_precision=DOT_PRECISION, out_dtype=ACC)
        dx = tl.dot(tl.trans(dqx), qb, input_precision=DOT_PRECISION, out_dtype=ACC)
        for v0 in range(0, DV, BV):
            cv = v0 + cbv
            mv = cv < DV
            gk = load_rows(gk_rows + part * T * DV, tok, mt, cv, mv, DV, 1, 0.0, OP)
            dwt = load_rows(dw_chunks + state, cv, mv, cols, mc, DK, 1, 0.0, OP)
            dx = tl.dot(gk, dwt, dx, input_precision=DOT_PRECISION, out_dtype=ACC)
            if CURVED:
                dy = load_rows(dy_rows + part * T * DV, tok, mt, cv, mv, DV, 1, 0.0, OP)
                wt = load_rows(w_chunks + state, cv, mv, cols, mc, DK, 1, 0.0, OP)
                dx = tl.dot(dy, wt, dx, input_precision=DOT_PRECISION, out_dtype=ACC)
        store_rows(dk + part * T * DK, tok, mt, cols, mc, DK, dx)
    store_rows(dq + pid * T * DK, tok, mt, cols, mc, DK, dqb)
'''
