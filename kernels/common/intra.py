"""Intra-chunk pieces of the linear path (retention none or l2, per-head decay).

With `cs` [BT] the cumulative log-decays of a chunk (cs_t = sum_{j<=t} log a_j), the decay
matrix is L[t, s] = prod_{s<j<=t} a_j = exp(cs_t - cs_s) for s <= t, else 0; padded rows carry
a = 1 (log 0), so they neither decay nor move the chunk's last row.
"""

import triton
import triton.language as tl


@triton.jit
def lower_mask(rows):
    """[BT, BT]: s <= t."""
    return rows[:, None] >= rows[None, :]


@triton.jit
def decay_matrix(cs, rows):
    """[BT, BT] L[t, s] = exp(cs_t - cs_s) on and below the diagonal, exact zeros above."""
    lower = lower_mask(rows)
    return tl.where(lower, tl.exp(tl.where(lower, cs[:, None] - cs[None, :], 0.0)), 0.0)


@triton.jit
def reverse_cumsum(x):
    """[BT] r_s = sum_{t >= s} x_t."""
    return tl.cumsum(x, axis=0, reverse=True)
