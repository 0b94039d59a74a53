"""State maps around the retention step, with their vector-Jacobian products.

The emitted module wraps these in `retention_map` (applied to the step's output: KL's row
softmax, else the identity) and `retention_read` (what reads and gradients see: l_q's
normalization, else the identity). `mask` [BV, BK] marks the real entries of a padded block.
"""

import triton
import triton.language as tl

from miras.kernels.common.io import load_rows


@triton.jit
def row_softmax(z, mask, SCALE: tl.constexpr):
    """SCALE * softmax(z) over each row (the last axis); padded entries give 0."""
    z = tl.where(mask, z, float("-inf"))
    top = tl.max(z, axis=1, keep_dims=True)
    top = tl.where(top > float("-inf"), top, 0.0)  # a row that is all padding
    p = tl.exp(z - top)
    total = tl.sum(p, axis=1, keep_dims=True)
    return tl.where(mask, SCALE * p / tl.where(total > 0, total, 1.0), 0.0)


@triton.jit
def row_softmax_vjp(w, mask, dw, SCALE: tl.constexpr):
    """dz for w = SCALE softmax(z): w * (dw - sum_row(dw * w) / SCALE)."""
    inner = tl.sum(tl.where(mask, dw * w, 0.0), axis=1, keep_dims=True)
    return tl.where(mask, w * (dw - inner / SCALE), 0.0)


@triton.jit
def _root(total, Q: tl.constexpr):
    """total^(1/Q), 0 at 0 (no log of 0)."""
    positive = total > 0
    return tl.where(positive, tl.exp(tl.log(tl.where(positive, total, 1.0)) / Q), 0.0)


@triton.jit
def lq_read(a, mask, power, Q: tl.constexpr, FLOOR: tl.constexpr):
    """W = A / max(||A||_q, FLOOR)^(q-2) over the whole matrix; `power` = |A|^q (printed)."""
    norm = tl.maximum(_root(tl.sum(tl.sum(tl.where(mask, power, 0.0), axis=1), axis=0), Q), FLOOR)
    return tl.where(mask, a * tl.exp((2.0 - Q) * tl.log(norm)), 0.0)


@triton.jit
def lq_read_vjp(a, mask, power, slope, dw, Q: tl.constexpr, FLOOR: tl.constexpr):
    """dA for W = A r, r = n^(2-q), n = ||A||_q: r dW + (2-q) n^(2-2q) <dW, A> A|A|^(q-2),
    the second term only where n > FLOOR (the clamp's gradient). `slope` = A|A|^(q-2)."""
    raw = _root(tl.sum(tl.sum(tl.where(mask, power, 0.0), axis=1), axis=0), Q)
    norm = tl.maximum(raw, FLOOR)
    log_norm = tl.log(norm)
    inner = tl.sum(tl.sum(tl.where(mask, dw * a, 0.0), axis=1), axis=0)
    coeff = tl.where(raw > FLOOR, (2.0 - Q) * tl.exp((2.0 - 2.0 * Q) * log_norm) * inner, 0.0)
    return tl.where(mask, tl.exp((2.0 - Q) * log_norm) * dw + coeff * slope, 0.0)


@triton.jit
def load_tile(ptr, cv, mv, col0, ckt, DK, ACC: tl.constexpr):
    """[KT, BV] key tile of a row-major [DV, DK] state, transposed: W[cv, col0 + ckt]^T (fla's
    [K, V] state layout); padded entries read 0. The linear state kernel holds W as such
    tiles, one per KT = 64 key channels (`linear_state`), so both of its products with the
    keys, X W^T = X Wt and Wt -= X^T Ghat, have 64 rows (a Hopper wgmma's M) and no [BV, DK]
    block (nor its pointer tensor) is ever live."""
    cols = col0 + ckt
    mask = (cols < DK)[:, None] & mv[None, :]
    return tl.load(ptr + cols[:, None] + cv[None, :] * DK, mask=mask, other=0.0).to(ACC)


