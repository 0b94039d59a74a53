"""Elementwise functions that `triton.language` lacks, for the `TritonPrinter`'s output.

Written with `tl.exp`, `tl.log` and `tl.where` only, so they run the same on a GPU and under
`TRITON_INTERPRET=1` (which knows no libdevice). Each equals its torch namesake up to rounding.
"""

import triton
import triton.language as tl


@triton.jit
def sign(x):
    """torch.sign: -1, 0 or 1."""
    return tl.where(x > 0, 1.0, tl.where(x < 0, -1.0, 0.0))


@triton.jit
def tanh(x):
    """(1 - exp(-2|x|)) / (1 + exp(-2|x|)) with the sign of x: no overflow for large |x|."""
    t = tl.exp(-2.0 * tl.abs(x))
    return sign(x) * (1.0 - t) / (1.0 + t)


@triton.jit
def cosh(x):
    return 0.5 * (tl.exp(x) + tl.exp(-x))


@triton.jit
def sinh(x):
    return 0.5 * (tl.exp(x) - tl.exp(-x))


@triton.jit
def asinh(x):
    """sign(x) log(|x| + sqrt(x^2 + 1)): the odd form, accurate for negative x."""
    a = tl.abs(x)
    return sign(x) * tl.log(a + tl.sqrt(a * a + 1.0))


@triton.jit
def softplus(x):
    """log(1 + exp(x)) as max(x, 0) + log(1 + exp(-|x|)): no overflow."""
    return tl.maximum(x, 0.0) + tl.log(1.0 + tl.exp(-tl.abs(x)))


@triton.jit
def soft_threshold(z, t):
    """sign(z) max(|z| - t, 0): the proximal map of t |.| (elastic net)."""
    return sign(z) * tl.maximum(tl.abs(z) - t, 0.0)
