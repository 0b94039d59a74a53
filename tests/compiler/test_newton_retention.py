"""Bregman retention with `solver: newton`: a safeguarded solve of F'(w) = F'(w0) - u.

Regression tests for a Newton iteration that divided by F''(w) where it vanishes (F = w^4/4
from a zero state: NaN from the first token) and stopped after a fixed 5 steps (binary entropy
failed its check). Each solve is compared with an independent one: the real cube root for
F' = w^3, the sigmoid of the logit for binary entropy, bisection for a potential sympy cannot
invert; gradients with gradcheck and against the closed forms.
"""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

import miras
from miras.components.retention.bregman import BINARY_ENTROPY, BregmanRetention
from miras.derive.emit import load_module, module_source
from miras.derive.retention_derive import derive_retention
from miras.errors import SpecError

QUARTIC = "w**4/4"  # F' = w^3, F'' = 3 w^2: zero at the zero state
QUARTIC_EXP = "w**4/4 + w**2/2 + exp(w)"  # sympy cannot invert F' = w^3 + w + e^w
LAMBERT = "w*log(w) - w + w**2/2"  # sympy's inverse has LambertW, which no printer emits
B, T, H, DK, DV = 2, 9, 2, 3, 4


def step_module(potential: str, **fields):
    rule = derive_retention(BregmanRetention(potential=potential, solver="newton", **fields))
    return load_module(module_source(f"test newton {potential}", [rule.source]))


def cbrt(x: torch.Tensor) -> torch.Tensor:
    """The real cube root (torch.pow of a negative base is nan)."""
    return torch.sign(x) * x.abs().pow(1 / 3)


def relative_rms(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual - expected).norm() / expected.norm())


# The step alone ----------------------------------------------------------------------------


def test_quartic_step_is_the_real_cube_root_from_zero():
    gen = torch.Generator().manual_seed(0)
    u = torch.randn(5, 6, dtype=torch.float64, generator=gen) * torch.logspace(-6, 3, 6)
    w0 = torch.zeros_like(u)
    new = step_module(QUARTIC).retention_step(w0, u)
    torch.testing.assert_close(new, cbrt(-u), rtol=1e-13, atol=0)


def test_quartic_step_at_a_vanishing_curvature_solution_is_exact_and_finite():
    """u = 0 from w0 = 0: the solution is w = 0, where F'' = 0 (the cube root's slope is
    unbounded there; the backward gives 0 for it rather than inf or nan)."""
    w0 = torch.zeros(3, dtype=torch.float64, requires_grad=True)
    u = torch.zeros(3, dtype=torch.float64, requires_grad=True)
    new = step_module(QUARTIC).retention_step(w0, u)
    assert torch.equal(new.detach(), torch.zeros(3, dtype=torch.float64))
    new.sum().backward()
    assert torch.isfinite(w0.grad).all() and torch.isfinite(u.grad).all()


def test_quartic_step_gradients():
    """gradcheck away from w = 0, and d w/d u = -1/(3 w^2), d w/d w0 = w0^2/w^2 by hand."""
    module = step_module(QUARTIC)
    gen = torch.Generator().manual_seed(1)
    w0 = torch.randn(4, 5, dtype=torch.float64, generator=gen).requires_grad_()
    u = torch.randn(4, 5, dtype=torch.float64, generator=gen).requires_grad_()
    assert torch.autograd.gradcheck(module.retention_step, (w0, u))
    new = module.retention_step(w0, u)
    d_w0, d_u = torch.autograd.grad(new.sum(), (w0, u))
    expected = cbrt(w0.detach() ** 3 - u.detach())
    torch.testing.assert_close(d_u, -1 / (3 * expected**2), rtol=1e-10, atol=0)
    torch.testing.assert_close(d_w0, w0.detach() ** 2 / expected**2, rtol=1e-10, atol=0)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_binary_entropy_by_newton_is_the_sigmoid_step(dtype):
    """Including steps that push w close to 0 or 1 (u up to 30 in logit space)."""
    gen = torch.Generator().manual_seed(2)
    w0 = torch.sigmoid(2 * torch.randn(6, 7, dtype=torch.float64, generator=gen))
    u = (
        30
        * torch.rand(6, 7, dtype=torch.float64, generator=gen).pow(3)
        * torch.sign(torch.randn(6, 7, dtype=torch.float64, generator=gen))
    )
    w0, u = w0.to(dtype), u.to(dtype)
    new = step_module(BINARY_ENTROPY).retention_step(w0, u)
    expected = torch.sigmoid(torch.logit(w0.double()) - u.double())
    # Relative to w: the solve brackets in logit space, so a w near 0 keeps its digits.
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(new.double(), expected, rtol=tol, atol=0)


