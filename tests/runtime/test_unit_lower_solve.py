"""The exact chunk form's unit-lower-triangular solve (`exact_chunk._unit_lower_solve`, a blocked
inverse of 16 x 16 LAPACK blocks joined by matmuls) against torch.linalg.solve_triangular in
float64: values and gradients, at sizes below, at and between the block doublings (the padded
ones included), and with entries above the diagonal that must not be read.
"""

from __future__ import annotations

import pytest
import torch

from miras.runtime.exact_chunk import _unit_lower_inverse_of, _unit_lower_solve

f64 = torch.float64


def make(m: int, widths=(3, 5), seed=0):
    gen = torch.Generator().manual_seed(seed * 1000 + m)
    # Junk on and above the diagonal: the solve reads only the strictly lower triangle.
    a = 0.3 * torch.randn(2, 3, m, m, generator=gen, dtype=f64)
    rhs = [torch.randn(2, 3, m, w, generator=gen, dtype=f64) for w in widths]
    return a.requires_grad_(True), [r.requires_grad_(True) for r in rhs]


def reference(a, rhs):
    return [
        torch.linalg.solve_triangular(a.tril(-1), r, upper=False, unitriangular=True) for r in rhs
    ]


@pytest.mark.parametrize("m", [1, 5, 16, 17, 32, 48, 64, 100])
def test_solve_matches_solve_triangular(m):
    a, rhs = make(m)
    got = _unit_lower_solve(a, *rhs)
    want = reference(a, rhs)
    gen = torch.Generator().manual_seed(7)
    weights = [torch.randn(w.shape, generator=gen, dtype=f64) for w in want]
    leaves = [a, *rhs]
    g_got = torch.autograd.grad(
        sum((x * w).sum() for x, w in zip(got, weights, strict=True)), leaves
    )
    g_want = torch.autograd.grad(
        sum((x * w).sum() for x, w in zip(want, weights, strict=True)), leaves
    )
    for x, y in zip([*got, *g_got], [*want, *g_want], strict=True):
        torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-10)
    # No gradient reaches the entries the solve does not read.
    assert not g_got[0].triu().any()


@pytest.mark.parametrize("m", [3, 16, 40, 64])
def test_inverse_matches_solve_triangular(m):
    a, _ = make(m, widths=())
    got = _unit_lower_inverse_of(a)
    eye = torch.eye(m, dtype=f64).expand_as(a)
    want = torch.linalg.solve_triangular(a.tril(-1), eye, upper=False, unitriangular=True)
    w = torch.randn(a.shape, generator=torch.Generator().manual_seed(3), dtype=f64)
    (g_got,) = torch.autograd.grad((got * w).sum(), a)
    (g_want,) = torch.autograd.grad((want * w).sum(), a)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(g_got, g_want, rtol=1e-10, atol=1e-10)
