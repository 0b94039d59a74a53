"""TritonPrinter: exact strings for each construct; anything unknown raises. The helpers of
miras.kernels.common.math that printed code calls, against torch (without CUDA under
TRITON_INTERPRET=1, which tests/conftest.py sets before anything imports triton)."""

import pytest
import sympy as sp
import torch
import triton
import triton.language as tl

from miras.derive.printer import UnsupportedExpression
from miras.derive.symbols import (
    ChannelSum,
    e,
    gate_symbol,
    sigmoid,
    soft_threshold,
    softplus,
    u,
    v,
    w0,
)
from miras.derive.triton_printer import triton_code
from miras.kernels.common import math as cm

d = gate_symbol("delta")


@pytest.mark.parametrize(
    ("expr", "code"),
    [
        (e, "e"),
        (sp.Integer(3), "3.0"),
        (sp.Rational(1, 4), "0.25"),
        (e + v, "(e + v)"),
        (e - v, "(e - v)"),
        (-e, "(-e)"),
        (2 * e, "(2.0*e)"),
        (e / 2, "(e/2.0)"),
        (3 * e / 2, "(1.5*e)"),
        (e / v, "(e/v)"),
        (e**2, "(e*e)"),
        (e**3, "(e*e*e)"),
        ((e + v) ** 2, "((e + v)*(e + v))"),
        (e**-2, "(1.0/(e*e))"),
        (1 / e, "(1.0/e)"),
        (sp.sqrt(e), "tl.sqrt(e)"),
        (1 / sp.sqrt(e), "tl.rsqrt(e)"),
        (e ** sp.Rational(3, 2), "tl.exp(1.5*tl.log(e))"),
        (e**d, "tl.exp(delta*tl.log(e))"),
        (sp.exp(e), "tl.exp(e)"),
        (sp.log(e), "tl.log(e)"),
        (sp.Abs(e), "tl.abs(e)"),
        (sp.sin(e), "tl.sin(e)"),
        (sp.cos(e), "tl.cos(e)"),
        (sp.erf(e), "tl.erf(e)"),
        (sigmoid(e), "tl.sigmoid(e)"),
        (sp.sign(e), "sign(e)"),
        (sp.tanh(e), "tanh(e)"),
        (sp.cosh(e), "cosh(e)"),
        (sp.sinh(e), "sinh(e)"),
        (sp.asinh(e), "asinh(e)"),
        (softplus(e), "softplus(e)"),
        (sp.exp(2), "7.38905609893065"),
        (sp.Max(e, 0), "tl.maximum(0.0, e)"),
        (sp.Min(e, v), "tl.minimum(e, v)"),
        (sp.Max(e, v, 1), "tl.maximum(tl.maximum(1.0, e), v)"),
        (
            sp.Piecewise((e, sp.Abs(e) <= d), (d * sp.sign(e), True)),
            "tl.where((delta >= tl.abs(e)), e, (delta*sign(e)))",
        ),
        (
            sp.Piecewise((e, e > 0), (v, e < -1), (0, True)),
            "tl.where((e > 0.0), e, tl.where((e < -1.0), v, 0.0))",
        ),
        (sp.And(e > 0, v > 0), "((e > 0.0) & (v > 0.0))"),
        (sp.Or(e > 0, v < 0), "((e > 0.0) | (v < 0.0))"),
        (sp.Heaviside(e), "tl.where(e > 0, 1.0, 0.0)"),
        (
            ChannelSum(e**2),
            "tl.sum(tl.where(cmask, (e*e), 0.0), axis=1, keep_dims=True)",
        ),
        (soft_threshold(w0 - u, d), "soft_threshold((w0 - u), delta)"),
    ],
    ids=str,
)
def test_prints(expr, code):
    assert triton_code(expr) == code


@pytest.mark.parametrize(
    "expr",
    [
        sp.Function("mystery")(e),
        sp.atan(e),
        sp.I * e,
        sp.Integral(e, e),
        sp.Derivative(sp.Function("f")(e), e),
        sp.Piecewise((e, e > 0)),
        e**17,
    ],
    ids=str,
)
def test_unsupported_raises(expr):
    with pytest.raises(UnsupportedExpression):
        triton_code(expr)


@triton.jit
def _apply_helpers(x_ptr, out_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    x = tl.load(x_ptr + i)
    tl.store(out_ptr + 0 * N + i, cm.sign(x))
    tl.store(out_ptr + 1 * N + i, cm.tanh(x))
    tl.store(out_ptr + 2 * N + i, cm.cosh(x))
    tl.store(out_ptr + 3 * N + i, cm.sinh(x))
    tl.store(out_ptr + 4 * N + i, cm.asinh(x))
    tl.store(out_ptr + 5 * N + i, cm.softplus(x))
    tl.store(out_ptr + 6 * N + i, cm.soft_threshold(x, 0.5))


def test_math_helpers_match_torch():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.linspace(-30, 30, 64, dtype=torch.float64, device=device)
    x[31] = 0.0
    out = torch.empty(7, 64, dtype=torch.float64, device=device)
    _apply_helpers[(1,)](x, out, N=64)
    want = [
        torch.sign(x),
        torch.tanh(x),
        torch.cosh(x),
        torch.sinh(x),
        torch.asinh(x),
        torch.nn.functional.softplus(x),
        torch.sign(x) * torch.clamp(x.abs() - 0.5, min=0),
    ]
    names = ["sign", "tanh", "cosh", "sinh", "asinh", "softplus", "soft_threshold"]
    for name, got, expected in zip(names, out, want, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12, msg=name)


@triton.jit
def _apply_stable_helpers(x_ptr, y_ptr, out_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    x = tl.load(x_ptr + i)
    y = tl.load(y_ptr + i)
    tl.store(out_ptr + 0 * N + i, cm.log1p(x))
    tl.store(out_ptr + 1 * N + i, cm.expm1(y))
    tl.store(out_ptr + 2 * N + i, cm.hypot(x, y))
    tl.store(out_ptr + 3 * N + i, cm.logaddexp(x, y))
    tl.store(out_ptr + 4 * N + i, cm.acosh(1.0 + tl.abs(x)))
    tl.store(out_ptr + 5 * N + i, cm.atanh(y / (1.0 + tl.abs(y))))
    tl.store(out_ptr + 6 * N + i, cm.asinh(x * 1e150))


def test_stable_math_helpers_match_torch():
    """The helpers the stable forms print (log1p, expm1, hypot, logaddexp, acosh, atanh) and
    asinh at huge |x| (its x^2 overflowed: inf instead of 346), float64 at tiny and huge
    arguments."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.cat(
        [
            torch.logspace(-12, 2, 32, dtype=torch.float64),
            -torch.logspace(-12, -0.05, 32, dtype=torch.float64),
        ]
    )
    y = torch.cat(
        [
            torch.linspace(-30, 30, 32, dtype=torch.float64),
            torch.logspace(-14, -1, 32, dtype=torch.float64),
        ]
    )
    x, y = x.to(device), y.to(device)
    out = torch.empty(7, 64, dtype=torch.float64, device=device)
    _apply_stable_helpers[(1,)](x, y, out, N=64)
    want = [
        torch.log1p(x),
        torch.expm1(y),
        torch.hypot(x, y),
        torch.logaddexp(x, y),
        torch.acosh(1 + x.abs()),
        torch.atanh(y / (1 + y.abs())),
        torch.asinh(x * 1e150),
    ]
    names = ["log1p", "expm1", "hypot", "logaddexp", "acosh", "atanh", "asinh"]
    for name, got, expected in zip(names, out, want, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=0.0, msg=name)
