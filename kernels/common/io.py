"""Row blocks of a row-major [rows, width] tensor, the layout of every kernel input.

A block is `rows` [BR] (row indices) by `cols` [BC] (channel indices); `row_stride` is the
tensor's width and `col_stride` is 1, or 0 for a per-head gate read as if per channel.
"""

import triton
import triton.language as tl


@triton.jit
def load_rows(
    ptr, rows, row_mask, cols, col_mask, row_stride, col_stride, other, ACC: tl.constexpr
):
    """[BR, BC] block in the accumulation dtype; masked entries read as `other`."""
    offsets = rows[:, None] * row_stride + cols[None, :] * col_stride
    mask = row_mask[:, None] & col_mask[None, :]
    return tl.load(ptr + offsets, mask=mask, other=other).to(ACC)


@triton.jit
def store_rows(ptr, rows, row_mask, cols, col_mask, row_stride, value):
    offsets = rows[:, None] * row_stride + cols[None, :]
    mask = row_mask[:, None] & col_mask[None, :]
    tl.store(ptr + offsets, value.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def add_rows(ptr, rows, row_mask, cols, col_mask, row_stride, value):
    """ptr[rows, cols] += value (read-modify-write: one program owns these rows)."""
    offsets = rows[:, None] * row_stride + cols[None, :]
    mask = row_mask[:, None] & col_mask[None, :]
    old = tl.load(ptr + offsets, mask=mask, other=0.0)
    tl.store(ptr + offsets, (old + value).to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def add_row(ptr, cols, col_mask, value):
    """ptr[cols] += value for one row [BC]."""
    old = tl.load(ptr + cols, mask=col_mask, other=0.0)
    tl.store(ptr + cols, (old + value).to(ptr.dtype.element_ty), mask=col_mask)


@triton.jit
def zero_block(ptr, n_rows, row_stride, cols, col_mask, BR: tl.constexpr):
    """ptr[0:n_rows, cols] = 0, BR rows at a time (only these columns: another program may
    own the rest of each row)."""
    rows = tl.arange(0, BR)
    zeros = tl.zeros([BR, cols.shape[0]], dtype=ptr.dtype.element_ty)
    for r0 in range(0, n_rows, BR):
        r = r0 + rows
        mask = (r[:, None] < n_rows) & col_mask[None, :]
        tl.store(ptr + r[:, None] * row_stride + cols[None, :], zeros, mask=mask)
