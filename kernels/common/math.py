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
    """sign(x) asinh(|x|): the odd form, accurate for negative x; asinh(a) as
    log1p(a + a^2 / (1 + sqrt(1 + a^2))) (accurate for small a), log(2a) above 1e8 (where
    a^2 would overflow float32 and the 1/(4 a^2) left out is below float64's eps)."""
    a = tl.abs(x)
    small = log1p(a + a * a / (1.0 + tl.sqrt(1.0 + a * a)))
    return sign(x) * tl.where(a > 1e8, tl.log(tl.maximum(a, 1e8)) + 0.6931471805599453, small)


@triton.jit
def softplus(x):
    """log(1 + exp(x)) as max(x, 0) + log(1 + exp(-|x|)): no overflow."""
    return tl.maximum(x, 0.0) + tl.log(1.0 + tl.exp(-tl.abs(x)))


@triton.jit
def soft_threshold(z, t):
    """sign(z) max(|z| - t, 0): the proximal map of t |.| (elastic net)."""
    return sign(z) * tl.maximum(tl.abs(z) - t, 0.0)


@triton.jit
def log1p(x):
    """log(1 + x), accurate for small x: log(u) x / (u - 1) with u = 1 + x rounded (the
    rounding of u cancels), x where u rounds to 1."""
    u = 1.0 + x
    d = u - 1.0
    return tl.where(d == 0.0, x, tl.log(u) * (x / tl.where(d == 0.0, 1.0, d)))


@triton.jit
def expm1(x):
    """exp(x) - 1, accurate for small x: (u - 1) x / log(u) with u = exp(x) rounded, for
    |x| < 1 (x where u rounds to 1); exp(x) - 1 beyond, where nothing cancels."""
    u = tl.exp(tl.minimum(tl.maximum(x, -1.0), 1.0))
    lu = tl.log(u)
    small = tl.where(u == 1.0, x, (u - 1.0) * (x / tl.where(lu == 0.0, 1.0, lu)))
    return tl.where(tl.abs(x) < 1.0, small, tl.exp(x) - 1.0)


@triton.jit
def hypot(a, b):
    """sqrt(a^2 + b^2) as m sqrt(1 + (n/m)^2), m = max(|a|, |b|): no overflow of a^2."""
    m = tl.maximum(tl.abs(a), tl.abs(b))
    n = tl.minimum(tl.abs(a), tl.abs(b))
    r = n / tl.where(m == 0.0, 1.0, m)
    return m * tl.sqrt(1.0 + r * r)


@triton.jit
def logaddexp(a, b):
    """log(exp(a) + exp(b)) as max(a, b) + log1p(exp(-|a - b|)): no overflow."""
    m = tl.maximum(a, b)
    return m + log1p(tl.exp(-tl.abs(a - b)))


@triton.jit
def acosh(x):
    """log(x + sqrt(x^2 - 1)) for x >= 1: log1p(t + sqrt(t (t + 2))), t = x - 1, below 2;
    log(x) + log(1 + sqrt((1 - 1/x)(1 + 1/x))) above (x^2 would overflow)."""
    t = x - 1.0
    r = 1.0 / x
    near = log1p(t + tl.sqrt(t * (t + 2.0)))
    far = tl.log(x) + tl.log(1.0 + tl.sqrt((1.0 - r) * (1.0 + r)))
    return tl.where(x < 2.0, near, far)


@triton.jit
def atanh(x):
    """(log1p(x) - log1p(-x)) / 2: no cancellation in 1 + x for small x."""
    return 0.5 * (log1p(x) - log1p(-x))