def test_binary_entropy_gradients_match_the_closed_form():
    module = step_module(BINARY_ENTROPY)
    gen = torch.Generator().manual_seed(3)
    w0 = torch.sigmoid(torch.randn(4, 5, dtype=torch.float64, generator=gen)).requires_grad_()
    u = torch.randn(4, 5, dtype=torch.float64, generator=gen).requires_grad_()
    assert torch.autograd.gradcheck(module.retention_step, (w0, u))
    weight = torch.randn(4, 5, dtype=torch.float64, generator=gen)
    got = torch.autograd.grad((module.retention_step(w0, u) * weight).sum(), (w0, u))
    closed = torch.sigmoid(torch.logit(w0) - u)
    expected = torch.autograd.grad((closed * weight).sum(), (w0, u))
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-12)


def test_uninvertible_potential_matches_bisection():
    gen = torch.Generator().manual_seed(4)
    w0 = 2 * torch.randn(50, dtype=torch.float64, generator=gen)
    u = 20 * torch.randn(50, dtype=torch.float64, generator=gen)

    def slope(x):
        return x**3 + x + torch.exp(x)

    target = slope(w0) - u
    lo, hi = torch.full_like(w0, -50.0), torch.full_like(w0, 50.0)
    for _ in range(200):
        mid = (lo + hi) / 2
        below = slope(mid) < target
        lo, hi = torch.where(below, mid, lo), torch.where(below, hi, mid)
    new = step_module(QUARTIC_EXP).retention_step(w0, u)
    torch.testing.assert_close(new, (lo + hi) / 2, rtol=1e-12, atol=1e-14)


def test_newton_steps_is_an_iteration_cap():
    """A cap too small to converge stops early; the default converges."""
    gen = torch.Generator().manual_seed(5)
    u = 100 * torch.randn(40, dtype=torch.float64, generator=gen)
    w0 = torch.zeros_like(u)
    capped = step_module(QUARTIC, newton_steps=2).retention_step(w0, u)
    assert relative_rms(capped, cbrt(-u)) > 1e-3
    assert BregmanRetention(solver="newton").newton_steps == 100
    with pytest.raises(ValidationError, match="newton_steps"):
        BregmanRetention(solver="newton", newton_steps=0)


# Whole rules -----------------------------------------------------------------------------


def quartic_spec() -> dict:
    return {
        "name": "quartic_newton",
        "memory": "matrix",
        "bias": "l2",
        "retention": {"kind": "bregman", "potential": QUARTIC, "solver": "newton"},
        "optimizer": {"kind": "gd", "lr": "gate"},
    }


def sample(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, dtype=torch.float64, generator=gen)

    q, k, v = randn(B, T, H, DK), randn(B, T, H, DK), randn(B, T, H, DV)
    lr = 0.1 + 0.8 * torch.rand(B, T, H, dtype=torch.float64, generator=gen)
    return q, k, v, lr


def quartic_oracle(q, k, v, lr, chunk_size: int) -> torch.Tensor:
    """W_t = cbrt(W_{t-1}^3 - lr_t (W_e k_t - v_t) k_t^T) from W_0 = 0, o_t = W_t q_t, with the
    gradient point W_e the state at the start of the token's chunk (chunk size 1: W_{t-1})."""
    w = torch.zeros(B, H, DV, DK, dtype=q.dtype)
    w_e = w
    outputs = []
    for t in range(T):
        if t % chunk_size == 0:
            w_e = w
        kt, vt, qt = k[:, t], v[:, t], q[:, t]  # [B, H, D]
        error = torch.einsum("bhvd,bhd->bhv", w_e, kt) - vt
        u = lr[:, t, :, None, None] * error[..., None] * kt[..., None, :]
        w = cbrt(w**3 - u)
        outputs.append(torch.einsum("bhvd,bhd->bhv", w, qt))
    return torch.stack(outputs, dim=1)  # [B, T, H, DV]


