"""miras.ops.chunk_gated_delta_product: (Gated) DeltaProduct in fla's calling convention.

Against fla-core 0.6's `naive_recurrent_gated_delta_product` (fla/ops/gated_delta_product/
naive.py: h = h exp(g_t), then n delta-rule steps, each on its own key, value and beta, then
the read), on equal float32 inputs in fla's packing (k, v [B, T*n, H, .], beta [B, T*n, H]),
at the tolerance the other aliases meet against fla (relative RMS 1e-5, tests/ops/test_ops.py):
n = 2 and 3, with a decay and without one (g None), with and without an initial state,
packed sequences (cu_seqlens), forward and the gradients of every input. The chunk size counts
steps (fla chunks the T*n of them): 7 leaves chunks that end inside a token and a partial
last one.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from miras import ops
from tests.runtime.test_known_models import assert_rel_rms, fla_naive

B, T, H, K, V = 2, 20, 2, 8, 5  # K != V so a transposed state cannot pass
FLA_TOL = 1e-5
CHUNK = 7


def naive():
    return fla_naive("gated_delta_product", "naive_recurrent_gated_delta_product")


# Not helpers.random_inputs: fla's DeltaProduct packing (n keys and values per token).
def inputs(seed: int, n: int, *, gated: bool, batch: int = B, states: int = B):
    """Leaves q [B, T, H, K], k [B, T*n, H, K], v [B, T*n, H, V], beta [B, T*n, H],
    g [B, T, H] (log-decays; None when not gated) and h0 [states, H, K, V] (fla's layout)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, T, H, K, generator=gen)
    k = F.normalize(torch.randn(batch, T * n, H, K, generator=gen), dim=-1)
    v = torch.randn(batch, T * n, H, V, generator=gen)
    beta = 0.1 + 0.8 * torch.rand(batch, T * n, H, generator=gen)
    g = torch.log(0.7 + 0.3 * torch.rand(batch, T, H, generator=gen)) if gated else None
    h0 = 0.3 * torch.randn(states, H, K, V, generator=gen)
    leaves = [x for x in (q, k, v, beta, g, h0) if x is not None]
    for x in leaves:
        x.requires_grad_(True)
    return q, k, v, beta, g, h0, leaves


def grads_of(outputs, leaves, seed: int = 3):
    """Gradients of a random linear functional of `outputs` with respect to `leaves`."""
    gen = torch.Generator().manual_seed(seed)
    loss = sum((x * torch.randn(x.shape, generator=gen)).sum() for x in outputs if x is not None)
    return torch.autograd.grad(loss, leaves)


def assert_matches(ours, theirs, leaves, names):
    for a, b, name in zip(ours, theirs, ("o", "final state"), strict=False):
        assert_rel_rms(a, b, FLA_TOL, name)
    for a, b, name in zip(grads_of(ours, leaves), grads_of(theirs, leaves), names, strict=True):
        assert_rel_rms(a, b, FLA_TOL, name)


def grad_names(gated: bool) -> list[str]:
    return ["dq", "dk", "dv", "dbeta", *(["dg"] if gated else []), "dh0"]


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "g-none"])
@pytest.mark.parametrize("n", [2, 3])
def test_matches_fla_naive_recurrent(n, gated):
    q, k, v, beta, g, h0, leaves = inputs(n, n, gated=gated)
    o, s = ops.chunk_gated_delta_product(
        q, k, v, g, beta, num_householder=n, initial_state=h0, output_final_state=True,
        chunk_size=CHUNK,
    )  # fmt: skip
    o_ref, s_ref = naive()(
        q, k, v, g, beta, scale=K**-0.5, initial_state=h0, output_final_state=True,
        num_householder=n,
    )  # fmt: skip
    assert o.shape == (B, T, H, V) and s.shape == (B, H, K, V)
    assert_matches([o, s], [o_ref, s_ref], leaves, grad_names(gated))


