"""miras.derive.numerics: each routine on functions with known roots and minima, the awkward
cases included (a root at a bracket end, two roots and the branch in the domain, flat
regions, NaN, float32 and float64, batched rows), and the call sites that go through it: the
checks' minimizers, the emitted Newton solve (which prints the library's own source), and the
branch choice that Bregman's inverse and a log barrier's two roots share."""

from __future__ import annotations

import inspect
import math
from typing import ClassVar, Literal

import pytest
import torch

import miras
from miras.derive import numerics
from miras.derive.numerics import (
    COORDINATES,
    argmin_rows,
    argmin_separable,
    expand_bracket,
    golden_section,
    golden_section_argmin,
    inside,
    lbfgs_argmin_rows,
    monotone_root,
    newton_minimize,
    safeguarded_newton,
    select_branches,
)

DTYPES = pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
REAL = COORDINATES["real"]


def cbrt(x: torch.Tensor) -> torch.Tensor:
    return torch.sign(x) * x.abs().pow(1 / 3)


class Counted:
    """fn(x) -> (f, f') with a count of its calls."""

    def __init__(self, f, df):
        self.f, self.df, self.calls = f, df, 0

    def __call__(self, x):
        self.calls += 1
        return self.f(x), self.df(x)


# Bracketing ----------------------------------------------------------------------------------


def test_expand_bracket_reaches_a_far_root_on_both_sides():
    f = lambda s: s - torch.tensor([-1e6, 0.5, 3e5], dtype=torch.float64)  # noqa: E731
    start = torch.zeros(3, dtype=torch.float64)
    below = f(start) > 0
    lo, hi = torch.where(below, start - 1, start), torch.where(below, start, start + 1)
    lo, hi = expand_bracket(f, lo, hi, torch.ones(3, dtype=torch.float64))
    assert bool((f(lo) <= 0).all() and (f(hi) >= 0).all())
    assert bool(((hi - lo) <= 2 * (f(lo).abs() + f(hi).abs())).all())  # slid, not widened


def test_expand_bracket_leaves_a_bracket_with_the_root_at_an_end():
    f = lambda s: s - 2.0  # noqa: E731
    lo, hi = torch.tensor([2.0, 1.0]), torch.tensor([3.0, 2.0])
    got = expand_bracket(f, lo, hi, torch.ones(2))
    assert torch.equal(got[0], lo) and torch.equal(got[1], hi)


def test_expand_bracket_backs_off_an_end_where_f_is_nan():
    """f is NaN past s = 10 (the domain's end, as sigmoid(40) = 1.0): the bracket closes in on
    the root at 9.5 instead of stopping with an end where f tells no side."""

    def f(s):
        return torch.where(s > 10, torch.nan, s - 9.5)

    lo, hi = expand_bracket(f, torch.tensor([0.0]), torch.tensor([1.0]), torch.ones(1))
    assert float(f(lo)) <= 0 <= float(f(hi))
    nan = expand_bracket(lambda s: s * torch.nan, torch.tensor([0.0]), torch.tensor([1.0]), 1.0)
    assert [float(nan[0]), float(nan[1])] == [0.0, 1.0]


# Safeguarded Newton --------------------------------------------------------------------------


@DTYPES
def test_newton_from_a_vanishing_derivative_batched(dtype):
    """F' = w^3 from w = 0, where F'' = 0 (plain Newton divides by it): rows x columns."""
    gen = torch.Generator().manual_seed(0)
    z = (torch.randn(6, 7, dtype=torch.float64, generator=gen) * 10).to(dtype)
    fn = Counted(lambda w: w**3 - z, lambda w: 3 * w**2)
    found = monotone_root(fn, torch.zeros_like(z), *REAL)
    tol = 1e-13 if dtype == torch.float64 else 1e-6
    torch.testing.assert_close(found, cbrt(z), rtol=tol, atol=0)
    assert found.dtype == dtype and fn.calls < 100


def test_newton_root_at_a_bracket_end_is_that_end():
    x = torch.tensor([2.0, -1.0], dtype=torch.float64)
    lo, hi = torch.tensor([2.0, -3.0], dtype=torch.float64), torch.tensor([5.0, -1.0])
    hi = hi.double()
    found = safeguarded_newton(lambda w: (w**3 - x**3, 3 * w**2), lo, hi, (lo + hi) / 2, *REAL)
    torch.testing.assert_close(found, x, rtol=1e-15, atol=0)


def test_newton_through_flat_regions():
    """f = clamp(x, -1, 1) - c: f' = 0 outside [-1, 1] (a Newton step is infinite there), and
    for c = 1 every x >= 1 is a root."""
    c = torch.tensor([0.5, -0.25, 1.0], dtype=torch.float64)

    def fn(x):
        inner = (x > -1) & (x < 1)
        return x.clamp(-1, 1) - c, inner.to(x.dtype)

    found = monotone_root(fn, torch.full_like(c, 40.0), *REAL)
    torch.testing.assert_close(found[:2], c[:2], rtol=1e-15, atol=0)
    assert float(fn(found)[0][2]) == 0.0


