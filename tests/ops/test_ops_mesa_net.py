"""miras.ops.chunk_mesa_net against fla's pure-torch reference `naive_mesa_net_exact`
(fla/ops/mesa_net/naive.py, fla-core 0.6): outputs, final states and gradients, with initial
states, at chunk sizes that do and do not divide T; packed sequences (cu_seqlens) against each
sequence alone through the same reference (which has no cu_seqlens); the boundary's errors.

fla computes in float32, so inputs are float32-representable float64 tensors, miras runs in
float64 and the tolerance is a relative RMS of 1e-5 (tests/runtime/test_known_models.py). fla's op
requires V = K; miras's does not, and the reference's h_kv is [K, K] then, so K = V here.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from miras import ops
from tests.runtime.test_known_models import FLA_TOL, assert_rel_rms, f32_exact, fla_naive

f64 = torch.float64
B, T, H, K = 2, 100, 2, 12

pytestmark = pytest.mark.usefixtures("one_thread")


def mesa_inputs(seed=0, b=B, t=T):
    """q, k (unit rows), v, g (log-decay), beta, lamb [H, K], h_kk0 (PSD), h_kv0."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=f64)

    q = f32_exact(randn(b, t, H, K))
    k = f32_exact(F.normalize(randn(b, t, H, K), dim=-1))
    v = f32_exact(randn(b, t, H, K))
    g = f32_exact(F.logsigmoid(randn(b, t, H) + 3))
    beta = f32_exact(torch.sigmoid(randn(b, t, H)))
    lamb = f32_exact(F.softplus(randn(H, K)) + 0.25)
    a = randn(b, H, K, K)
    h_kk = f32_exact(a @ a.mT / K)
    h_kv = f32_exact(randn(b, H, K, K))
    return q, k, v, g, beta, lamb, h_kk, h_kv


def reference(q, k, v, g, beta, lamb, h_kk, h_kv):
    naive = fla_naive("mesa_net", "naive_mesa_net_exact")
    f = [x.float() for x in (q, k, v, g, lamb, beta, h_kk, h_kv)]
    return naive(*f[:6], h_kk_init=f[6], h_kv_init=f[7])


def loss(o, h_kk, h_kv):
    w = torch.linspace(-1, 1, o.shape[-1], dtype=o.dtype)
    return (o * w).sum() + h_kk.sin().sum() + h_kv.cos().sum()


@pytest.mark.parametrize("chunk_size", [16, 64])
def test_chunk_mesa_net_equals_fla_forward_and_backward(chunk_size):
    args = mesa_inputs()
    ours_in = [x.clone().requires_grad_() for x in args]
    theirs_in = [x.float().requires_grad_() for x in args]
    q, k, v, g, beta, lamb, h_kk, h_kv = ours_in
    o, kk, kv = ops.chunk_mesa_net(
        q, k, v, g, beta, lamb, h_kk_init=h_kk, h_kv_init=h_kv, output_final_state=True,
        chunk_size=chunk_size,
    )  # fmt: skip
    o_ref, kk_ref, kv_ref = reference(*theirs_in)
    for name, a, e in (("o", o, o_ref), ("h_kk", kk, kk_ref), ("h_kv", kv, kv_ref)):
        assert_rel_rms(a, e, FLA_TOL, name)
    loss(o, kk, kv).backward()
    loss(o_ref, kk_ref, kv_ref).backward()
    names = ("q", "k", "v", "g", "beta", "lamb", "h_kk_init", "h_kv_init")
    for name, a, e in zip(names, ours_in, theirs_in, strict=True):
        assert_rel_rms(a.grad, e.grad, FLA_TOL, f"d{name}")


def test_packed_sequences_equal_each_sequence_through_fla():
    q, k, v, g, beta, lamb, h_kk, h_kv = mesa_inputs(b=1, t=90)
    bounds = [0, 33, 90]
    init_kk = torch.cat([h_kk, 2 * h_kk])  # [N, H, K, K]
    init_kv = torch.cat([h_kv, -h_kv])
    o, kk, kv = ops.chunk_mesa_net(
        q, k, v, g, beta, lamb, h_kk_init=init_kk, h_kv_init=init_kv, output_final_state=True,
        cu_seqlens=torch.tensor(bounds),
    )  # fmt: skip
    for i in range(2):
        sl = slice(bounds[i], bounds[i + 1])
        part = [x[:, sl] for x in (q, k, v, g, beta)]
        o_ref, kk_ref, kv_ref = reference(*part, lamb, init_kk[i : i + 1], init_kv[i : i + 1])
        assert_rel_rms(o[:, sl], o_ref, FLA_TOL, f"o of sequence {i}")
        assert_rel_rms(kk[i : i + 1], kk_ref, FLA_TOL, f"h_kk of sequence {i}")
        assert_rel_rms(kv[i : i + 1], kv_ref, FLA_TOL, f"h_kv of sequence {i}")


def test_without_initial_states_and_final_states():
    q, k, v, g, beta, lamb, _, _ = mesa_inputs(t=20)
    o, kk, kv = ops.chunk_mesa_net(q, k, v, g, beta, lamb)
    zeros = torch.zeros(B, H, K, K, dtype=f64)
    o_ref, _, _ = reference(q, k, v, g, beta, lamb, zeros, zeros)
    assert kk is None and kv is None
    assert_rel_rms(o, o_ref, FLA_TOL, "o")


def test_the_functional_op_of_the_spec_takes_its_gates_by_name():
    """ops.functional over the mesanet spec needs no chunk_mode (its form is exact at any chunk
    size): g is the decay, gamma and ridge go by name, and it equals chunk_mesa_net."""
    q, k, v, g, beta, lamb, _, _ = mesa_inputs(t=20)
    op = ops.functional(ops.KNOWN_SPECS["mesanet"])
    o, _ = op(q, k, v, g=g, scale=1.0, gates={"gamma": beta, "ridge": lamb.expand(*q.shape)})
    expected, _, _ = ops.chunk_mesa_net(q, k, v, g, beta, lamb)
    torch.testing.assert_close(o, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"lamb": torch.ones(H, K + 1)}, r"lamb: expected a tensor \[H, K\] = \[2, 12\]"),
        ({"lamb": torch.zeros(H, K)}, r"lamb: values must lie in \(0, inf\)"),
        ({"g": torch.ones(B, 20, H)}, r"g: expected log-decays g <= 0"),
        ({"beta": torch.zeros(B, 20, H)}, r"beta: values must lie in \(0, inf\)"),
        ({"beta": torch.ones(B, 20)}, r"beta: expected \[B, T, H\]"),
        ({"max_CG_iteration": 0}, "max_CG_iteration: expected a positive integer"),
        ({"h_kk_init": torch.zeros(B, H, K, K)}, "h_kk_init, h_kv_init: pass both"),
        ({"use_beta": True}, r"unexpected arguments \['use_beta'\]"),
    ],
    ids=["lamb-shape", "lamb-zero", "g-positive", "beta-zero", "beta-shape", "cg", "one-state",
         "unknown"],
)  # fmt: skip
def test_bad_arguments_are_named(change, message):
    q, k, v, g, beta, lamb, _, _ = mesa_inputs(t=20)
    args = dict(q=q, k=k, v=v, g=g, beta=beta, lamb=lamb)
    args.update({n: x.to(f64) if isinstance(x, torch.Tensor) else x for n, x in change.items()})
    with pytest.raises(ValueError, match=message):
        ops.chunk_mesa_net(**args)
