"""The poison of uninitialized memory (tests/poison.py), on for this folder by tests/conftest.py:
a buffer read before it is written gives NaN. (Its undoing: tests/test_poison.py, outside the
poisoned folders.)"""

from __future__ import annotations

import torch


def _sum_of_unwritten(n: int) -> torch.Tensor:
    """A buffer of n where only the first half is written, then all of it is read: the bug the
    poison is there to catch."""
    out = torch.empty(n, dtype=torch.float64)
    out[: n // 2] = 1.0
    return out.sum()


def test_a_buffer_read_before_it_is_written_gives_nan():
    assert torch.isnan(_sum_of_unwritten(8))
    x = torch.ones(2, 3, dtype=torch.float32)
    for made in (
        torch.empty_like(x),
        x.new_empty(4),
        torch.empty_strided((2, 3), (3, 1)),
        torch.nn.Parameter(torch.empty(3)).new_empty(2),  # subclasses inherit the patch
    ):
        assert torch.isnan(made).all(), made
    leaf = torch.empty(3, requires_grad=True)  # a leaf: filled under no_grad
    assert leaf.requires_grad and torch.isnan(leaf).all()


def test_integers_get_the_largest_value_and_bools_true():
    assert (torch.empty(3, dtype=torch.int64) == torch.iinfo(torch.int64).max).all()
    assert (torch.empty(3, dtype=torch.uint8) == 255).all()
    assert torch.empty(3, dtype=torch.bool).all()