@DTYPES
def test_positive_and_unit_interval_roots_keep_relative_precision(dtype):
    """log w = c and logit w = c for c far from 0: roots near 0 and 1 to the dtype's
    relative precision (bracketed and bisected in log w, logit w)."""
    big = 600.0 if dtype == torch.float64 else 80.0
    c = torch.tensor([-big, -30.0, -1.0, 0.0, 2.0, big], dtype=dtype)
    positive = monotone_root(
        lambda w: (torch.log(w) - c, 1 / w), torch.ones_like(c), *COORDINATES["positive"]
    )
    tol = 1e-13 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(positive, torch.exp(c), rtol=tol, atol=0)
    c = c.clamp(-30, 30)
    unit = monotone_root(
        lambda w: (torch.log(w) - torch.log1p(-w) - c, 1 / (w * (1 - w))),
        torch.full_like(c, 0.5),
        *COORDINATES["unit_interval"],
    )
    torch.testing.assert_close(unit, torch.sigmoid(c), rtol=tol, atol=0)


def test_a_nan_entry_comes_back_nan_at_once_and_leaves_the_others():
    z = torch.tensor([8.0, torch.nan, -27.0], dtype=torch.float64)
    start = torch.tensor([0.0, torch.nan, 0.0], dtype=torch.float64)
    fn = Counted(lambda w: w**3 - z, lambda w: 3 * w**2)
    found = monotone_root(fn, start, *REAL)
    assert torch.isnan(found[1])
    torch.testing.assert_close(
        found[[0, 2]], torch.tensor([2.0, -3.0]).double(), rtol=1e-15, atol=0
    )
    alone = Counted(lambda w: w**3 - z[[0, 2]], lambda w: 3 * w**2)
    monotone_root(alone, start[[0, 2]], *REAL)
    assert fn.calls == alone.calls  # the NaN entry holds nothing up


def test_a_root_that_rounds_onto_the_domain_end_is_that_end():
    """sigmoid(50) is 1.0 in float64, where a binary entropy slope is NaN: the solve returns
    1.0 (the root, rounded), not NaN, and not a point far inside."""
    c = torch.tensor([50.0, 3.0], dtype=torch.float64)

    def fn(w):
        slope = w * torch.log(w) / w + torch.log(w) - (1 - w) * torch.log(1 - w) / (1 - w) * 0
        slope = torch.log(w) - torch.log(1 - w) + 0 * (1 - w) * torch.log(1 - w)
        return slope - c, 1 / (w * (1 - w))

    found = monotone_root(fn, torch.full_like(c, 0.5), *COORDINATES["unit_interval"])
    torch.testing.assert_close(found, torch.sigmoid(c), rtol=1e-14, atol=0)


# Domains and branches ------------------------------------------------------------------------


def test_inside_each_domain():
    x = torch.tensor([-1.0, 0.0, 0.5, 1.0, 2.0, math.inf, math.nan])
    assert inside("real", x).tolist() == [True] * 5 + [False, False]
    assert inside("positive", x).tolist() == [False, False, True, True, True, False, False]
    assert inside("unit_interval", x).tolist() == [False, False, True, False, False, False, False]
    assert inside("positive", 0.3) and not inside("unit_interval", 1.0)


def test_select_branches_keeps_the_root_in_the_domain():
    """w^2 + (u - w0) w - b = 0 (a log barrier's stationarity): one root on each side of 0."""
    points = [(w0, u, b) for w0, u, b in [(0.1, -1.3, 0.3), (2.9, 2.1, 0.7), (1.3, 0.4, 1.6)]]

    def root(sign):
        def value(p):
            w0, u, b = p
            return ((w0 - u) + sign * math.sqrt((w0 - u) ** 2 + 4 * b)) / 2

        return value

    assert select_branches([root(-1), root(1)], "positive", points=points) == [1]
    assert select_branches([root(-1), root(1)], "real", points=points) == [0, 1]
    # An inverse: the branch that gives the sample point back (w^2 on w > 0: +sqrt, not -sqrt).
    inverses = [lambda p: -math.sqrt(p**2), lambda p: math.sqrt(p**2), lambda p: None]
    assert select_branches(inverses, "positive", expected=lambda p: p) == [1]
    assert select_branches([lambda p: complex(p, 1e-3)], "positive") == []


# Minimizers ----------------------------------------------------------------------------------


