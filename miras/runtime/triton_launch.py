"""What the Triton forms share at a launch: block sizes, NaN-poisoned outputs and the check
that every element was written, the autotuned or pinned launcher, the accumulator type and
tl.dot's precision, and the availability checks. `triton_backend` (the emitted chunk kernels)
and `exact_triton` (the exact form's scan) both launch through these.

Every output buffer is filled with NaN before a launch; with MIRAS_TRITON_CHECK=1 each one is
checked afterwards to hold no NaN, so an element a kernel failed to write is an error.
"""

from __future__ import annotations

import os
from collections import defaultdict

import torch

CHECK_ENV = "MIRAS_TRITON_CHECK"
CONFIG_ENV = "MIRAS_TRITON_CONFIG"  # an autotune config index to run alone


def pow2(n: int) -> int:
    """The block size for n: the next power of two, at least 16 (tl.dot's smallest side)."""
    return max(16, 1 << (max(n, 1) - 1).bit_length())


def poisoned(*shape, like: torch.Tensor) -> torch.Tensor:
    """An output buffer [*shape] in `like`'s dtype and device, filled with NaN."""
    return torch.full(shape, float("nan"), dtype=like.dtype, device=like.device)


def check_written(named: dict[str, torch.Tensor]) -> None:
    """With MIRAS_TRITON_CHECK=1: a RuntimeError naming the first buffer still holding NaN.
    Meta tensors (the compile checks' recorded launches, `miras.checks.gpu_compile`) hold no values and
    are passed over."""
    if os.environ.get(CHECK_ENV, "") in ("", "0"):
        return
    for name, x in named.items():
        if x.is_meta:
            continue
        missing = int(torch.isnan(x).sum())
        if missing:
            raise RuntimeError(
                f"triton backend: {missing} of {x.numel()} elements of {name} were not written "
                "(still NaN after the launch)"
            )


def launcher(kernel, grid):
    """kernel[grid], autotuned over its configs (kernels/common/tuning.py); with
    MIRAS_TRITON_CONFIG=i in the environment, config i alone, untuned (tests compare them).

    A grid with no programs (an empty batch, B = 0: every buffer of the launch is empty, its
    leading axis B*H) launches nothing. Launched, it would compute nothing either, but on a
    GPU the autotuner would time the empty launches and keep its pick for the key (the chunk
    and the widths, not the batch) for every later call. A grid that reads the config's
    block sizes (a callable of the launch's meta) is probed with every block size 1: a block
    count cdiv(n, BLOCK) is 0 exactly when n is, whatever the block."""
    if _no_programs(grid):
        return lambda *args, **meta: None
    pinned = os.environ.get(CONFIG_ENV, "")
    if pinned == "":
        return kernel[grid]
    configs = kernel.configs
    if not pinned.isdigit() or int(pinned) >= len(configs):
        raise ValueError(
            f"{CONFIG_ENV}: expected an index into {kernel.base_fn.__name__}'s "
            f"{len(configs)} autotune configs (0 to {len(configs) - 1}), got {pinned!r}"
        )
    pinned = configs[int(pinned)].all_kwargs()
    return lambda *args, **meta: kernel.fn[grid](*args, **meta, **pinned)


def _no_programs(grid) -> bool:
    return 0 in (grid(defaultdict(lambda: 1)) if callable(grid) else grid)


def accumulator(x: torch.Tensor):
    """The kernels' accumulator type for tensors like x: tl.float64 or tl.float32."""
    import triton.language as tl

    if x.dtype not in (torch.float32, torch.float64):
        # The runtime casts bf16 and fp16 inputs to the float32 state before the kernels, so
        # every buffer, scratch and gradient of a launch is float32: fp16 backward
        # intermediates (products of state, decay and gradient) would overflow at 65504.
        raise TypeError(f"triton kernels: expected float32 or float64 tensors, got {x.dtype}")
    return tl.float64 if x.dtype == torch.float64 else tl.float32


def dot_precision(precision: str, acc) -> str:
    """tl.dot's `input_precision` for tiles in `acc`: the chosen one for float32 tiles;
    float64 tiles multiply in float64 (TF32 does not apply to them), as "ieee" says."""
    import triton.language as tl

    return precision if acc == tl.float32 else "ieee"


def runs_on_cpu() -> bool:
    """Triton's interpreter was asked for (TRITON_INTERPRET=1, before triton is imported)."""
    return os.environ.get("TRITON_INTERPRET", "") == "1"


HALF = (torch.bfloat16, torch.float16)  # input dtypes the kernels take as products' operands


def operands_dtype(inputs: torch.dtype, requested: torch.dtype | None) -> torch.dtype:
    """The dtype q and k go to a kernel in: on a GPU the caller's half dtype `requested` (the
    kernels multiply in the inputs' own dtype, as fla's do, accumulating in float32), where
    the runtime's inputs are its float32 copy; else the inputs' own. Triton's interpreter
    multiplies half-precision tiles wrongly (as integers), so on the CPU they stay float32."""
    if requested in HALF and inputs == torch.float32 and not runs_on_cpu():
        return requested
    return inputs


def _check_device(x: torch.Tensor) -> None:
    if x.device.type == "cpu" and not runs_on_cpu():
        raise ValueError(
            "backend: 'triton' needs CUDA tensors, or TRITON_INTERPRET=1 in the environment "
            "(set before triton is imported) to run its kernels on the CPU; got CPU tensors. "
            "On the CPU use backend='chunk' (parallel) or 'recurrent' (the exact reference)"
        )


def check_available(x: torch.Tensor) -> None:
    """CUDA tensors (or the interpreter) and the triton package, else a ValueError that says
    which backend to use instead."""
    _check_device(x)
    try:
        import triton  # noqa: F401
    except ImportError:
        raise ValueError(
            "backend: 'triton' needs the triton package (Linux x86-64); use backend='chunk' "
            "(parallel) or 'recurrent' (the exact reference)"
        ) from None
