"""What the Triton backend covers and the kernels it builds: the names, kept where the kernel
compile tool (`miras.runtime.gpu_compile`) and older callers import them from. They live in the
compiler's Triton emission pass, `miras.compiler.triton_kernels`; no module of the runtime's run
path imports this one (tests/test_imports.py)."""

from __future__ import annotations

from miras.compiler.triton_kernels import (
    gate_plan,
    kernel_source,
    linear_applies,
    load_kernels,
    unsupported_reason,
)

__all__ = ["gate_plan", "kernel_source", "linear_applies", "load_kernels", "unsupported_reason"]