@DTYPES
def test_argmin_separable_in_each_domain(dtype):
    gen = torch.Generator().manual_seed(2)
    u = torch.randn(4, 5, dtype=torch.float64, generator=gen).to(dtype)
    w0 = torch.randn(4, 5, dtype=torch.float64, generator=gen).to(dtype)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    real = argmin_separable(lambda w: u * w + (w - w0) ** 2 / 2 + w**4 / 4, w0, u, "real")
    torch.testing.assert_close(u + real - w0 + real**3, torch.zeros_like(u), rtol=0, atol=tol * 10)
    p0 = torch.exp(w0)
    positive = argmin_separable(lambda w: u * w + w * torch.log(w / p0) - w, p0, u, "positive")
    torch.testing.assert_close(positive, p0 * torch.exp(-u), rtol=tol, atol=0)


def test_argmin_rows_and_lbfgs_find_the_scaled_softmax():
    gen = torch.Generator().manual_seed(3)
    w0 = torch.softmax(torch.randn(2, 3, 5, dtype=torch.float64, generator=gen), -1) * 2.0
    u = 3 * torch.randn(2, 3, 5, dtype=torch.float64, generator=gen)

    def objective(w):
        return u * w + w * torch.log(w / w0)

    expected = 2.0 * torch.softmax(torch.log(w0) - u, -1)
    torch.testing.assert_close(argmin_rows(objective, w0, u, 2.0), expected, rtol=1e-12, atol=0)
    by_values = lbfgs_argmin_rows(objective, w0, 2.0)
    torch.testing.assert_close(by_values, expected, rtol=0, atol=1e-6)  # the check's ARGMIN_TOL


def test_golden_section_by_values_alone():
    c = torch.tensor([-3.0, 0.25, 7.0], dtype=torch.float64)
    found = golden_section(lambda x: (x - c) ** 2, torch.full_like(c, -10), torch.full_like(c, 10))
    torch.testing.assert_close(found, c, rtol=0, atol=1e-7)
    w0 = torch.tensor([1e-20, 0.5, 1e20], dtype=torch.float64)
    u = torch.tensor([0.3, -0.2, 0.1], dtype=torch.float64)
    found = golden_section_argmin(lambda w: u * w + w * torch.log(w / w0) - w, w0, u, "positive")
    torch.testing.assert_close(found, w0 * torch.exp(-u), rtol=1e-6, atol=0)
    # A kink: the minimizer of |x| + (x - 0.3)^2 / 2 is exactly 0.
    kink = golden_section_argmin(lambda w: w.abs() + (w - 0.3) ** 2 / 2, w0[:1] * 0, u[:1], "real")
    assert abs(float(kink)) < 1e-7


def test_newton_minimize_one_step_on_a_quadratic_and_iterated_otherwise():
    a = torch.tensor([[3.0, 1.0], [1.0, 2.0]], dtype=torch.float64)
    b = torch.tensor([1.0, -2.0], dtype=torch.float64)
    quadratic = newton_minimize(lambda x: x @ a @ x / 2 - b @ x, torch.zeros(2).double(), 1)
    torch.testing.assert_close(quadratic, torch.linalg.solve(a, b), rtol=1e-14, atol=0)
    quartic = newton_minimize(lambda x: (x**4).sum() / 4 + x @ a @ x / 2 - b @ x, quadratic)
    gradient = quartic**3 + a @ quartic - b
    assert float(gradient.abs().max()) < 1e-13


# The call sites ------------------------------------------------------------------------------


def test_the_checks_minimizers_are_the_numerics():
    from miras.checks import end_to_end as check_end_to_end
    from miras.checks import minimizer as check_minimizer

    assert check_end_to_end.argmin_separable is numerics.argmin_separable
    assert check_end_to_end.argmin_rows is numerics.argmin_rows
    assert check_end_to_end.newton_minimize is check_minimizer.newton_minimize
    assert check_minimizer.newton_minimize is numerics.newton_minimize


def test_the_range_check_finds_its_reference_with_the_numerics(monkeypatch):
    from miras.components.retention.kl import KLRetention
    from miras.components.retention.l2 import L2Retention
    from miras.derive.retention_check import check_retention
    from miras.derive.retention_derive import derive_retention

    calls = []
    for name in ("argmin_separable", "argmin_rows", "golden_section_argmin", "lbfgs_argmin_rows"):
        original = getattr(numerics, name)

        def spy(*args, _name=name, _original=original, **kwargs):
            calls.append(_name)
            return _original(*args, **kwargs)

        monkeypatch.setattr(numerics, name, spy)
    for retention in (L2Retention(), KLRetention()):
        results = check_retention(retention, derive_retention(retention))
        assert all(r.passed for r in results), [r.piece for r in results if not r.passed]
    assert set(calls) == {"argmin_separable", "argmin_rows", "golden_section_argmin",
                          "lbfgs_argmin_rows"}  # fmt: skip


