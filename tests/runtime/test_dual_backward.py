"""The hand-written backwards of the dual form's pieces (miras/runtime/dual.py): the chunk's end
state with and without momentum, and the layer read h w^T.

- Each matches finite differences in float64 (`gradcheck`), and so does its own backward
  (`gradgradcheck`): a double backward through the dual form stays available, and at chunk
  size 1 it equals the recurrence's (titans: momentum; yaad: gd).
- The read's weight gradient comes back contiguous in the weight's [out, in] layout (autograd's
  own backward of `h @ w.transpose(-1, -2)` returns a strided view of [in, out]).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.autograd import gradcheck, gradgradcheck

import miras
from miras.runtime import dual
from tests.helpers import random_inputs

SPECS = Path(__file__).resolve().parents[2] / "specs"

B, H, M, OUT, IN = 2, 3, 4, 5, 6


def _inputs(*shapes, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randn(*s, generator=gen, dtype=torch.float64).requires_grad_(True) for s in shapes
    ]


def test_chunk_end_backward_matches_finite_differences():
    args = _inputs((B, H, OUT, IN), (B, H, 1, 1), (B, H, M, OUT), (B, H, M, IN))
    assert gradcheck(dual._ChunkEnd.apply, args)
    assert gradgradcheck(dual._ChunkEnd.apply, args)


def test_momentum_chunk_end_backward_matches_finite_differences():
    weight, gate, factor = (B, H, OUT, IN), (B, H, 1, 1), (B, H, M, OUT)
    args = _inputs(weight, weight, gate, gate, gate, factor, factor, (B, H, M, IN), seed=1)
    assert gradcheck(dual._MomentumChunkEnd.apply, args)
    assert gradgradcheck(dual._MomentumChunkEnd.apply, args)


def test_chunk_end_equals_its_plain_formula():
    w, s, a, c, theta, e_w, e_s, x = _inputs(
        *[(B, H, OUT, IN)] * 2, *[(B, H, 1, 1)] * 3, *[(B, H, M, OUT)] * 2, (B, H, M, IN), seed=2
    )
    w_new, s_new = dual._MomentumChunkEnd.apply(w, s, a, c, theta, e_w, e_s, x)
    outer_w, outer_s = e_w.transpose(-1, -2) @ x, e_s.transpose(-1, -2) @ x
    torch.testing.assert_close(w_new, a * w - c * s + outer_w, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(s_new, theta * s + outer_s, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(
        dual._ChunkEnd.apply(w, a, e_w, x), a * w + outer_w, rtol=1e-12, atol=1e-12
    )


def test_linear_backward_matches_finite_differences():
    args = _inputs((B, H, M, IN), (B, H, OUT, IN), seed=3)
    assert gradcheck(dual._Linear.apply, args)
    assert gradgradcheck(dual._Linear.apply, args)


def test_linear_weight_gradient_is_contiguous():
    h, w = _inputs((B, H, M, IN), (B, H, OUT, IN), seed=4)
    (grad,) = torch.autograd.grad(dual._linear(h, w).sum(), w)
    (plain,) = torch.autograd.grad((h @ w.transpose(-1, -2)).sum(), w)
    torch.testing.assert_close(grad, plain, rtol=1e-12, atol=1e-12)
    assert grad.is_contiguous()
    assert not plain.is_contiguous()  # what the plain matmul's backward gives


def _second_order(rule, backend):
    """d/dk |d/dq |o|^2|^2 at chunk size 1, and the first-order gradient it differentiates."""
    q, k, v, gates = random_inputs(rule, b=2, t=9, h=2, dk=4, dv=4, seed=5)
    q.requires_grad_(True)
    k.requires_grad_(True)
    o, _ = rule(q, k, v, gates, backend=backend, chunk_size=1)
    (grad_q,) = torch.autograd.grad(o.square().sum(), q, create_graph=True)
    (grad_k,) = torch.autograd.grad(grad_q.square().sum(), k)
    return grad_q.detach(), grad_k


@pytest.mark.parametrize("name", ["titans", "yaad"])
def test_double_backward_through_the_dual_form_equals_the_recurrence(name):
    rule = miras.compile(SPECS / f"{name}.yaml")
    assert rule.plan.chunk_form.form == "dual"
    grad_q, grad_k = _second_order(rule, "chunk")
    ref_q, ref_k = _second_order(rule, "recurrent")
    assert grad_k.abs().max() > 0
    torch.testing.assert_close(grad_q, ref_q, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(grad_k, ref_k, rtol=1e-10, atol=1e-10)
