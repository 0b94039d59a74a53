"""Uninitialized memory made visible: while `poisoned_empty()` is active, every tensor that
`torch.empty`, `torch.empty_like`, `torch.empty_strided` or `Tensor.new_empty` returns is
filled with NaN (floating and complex dtypes), the dtype's largest value (integers) or True
(bool). A buffer read before it is written then turns the result into NaN (or an index out of
range) instead of whatever the allocator handed back, which is often zeros and passes.

The attributes of the `torch` module and of `torch.Tensor` are replaced, so code that imported
torch before (`torch.empty(...)`, `x.new_empty(...)`) is reached too; a name bound with
`from torch import empty` is not. tests/conftest.py turns it on for every test in the folders
of `POISONED_FOLDERS`.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

import torch

POISONED_FOLDERS = ("runtime", "ops", "models", "kernels")

_FACTORIES = ("empty", "empty_like", "empty_strided")


def fill_poison(x: torch.Tensor) -> torch.Tensor:
    """`x` filled in place with its dtype's poison: NaN, the largest integer, or True."""
    if x.dtype.is_floating_point or x.dtype.is_complex:
        value: float | int | bool = float("nan")
    elif x.dtype == torch.bool:
        value = True
    else:
        value = torch.iinfo(x.dtype).max
    with torch.no_grad():  # a buffer made with requires_grad=True is a leaf
        x.fill_(value)
    return x


def _poisoning(factory: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    @functools.wraps(factory)
    def poisoned(*args, **kwargs):
        return fill_poison(factory(*args, **kwargs))

    return poisoned


@contextlib.contextmanager
def poisoned_empty() -> Iterator[None]:
    """Every uninitialized tensor made inside the block is poisoned; restored on exit."""
    originals = {name: getattr(torch, name) for name in _FACTORIES}
    # new_empty is inherited from torch._C.TensorBase: the patch shadows it in torch.Tensor's
    # own namespace and deleting it there restores the inherited one.
    assert "new_empty" not in vars(torch.Tensor), "already patched"
    try:
        for name, factory in originals.items():
            setattr(torch, name, _poisoning(factory))
        torch.Tensor.new_empty = _poisoning(torch.Tensor.new_empty)
        yield
    finally:
        for name, factory in originals.items():
            setattr(torch, name, factory)
        if "new_empty" in vars(torch.Tensor):
            del torch.Tensor.new_empty