@pytest.mark.parametrize("n", [2, 3])
def test_from_zero_state_without_final_state(n):
    """No initial state: fla starts from zeros; output_final_state=False returns None. The
    default chunk size (64 steps) holds the whole sequence in one chunk."""
    q, k, v, beta, g, _, _ = inputs(10 + n, n, gated=True)
    leaves = [q, k, v, beta, g]
    o, s = ops.chunk_gated_delta_product(q, k, v, g, beta, n, scale=0.6)
    o_ref, _ = naive()(q, k, v, g, beta, scale=0.6, num_householder=n)
    assert s is None
    assert_matches([o], [o_ref], leaves, ["dq", "dk", "dv", "dbeta", "dg"])


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "g-none"])
def test_packed_sequences_match_fla(gated):
    """cu_seqlens over the T tokens of q (fla: k, v and beta are cut at c_i * n), one
    initial and final state per sequence."""
    n = 2
    bounds = torch.tensor([0, 7, 8, T])
    q, k, v, beta, g, h0, leaves = inputs(20, n, gated=gated, batch=1, states=3)
    o, s = ops.chunk_gated_delta_product(
        q, k, v, g, beta, n, initial_state=h0, output_final_state=True, cu_seqlens=bounds,
        cu_seqlens_cpu=bounds.clone(), chunk_size=CHUNK,
    )  # fmt: skip
    o_ref, s_ref = naive()(
        q, k, v, g, beta, scale=K**-0.5, cu_seqlens=bounds, initial_state=h0,
        output_final_state=True, num_householder=n,
    )  # fmt: skip
    assert s.shape == (3, H, K, V)
    assert_matches([o, s], [o_ref, s_ref], leaves, grad_names(gated))


def test_recurrent_backend_and_v_first_state_agree():
    n = 3
    q, k, v, beta, g, h0, _ = inputs(30, n, gated=True)
    o, s = ops.chunk_gated_delta_product(
        q, k, v, g, beta, n, initial_state=h0, output_final_state=True, chunk_size=CHUNK
    )
    o_rec, s_rec = ops.chunk_gated_delta_product(
        q, k, v, g, beta, n, initial_state=h0.transpose(-1, -2), output_final_state=True,
        state_v_first=True, backend="recurrent",
    )  # fmt: skip
    assert_rel_rms(o_rec, o, FLA_TOL, "o")
    assert_rel_rms(s_rec.transpose(-1, -2), s, FLA_TOL, "final state")


def test_functional_runs_the_shipped_spec_in_fla_packing():
    """ops.functional of specs/deltaproduct.yaml (n = 2) takes the same packed inputs, g and
    beta, cu_seqlens included, and equals the alias."""
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "specs/deltaproduct.yaml"
    q, k, v, beta, g, h0, _ = inputs(50, 2, gated=True, batch=1, states=2)
    bounds = torch.tensor([0, 9, T])
    op = ops.functional(path, chunk_size=CHUNK)
    o, s = op(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=bounds)
    o_ref, s_ref = ops.chunk_gated_delta_product(
        q, k, v, g, beta, 2, initial_state=h0, output_final_state=True, cu_seqlens=bounds,
        chunk_size=CHUNK,
    )  # fmt: skip
    torch.testing.assert_close(o, o_ref)
    torch.testing.assert_close(s, s_ref)
    with pytest.raises(ValueError, match=r"k: expected fla's packing \[B, T\*n, H, K\]"):
        op(q, k[:, :T], v, g, beta)


def _bad(**change):
    q, k, v, beta, g, _, _ = inputs(40, 2, gated=True)
    args = {**dict(q=q, k=k, v=v, g=g, beta=beta, num_householder=2), **change}
    return lambda: ops.chunk_gated_delta_product(**args)


@pytest.mark.parametrize(
    "change, words",
    [
        (dict(k=torch.randn(B, T, H, K)), ["k:", "T*num_householder", "T*n = 40", "T = 20"]),
        (dict(v=torch.randn(B, 3 * T, H, V)), ["v:", "num_householder = 2", "[2, 60, 2, 5]"]),
        (dict(beta=torch.rand(B, T, H)), ["beta:", "[B, T*2, H] = [2, 40, 2]", "[2, 20, 2]"]),
        (dict(g=torch.zeros(B, 2 * T, H)), ["g:", "[B, T, H] = [2, 20, 2]", "[2, 40, 2]"]),
        (dict(g=torch.full((B, T, H), 0.5)), ["g:", "g <= 0", "0.5"]),
        (dict(beta=torch.full((B, 2 * T, H), -1.0)), ["beta:", "[0, inf)", "-1"]),
        (dict(num_householder=0), ["num_householder:", "[1, 16]", "got 0"]),
        (dict(num_householder=2.0), ["num_householder:", "an integer", "2.0"]),
        (dict(cp_context=object()), ["chunk_gated_delta_product:", "cp_context"]),
        (dict(head_dim=4), ["chunk_gated_delta_product:", "unexpected", "head_dim"]),
        (dict(q=torch.randn(B, T, H)), ["q:", "[B, T, H, D]"]),
        (dict(cu_seqlens_cpu=torch.tensor([0, T])), ["cu_seqlens_cpu:", "host copy"]),
    ],
    ids=lambda x: x[0] if isinstance(x, list) else None,
)
def test_bad_arguments_raise_named_value_errors(change, words):
    with pytest.raises(ValueError) as err:
        _bad(**change)()
    for word in words:
        assert word in str(err.value), (word, str(err.value))
