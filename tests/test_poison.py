"""tests/poison.py outside the poisoned folders: off here, on inside the block, undone after."""

from __future__ import annotations

import torch

from tests.poison import poisoned_empty

FACTORIES = ("empty", "empty_like", "empty_strided")


def test_poisoned_empty_is_on_inside_the_block_only():
    originals = [getattr(torch, name) for name in FACTORIES]
    assert originals == [getattr(torch._C._VariableFunctions, name) for name in FACTORIES]
    assert "new_empty" not in vars(torch.Tensor)  # this folder is not poisoned
    with poisoned_empty():
        assert [getattr(torch, name) for name in FACTORIES] != originals
        assert torch.isnan(torch.empty(4)).all() and torch.isnan(torch.ones(2).new_empty(3)).all()
    assert [getattr(torch, name) for name in FACTORIES] == originals
    assert "new_empty" not in vars(torch.Tensor)


def test_poisoned_empty_is_undone_when_the_block_raises():
    try:
        with poisoned_empty():
            raise RuntimeError("inside")
    except RuntimeError:
        pass
    assert torch.empty is torch._C._VariableFunctions.empty
    assert "new_empty" not in vars(torch.Tensor)
