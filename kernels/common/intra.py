"""Intra-chunk pieces of the linear path (retention none or l2, per-head decay).

With `log_a` [BT] the log-decays of a chunk (padded rows carry a = 1, log 0, so they neither
decay nor move the chunk's last row): the decay matrix L[t, s] = prod_{s<j<=t} a_j for s <= t,
else 0; k_last[s] = prod_{j>s} a_j (the decay from token s to the chunk's end, L's last row);
D_t = prod_{j<=t} a_j = exp(cumsum(log a)_t).

Every exponent is the sum of the log-decays its factor spans, accumulated, never a difference
of two cumulative sums. exp(cs_t - cs_s) with cs_t = sum_{j<=t} log a_j is the same number in
exact arithmetic, but in float32 cs_t carries an absolute error of about |cs_t| 6e-8: after a
strong decay early in a chunk (cs near -100) the ratio of two later tokens is off by 1e-5
relative, where the segment sum is exact to its own rounding. A sum of log-decays is <= 0, so
no exponent can overflow: every factor lies in [0, 1]. docs/kernels.md, "Precision".
"""

import triton
import triton.language as tl


@triton.jit
def lower_mask(rows):
    """[BT, BT]: s <= t."""
    return rows[:, None] >= rows[None, :]


@triton.jit
def reverse_cumsum(x):
    """[BT] r_s = sum_{t >= s} x_t."""
    return tl.cumsum(x, axis=0, reverse=True)


@triton.jit
def decay_matrix(log_a, rows):
    """[BT, BT] L[t, s] = exp(sum_{s<j<=t} log a_j) on and below the diagonal, exact zeros
    above: the segment sums are a cumulative sum down the rows of log a_j masked to j > s."""
    segment = tl.cumsum(tl.where(rows[:, None] > rows[None, :], log_a[:, None], 0.0), axis=0)
    return tl.where(lower_mask(rows), tl.exp(segment), 0.0)


@triton.jit
def decay_to_end(log_a, rows):
    """[BT] k_last[s] = exp(sum_{j>s} log a_j)."""
    return tl.exp(tl.sum(tl.where(rows[:, None] > rows[None, :], log_a[:, None], 0.0), axis=0))


@triton.jit
def decay_matrix_vjp(pm, rows):
    """[BT] the decay matrix's part of d log a_j, from pm = dL * L [BT, BT]:
    sum_{t>=j} sum_{s<j} pm[t, s], the factors L[t, s] that hold a_j. Linear in pm, so a
    kernel may reduce each product's pm as it comes instead of keeping a [BT, BT] sum."""
    before = rows[:, None] > rows[None, :]  # [j, s]: s < j
    below = tl.cumsum(pm, axis=0, reverse=True)  # [j, s]: sum_{t>=j} pm[t, s]
    return tl.sum(tl.where(before, below, 0.0), axis=1)


@triton.jit
def log_decay_vjp(d_mix, pk, pd, p_all, rows):
    """[BT] d log a_j from the factors' gradients times the factors: d_mix the decay matrix's
    part (`decay_matrix_vjp`), pk = d k_last * k_last [BT], pd = dD * D [BT] and p_all (a
    scalar, for prod_j a_j):

        d log a_j = sum_{t>=j} sum_{s<j} pm[t, s] + sum_{s<j} pk[s] + sum_{t>=j} pd[t] + p_all

    Each sum runs over the factors that hold a_j and no others, so nothing cancels: for a tiny
    a_j, d log a_j = a_j dLoss/da_j stays accurate, and so does da_j = d log a_j / a_j (row
    sums minus column sums of pm would leave float32's rounding of O(1) terms, divided by a_j)."""
    before = rows[:, None] > rows[None, :]  # [j, s]: s < j
    ends = tl.sum(tl.where(before, pk[None, :], 0.0), axis=1)
    return d_mix + ends + reverse_cumsum(pd) + p_all