@triton.jit
def store_tile(ptr, cv, mv, col0, ckt, DK, value):
    """ptr[cv, col0 + ckt] = value^T for a [KT, BV] key tile (`load_tile`'s layout)."""
    cols = col0 + ckt
    mask = (cols < DK)[:, None] & mv[None, :]
    tl.store(ptr + cols[:, None] + cv[None, :] * DK, value.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def load_tiles(ptr, cv, mv, ckt, DK, BK: tl.constexpr, KT: tl.constexpr, ACC: tl.constexpr):
    """A row-major [DV, DK] state as up to four [KT, BV] key tiles (`load_tile`), the ones past
    BK zero: the linear state kernels' layout (BK <= 4 KT)."""
    t1 = load_tile(ptr, cv, mv, 0, ckt, DK, ACC)
    t2 = tl.zeros_like(t1)
    t3 = tl.zeros_like(t1)
    t4 = tl.zeros_like(t1)
    if BK > KT:
        t2 = load_tile(ptr, cv, mv, KT, ckt, DK, ACC)
    if BK > 2 * KT:
        t3 = load_tile(ptr, cv, mv, 2 * KT, ckt, DK, ACC)
        t4 = load_tile(ptr, cv, mv, 3 * KT, ckt, DK, ACC)
    return t1, t2, t3, t4


@triton.jit
def store_tiles(ptr, cv, mv, ckt, DK, t1, t2, t3, t4, BK: tl.constexpr, KT: tl.constexpr):
    """`load_tiles`' inverse: the key tiles t1..t4 (those past BK are not written)."""
    store_tile(ptr, cv, mv, 0, ckt, DK, t1)
    if BK > KT:
        store_tile(ptr, cv, mv, KT, ckt, DK, t2)
    if BK > 2 * KT:
        store_tile(ptr, cv, mv, 2 * KT, ckt, DK, t3)
        store_tile(ptr, cv, mv, 3 * KT, ckt, DK, t4)


@triton.jit
def rows_by_tiles(
    ptr, rows, row_mask, ckt, DK, t1, t2, t3, t4,
    BK: tl.constexpr, KT: tl.constexpr, OP: tl.constexpr, ACC: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """[BR, BV] = X T: X the rows `rows` of a row-major [*, DK] tensor, read as [BR, KT] key
    tiles in the operand dtype OP, times the [KT, BV] key tiles t1..t4 (`load_tile`'s layout;
    those past BK are not read). The state kernels' products of keys with a tiled state."""
    x = load_rows(ptr, rows, row_mask, ckt, ckt < DK, DK, 1, 0.0, OP)
    out = tl.dot(x, t1.to(OP), input_precision=DOT_PRECISION, out_dtype=ACC)
    if BK > KT:
        x = load_rows(ptr + KT, rows, row_mask, ckt, KT + ckt < DK, DK, 1, 0.0, OP)
        out = tl.dot(x, t2.to(OP), out, input_precision=DOT_PRECISION, out_dtype=ACC)
    if BK > 2 * KT:
        x = load_rows(ptr + 2 * KT, rows, row_mask, ckt, 2 * KT + ckt < DK, DK, 1, 0.0, OP)
        out = tl.dot(x, t3.to(OP), out, input_precision=DOT_PRECISION, out_dtype=ACC)
        x = load_rows(ptr + 3 * KT, rows, row_mask, ckt, 3 * KT + ckt < DK, DK, 1, 0.0, OP)
        out = tl.dot(x, t4.to(OP), out, input_precision=DOT_PRECISION, out_dtype=ACC)
    return out


@triton.jit
def tile_plus_rows_t(
    tile, ptr, rows, row_mask, col0, ckt, DK, block,
    OP: tl.constexpr, ACC: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """[KT, BV] tile + X^T block: X the [BR, KT] key tile at column col0 of the rows `rows` of
    a row-major [*, DK] tensor, block [BR, BV] (already in OP). The state kernels' in-place
    update of one key tile, fla's `b_h = tl.dot(b_k, b_v, b_h)`."""
    x = load_rows(ptr + col0, rows, row_mask, ckt, col0 + ckt < DK, DK, 1, 0.0, OP)
    return tl.dot(tl.trans(x), block, tile, input_precision=DOT_PRECISION, out_dtype=ACC)