@pytest.mark.parametrize(
    ("backend", "chunk_size"),
    [("recurrent", 1), ("chunk", 1), ("chunk", 4)],
    ids=["recurrent", "chunk-b1", "chunk-b4"],
)
def test_quartic_rule_from_zero_state_matches_cube_root_oracle(backend, chunk_size):
    rule = miras.compile(quartic_spec())
    q, k, v, lr = sample()
    inputs = [x.clone().requires_grad_() for x in (q, k, v, lr)]
    o, state = rule(
        *inputs[:3],
        gates={"lr": inputs[3]},
        backend=backend,
        chunk_size=chunk_size,
        output_final_state=True,
    )
    assert torch.isfinite(o).all() and torch.isfinite(state).all()
    oracle_inputs = [x.clone().requires_grad_() for x in (q, k, v, lr)]
    expected = quartic_oracle(*oracle_inputs, chunk_size=chunk_size)
    torch.testing.assert_close(o, expected, rtol=1e-10, atol=1e-12)
    weight = torch.randn(o.shape, dtype=o.dtype, generator=torch.Generator().manual_seed(9))
    got = torch.autograd.grad((o * weight).sum(), inputs)
    want = torch.autograd.grad((expected * weight).sum(), oracle_inputs)
    for name, g, e in zip(("q", "k", "v", "lr"), got, want, strict=True):
        assert torch.isfinite(g).all(), name
        assert relative_rms(g, e) < 1e-9, name


def test_triton_refuses_newton_with_a_reason():
    rule = miras.compile(quartic_spec())
    q, k, v, lr = sample()
    with pytest.raises(ValueError, match="Newton"):
        rule(q, k, v, gates={"lr": lr}, backend="triton")


def test_binary_entropy_rule_by_newton_equals_the_closed_form_rule():
    """The default cap passes the compile-time check (5 fixed steps did not) and the whole
    rule agrees with the sigmoid step, forward and backward."""
    base = {"name": "entropy", "memory": "matrix", "bias": "l2", "optimizer": "gd"}
    closed = miras.compile({**base, "retention": {"kind": "bregman"}})
    newton = miras.compile({**base, "retention": {"kind": "bregman", "solver": "newton"}})
    q, k, v, lr = sample(1)
    results = []
    for rule in (closed, newton):
        inputs = [x.clone().requires_grad_() for x in (q, k, v)]
        o, _ = rule(*inputs, gates={"lr": lr}, backend="recurrent")
        results.append((o, torch.autograd.grad(o.pow(2).sum(), inputs)))
    (o_closed, g_closed), (o_newton, g_newton) = results
    torch.testing.assert_close(o_newton, o_closed, rtol=1e-12, atol=1e-14)
    for g, e in zip(g_newton, g_closed, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("potential", [QUARTIC, QUARTIC_EXP, LAMBERT])
def test_following_the_newton_advice_gives_a_working_rule(potential):
    """A potential that `solver: closed_form` refuses with "set retention.solver: newton"
    compiles (checked) under that advice and runs finite from the default initial state."""
    spec = {"name": "advice", "memory": "matrix", "bias": "l2", "optimizer": "gd"}
    spec["retention"] = {"kind": "bregman", "potential": potential}
    with pytest.raises(SpecError, match=r"set `retention\.solver: newton`"):  # at validation
        miras.compile(spec)
    spec["retention"]["solver"] = "newton"
    rule = miras.compile(spec)
    q, k, v, lr = sample(2)
    for backend in ("recurrent", "chunk"):
        inputs = [x.clone().requires_grad_() for x in (q, k, v)]
        o, _ = rule(*inputs, gates={"lr": lr}, backend=backend, chunk_size=4)
        grads = torch.autograd.grad(o.pow(2).sum(), inputs)
        assert torch.isfinite(o).all(), backend
        assert all(torch.isfinite(g).all() for g in grads), backend