NEWTON_POTENTIALS = {
    "real": "w**4/4 + w**2/2 + exp(w)",
    "positive": "w*log(w) - w + w**2/2",
    "unit_interval": "w*log(w) + (1 - w)*log(1 - w)",
}


@pytest.mark.parametrize("domain", list(NEWTON_POTENTIALS))
def test_the_emitted_newton_solve_prints_the_librarys_source(domain):
    """The emitted module imports nothing but torch and holds each function it calls as this
    library's source, verbatim; its step equals monotone_root called here, bit for bit."""
    from miras.components.retention.bregman import BregmanRetention
    from miras.derive.emit import load_module, module_source
    from miras.derive.retention_derive import derive_retention

    retention = BregmanRetention(potential=NEWTON_POTENTIALS[domain], solver="newton")
    assert retention.domain() == domain
    source = derive_retention(retention).source
    imports = [line.strip() for line in source.splitlines() if "import" in line.split("#")[0]]
    assert set(imports) <= {"import torch"}, imports  # the library's own, inside its functions
    for function in numerics.printed_functions(domain):
        assert inspect.getsource(function) in source, function.__name__
    module = load_module(module_source(f"test numerics {domain}", [source]))
    gen = torch.Generator().manual_seed(4)
    w0 = numerics.COORDINATES[domain][1](2 * torch.randn(50, dtype=torch.float64, generator=gen))
    z = module.bregman_slope(w0) - 5 * torch.randn(50, dtype=torch.float64, generator=gen)
    expected = monotone_root(
        lambda w: (module.bregman_slope(w) - z, module.bregman_curvature(w)),
        w0,
        *numerics.COORDINATES[domain],
        value=lambda w: module.bregman_slope(w) - z,
        iterations=retention.newton_steps,
    )
    assert torch.equal(module.bregman_inverse_slope(z, w0), expected)


# A log barrier: two roots, the branch chosen by the domain -----------------------------------


def _log_barrier():
    from miras.components.base import POSITIVE, Range, Retention, gate_or

    class LogBarrierRetention(Retention):
        """l2 to the previous state plus a log barrier that keeps every entry positive.

        Equation: W_t = argmin_W <u_t, W> + 1/2 ||W - W_{t-1}||^2 - b sum log W
        """

        kind: Literal["log_barrier"] = "log_barrier"
        barrier: gate_or(POSITIVE) = 0.1
        gateable: ClassVar[dict[str, Range]] = {"barrier": POSITIVE}

        def objective(self):
            import sympy as sp

            from miras.derive.symbols import eta, gate_symbol, u, w, w0

            return u * w + (w - w0) ** 2 / (2 * eta) - gate_symbol("barrier") * sp.log(w)

        def reparameterization(self):
            import sympy as sp

            from miras.derive.symbols import eta

            return {eta: sp.Integer(1)}

        def domain(self):
            return "positive"

    return LogBarrierRetention


def test_log_barrier_and_bregman_choose_their_branch_with_the_same_function(monkeypatch):
    """The separable derivation meets the barrier's two roots and keeps the positive one;
    Bregman's closed-form inverse keeps the branch that inverts F'. Both ask
    numerics.select_branches (the memo is bypassed: each derivation runs here)."""
    import sympy as sp

    from miras.components.retention.bregman import BregmanRetention
    from miras.components.retention.mirror import mirror_step
    from miras.derive.retention_solve import separable
    from miras.derive.symbols import u, w0

    calls = []
    original = numerics.select_branches

    def spy(candidates, domain, **kwargs):
        kept = original(candidates, domain, **kwargs)
        calls.append((domain, len(candidates), kept))
        return kept

    monkeypatch.setattr(numerics, "select_branches", spy)
    _, step = separable(_log_barrier()())
    assert calls == [("positive", 2, [calls[0][2][0]])]
    b = sp.Symbol("barrier", positive=True)
    expected = (w0 - u + sp.sqrt((w0 - u) ** 2 + 4 * b)) / 2
    assert sp.simplify(step - expected) == 0
    retention = BregmanRetention(potential="w**4/4 + w**2")  # validated: derived once here
    del calls[1:]
    mirror_step(retention)  # F' = w^3 + 2w = z: three branches, one real inverse
    assert calls[1:] == [("real", 3, [calls[1][2][0]])]


def test_a_log_barrier_retention_compiles_checked_and_runs():
    from miras.registry import registered
    from tests.helpers import random_inputs

    with registered(_log_barrier()):
        rule = miras.compile({"name": "barrier", "retention": {"kind": "log_barrier"}})
        q, k, v, gates = random_inputs(rule, t=9)
        o, state = rule(q, k, v, gates, backend="recurrent", output_final_state=True)
        assert torch.isfinite(o).all() and bool((state > 0).all())
        results = rule.check(triton=False)
        assert all(r.passed for r in results), [r.piece for r in results if not r.passed]
