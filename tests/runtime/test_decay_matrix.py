"""The decay matrix's own backward (`miras.runtime.unroll._DecayMatrix`): products of the
spans without the differentiated factor, checked against finite differences and against
autograd through the cumulative product it replaces."""

from __future__ import annotations

import torch

from miras.runtime.unroll import _lower, decay_matrix

f64 = torch.float64


def _by_cumprod(factors: torch.Tensor) -> torch.Tensor:
    """The same matrix through autograd's cumprod: the reference for the gradients."""
    n = factors.shape[-2]
    column = factors.movedim(-1, -2).unsqueeze(-1)
    spans = torch.where(_lower(n, True, "cpu"), column, 1.0)
    return torch.cumprod(spans, dim=-2) * _lower(n, False, "cpu")


def _factors(*shape: int, zero_at: tuple | None = None) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    a = 0.5 + 0.5 * torch.rand(*shape, generator=gen, dtype=f64)
    if zero_at is not None:
        a[zero_at] = 0.0  # momentum theta = 0: exact zeros below it
    return a.requires_grad_(True)


def test_the_gradient_passes_finite_differences_first_and_second_order():
    a = _factors(2, 5, 3)  # [.., n, X], per channel
    assert torch.autograd.gradcheck(decay_matrix, (a,))
    assert torch.autograd.gradgradcheck(decay_matrix, (a,))


def test_the_gradient_equals_autograd_through_the_cumulative_product_with_a_zero_factor():
    a = _factors(2, 3, 7, 1, zero_at=(0, 1, 3, 0))  # [B, N, n, X]
    weight = torch.randn(2, 3, 1, 7, 7, generator=torch.Generator().manual_seed(1), dtype=f64)
    got = decay_matrix(a)
    want = _by_cumprod(a)
    assert torch.equal(got, want)  # the forward is the same products
    (g_got,) = torch.autograd.grad((got * weight).sum(), a)
    (g_want,) = torch.autograd.grad((want * weight).sum(), a)
    assert torch.isfinite(g_got).all()
    torch.testing.assert_close(g_got, g_want, rtol=1e-12, atol=1e-12)


def test_no_graph_without_a_factor_that_requires_grad():
    a = _factors(4, 1).detach()
    assert not decay_matrix(a).requires_grad
    with torch.no_grad():
        assert not decay_matrix(a.requires_grad_(True)).requires_grad
