"""Stable forms (miras/derive/stabilize.py): each cancelling or overflowing shape sympy writes
is printed as the function that computes it accurately, with the same value; exact strings for
the torch and Triton printers, and the emitted cosh Bregman step against mpmath."""

import mpmath
import pytest
import sympy as sp
import torch

from miras.components.retention.bregman import BregmanRetention
from miras.derive.emit import load_module, module_source
from miras.derive.printer import torch_code
from miras.derive.retention_derive import derive_retention
from miras.derive.stabilize import elementary, stable_forms
from miras.derive.symbols import e, softplus, u, v, w, w0
from miras.derive.triton_printer import triton_code

z = sp.sinh(w0) - u  # the cosh potential's mirror point F'(w0) - u

# (sympy's shape, torch source, Triton source)
REWRITES = [
    (
        sp.log(z + sp.sqrt(z**2 + 1)),
        "(-torch.asinh((u - torch.sinh(w0))))",
        "(-asinh((u - sinh(w0))))",
    ),
    (sp.log(e + sp.sqrt(e**2 - 1)), "torch.acosh(e)", "acosh(e)"),
    (sp.log((1 + e) / (1 - e)), "(2*torch.atanh(e))", "(2.0*atanh(e))"),
    (sp.log(1 + sp.exp(e)), "torch.nn.functional.softplus(e)", "softplus(e)"),
    (sp.log(sp.exp(e) + sp.exp(v)), "torch.logaddexp(e, v)", "logaddexp(e, v)"),
    (sp.log(1 + e**2), "torch.log1p((e**2))", "log1p((e*e))"),
    (sp.log(1 - w0), "torch.log1p((-w0))", "log1p((-w0))"),
    (sp.exp(e) - 1, "torch.expm1(e)", "expm1(e)"),
    (3 - 3 * sp.exp(-e) + v, "(v - (3*torch.expm1((-e))))", "(v - (3.0*expm1((-e))))"),
    (sp.sqrt(e**2 + 1), "torch.hypot(e, torch.tensor(1.0, dtype=torch.float64))", "hypot(e, 1.0)"),
    (
        1 / sp.sqrt(4 * e**2 + 1),
        "(1/torch.hypot((2*e), torch.tensor(1.0, dtype=torch.float64)))",
        "(1.0/hypot((2.0*e), 1.0))",
    ),
    (
        sp.log(sp.cosh(e)),
        "(-0.6931471805599453 + torch.abs(e) + torch.nn.functional.softplus((-2*torch.abs(e))))",
        "(-0.6931471805599453 + tl.abs(e) + softplus((-2.0*tl.abs(e))))",
    ),
]

# Shapes that do not cancel, left as sympy wrote them.
LEFT_ALONE = [
    (sp.log(w / (1 - w)), "torch.log((w/(1 - w)))"),  # the logit keeps w's low bits
    (sp.log(e + 2), "torch.log((2 + e))"),
    (sp.sqrt(e**2 + v), "torch.sqrt((v + (e**2)))"),
    (sp.exp(e) - 2, "(-2 + torch.exp(e))"),
]


@pytest.mark.parametrize(("expr", "torch_src", "triton_src"), REWRITES, ids=str)
def test_stable_form_is_printed(expr, torch_src, triton_src):
    assert torch_code(expr) == torch_src
    assert triton_code(expr) == triton_src


@pytest.mark.parametrize(("expr", "src"), LEFT_ALONE, ids=str)
def test_stable_shapes_are_left_alone(expr, src):
    assert stable_forms(expr) == expr
    assert torch_code(expr) == src


@pytest.mark.parametrize(("expr", "torch_src", "triton_src"), REWRITES, ids=str)
def test_stable_form_has_the_same_value(expr, torch_src, triton_src):
    """At points inside each expression's domain, 40 digits: the rewrite is an identity."""
    assert stable_forms(expr) != expr
    stable = elementary(stable_forms(expr))
    R = sp.Rational
    for point in (
        {e: R(3, 10), v: R(-17, 10), u: R(2, 5), w0: R(-5, 2), w: R(1, 5)},
        {e: R(4, 5), v: R(21, 10), u: -3, w0: 7, w: R(9, 10)},
    ):
        if expr == sp.log(e + sp.sqrt(e**2 - 1)):  # acosh: e >= 1
            point = {**point, e: 1 + point[e]}
        want, got = sp.N(expr.subs(point), 40), sp.N(stable.subs(point), 40)
        assert abs(complex(want - got)) <= 1e-30 * max(1.0, abs(complex(want)))


def test_softplus_is_not_rewritten_again():
    assert stable_forms(softplus(e)) == softplus(e)


@pytest.fixture(scope="module")
def cosh_step():
    rule = derive_retention(BregmanRetention(potential="cosh(w)"))
    module = load_module(module_source("test cosh bregman", [rule.source]))
    return rule, module.retention_step


def test_cosh_step_is_emitted_as_asinh(cosh_step):
    rule, _ = cosh_step
    assert "return (-torch.asinh((u - torch.sinh(w0))))" in rule.source
    assert "torch.log(" not in rule.source


@pytest.mark.parametrize(
    ("dtype", "tolerance"), [(torch.float32, 2e-7), (torch.float64, 1e-15)], ids=str
)
def test_cosh_step_is_accurate_across_states(cosh_step, dtype, tolerance):
    """w = asinh(sinh(w0) - u) at w0 in [-40, 40], against mpmath (50 digits) at the same
    rounded inputs. Printed as log(z + sqrt(z^2 + 1)) the step was off by 0.7 at w0 = -9 in
    float32 and -inf at -20 in float64: z + sqrt(z^2 + 1) cancels to 0 for z << 0."""
    _, step = cosh_step
    w0_ = torch.linspace(-40, 40, 321, dtype=dtype).repeat(4)
    u_ = torch.tensor([-3.0, -0.5, 0.5, 3.0], dtype=dtype).repeat_interleave(321)
    got = step(w0_, u_)
    mpmath.mp.dps = 50
    want = torch.tensor(
        [
            float(mpmath.asinh(mpmath.sinh(a) - b))
            for a, b in zip(w0_.tolist(), u_.tolist(), strict=True)
        ],
        dtype=torch.float64,
    )
    assert bool(torch.isfinite(got).all())
    error = ((got.double() - want).abs() / want.abs().clamp_min(1.0)).max()
    assert float(error) <= tolerance
