"""miras.ops's fla arguments `g` and `beta` (miras/ops.py): every value fla accepts runs, with
fla's results, and a bad one is a ValueError that names `g` or `beta`, the argument passed.

- beta = 0 (fla's "no write", also sigmoid(x) for x below about -104 in float32) is a step of
  size 0: the rule's learning rate accepts 0.
- g so low that exp(g) is 0 in the inputs' dtype (g <= -104 in float32, -inf) is fla's decay of
  exactly 0, the state's reset.
Both are compared with fla's pure-torch recurrences (fla-core 0.6, float32 inputs, as fla sees
them), forward and backward, on the chunk backend's exact form, the recurrence and the Triton
kernel; the chunk-start form, which works with log a, must stay finite and equal the limit of
small decays.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from miras import ops
from tests.runtime.test_known_models import assert_rel_rms, fla_naive

B, T, H, K, V = 2, 20, 2, 8, 5
TOL = 1e-5  # relative RMS: float32 on both sides
f32 = torch.float32


def grads_of(outputs, leaves, seed=3):
    """Gradients of a random linear functional of `outputs` w.r.t. `leaves` (float64 sums)."""
    gen = torch.Generator().manual_seed(seed)
    loss = sum((x.double() * torch.randn(x.shape, generator=gen, dtype=torch.float64)).sum()
               for x in outputs)  # fmt: skip
    return torch.autograd.grad(loss, leaves)


# Not helpers.random_inputs: fla's layout and conventions (beta, the log-decay g, the state
# [B, H, K, V]), with beta 0 and a decay of 0 at fixed tokens.
def inputs(seed, dtype=f32):
    """q, k (unit rows), v, beta with zeros at every 3rd token, g with -200 (a decay of 0) at
    every 5th token, and an initial state [B, H, K, V]."""
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen)
    beta = 0.1 + 0.8 * torch.rand(B, T, H, generator=gen)
    beta[:, ::3] = 0.0
    g = (0.8 + 0.2 * torch.rand(B, T, H, generator=gen)).log()
    g[:, 2::5] = -200.0
    h0 = 0.1 * torch.randn(B, H, K, V, generator=gen)
    return [x.to(dtype) for x in (q, k, v, beta, g, h0)]


def leaves_of(tensors):
    return [x.clone().requires_grad_(True) for x in tensors]


@pytest.mark.parametrize("backend", ["chunk", "recurrent", "triton"])
def test_gated_delta_rule_with_zero_beta_and_zero_decay_matches_fla(backend):
    q, k, v, beta, g, h0 = leaves = leaves_of(inputs(0))
    assert bool((g.exp() == 0).any()) and bool((beta == 0).any())
    o, s = ops.chunk_gated_delta_rule(
        q, k, v, g, beta, initial_state=h0, output_final_state=True, backend=backend,
        chunk_size=8,
    )  # fmt: skip
    ref = fla_naive("gated_delta_rule", "naive_recurrent_gated_delta_rule")
    o_ref, s_ref = ref(q, k, v, beta, g, initial_state=h0, output_final_state=True)
    assert_rel_rms(o, o_ref, TOL, "o")
    assert_rel_rms(s, s_ref, TOL, "final state")
    got, want = grads_of([o, s], leaves), grads_of([o_ref, s_ref], leaves)
    for a, e, name in zip(got, want, ["dq", "dk", "dv", "dbeta", "dg", "dh0"], strict=True):
        assert torch.isfinite(a).all(), name
        assert_rel_rms(a, e, TOL, name)
    # fla's decay exp(-200) = 0 has no gradient; neither has the one it becomes here.
    assert bool((got[4][g.detach() == -200.0] == 0).all())


@pytest.mark.parametrize("backend", ["chunk", "recurrent"])
def test_delta_rule_with_zero_beta_matches_fla(backend):
    q, k, v, beta, _, h0 = inputs(1)
    q, k, v, beta, h0 = leaves = leaves_of([q, k, v, beta, h0])
    o, s = ops.chunk_delta_rule(
        q, k, v, beta, initial_state=h0, output_final_state=True, backend=backend, chunk_size=8
    )
    ref = fla_naive("delta_rule", "delta_rule_recurrence")
    heads = [x.transpose(1, 2) for x in (q, k, v, beta)]
    o_ref, s_ref = ref(*heads, initial_state=h0, output_final_state=True)  # scales q by K^-0.5
    o_ref = o_ref.transpose(1, 2)
    assert_rel_rms(o, o_ref, TOL, "o")
    assert_rel_rms(s, s_ref, TOL, "final state")
    got, want = grads_of([o, s], leaves), grads_of([o_ref, s_ref], leaves)
    for a, e, name in zip(got, want, ["dq", "dk", "dv", "dbeta", "dh0"], strict=True):
        assert_rel_rms(a, e, TOL, name)


def test_chunk_start_form_takes_a_zero_decay():
    """The chunk-start form (log a inside a chunk): a decay of 0 gives finite outputs and
    gradients, equal to those of a decay of exp(-60) = 9e-27 up to float32 rounding."""
    rule = ops.known_rule("gated_deltanet")
    base = inputs(2)
    runs = []
    for low in (-200.0, -math.inf, -60.0):
        q, k, v, beta, g, h0 = leaves = leaves_of(base)
        with torch.no_grad():
            g[g == -200.0] = low
        o, s = ops.call(
            rule, q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=8,
            chunk_mode="start",
        )  # fmt: skip
        runs.append((o, s, grads_of([o, s], leaves)))
    (o0, s0, d0), (o_inf, s_inf, d_inf), (o1, s1, d1) = runs
    assert torch.isfinite(o0).all() and all(torch.isfinite(d).all() for d in d0)
    for a, e in zip([o_inf, s_inf, *d_inf], [o0, s0, *d0], strict=True):
        torch.testing.assert_close(a, e, rtol=0, atol=0)  # g = -inf is the same decay
    assert_rel_rms(o0, o1, TOL, "o")
    assert_rel_rms(s0, s1, TOL, "final state")
    for a, e, name in zip(d0, d1, ["dq", "dk", "dv", "dbeta", "dg", "dh0"], strict=True):
        assert_rel_rms(a, e, TOL, name)


def test_bfloat16_inputs_take_a_decay_that_rounds_to_zero():
    """fla takes float32 gates with bfloat16 inputs: exp(-100) = 3.7e-44 is a float32 number
    but 0 in bfloat16, the dtype the gate is cast to."""
    q, k, v, beta, g, h0 = inputs(3)
    g = torch.where(g == -200.0, -100.0, g)
    low = [x.bfloat16() for x in (q, k, v)]
    o, s = ops.chunk_gated_delta_rule(*low, g, beta, initial_state=h0, output_final_state=True)
    ref = fla_naive("gated_delta_rule", "naive_recurrent_gated_delta_rule")
    o_ref, s_ref = ref(*low, beta, g, initial_state=h0, output_final_state=True)
    assert torch.isfinite(o.float()).all() and torch.isfinite(s).all()
    assert_rel_rms(o, o_ref, 1e-2, "o")  # bfloat16 inputs: 8 significant bits
    assert_rel_rms(s, s_ref, 1e-2, "final state")


def test_functional_takes_zero_beta_and_decay_for_any_spec():
    """`functional` maps g and beta the same way for a spec of its own (momentum: Titans'
    surprise on a matrix memory): beta = 0 writes nothing, so a sequence of zero steps keeps
    the initial state, and a decay of 0 empties it."""
    op = ops.functional(
        {"name": "titans_matrix", "bias": "l2", "retention": "l2", "optimizer": "momentum"},
        backend="recurrent",
    )
    q, k, v, _, _, _ = inputs(4)
    w0 = {"W": torch.randn(B, H, V, K), "S.W": torch.zeros(B, H, V, K)}
    zero, one = torch.zeros(B, T, H), torch.ones(B, T, H)
    moment = {"momentum": 0.5 * one}
    _, kept = op(q, k, v, g=0 * one, beta=zero, gates=moment, initial_state=w0,
                 output_final_state=True)  # fmt: skip
    torch.testing.assert_close(kept["W"], w0["W"], rtol=0, atol=0)
    g = torch.full((B, T, H), -200.0)
    _, emptied = op(q, k, v, g=g, beta=zero, gates=moment, initial_state=w0,
                    output_final_state=True)  # fmt: skip
    assert emptied["W"].abs().max() < 1e-30


def bad_call(**changes):
    q, k, v, beta, g, _ = inputs(5)
    args = {**dict(q=q, k=k, v=v, g=g, beta=beta), **changes}
    return lambda: ops.chunk_gated_delta_rule(**args)


@pytest.mark.parametrize(
    "changes, pieces",
    [
        (dict(beta=torch.full((B, T, H), -0.1)), ["beta", "[0, inf)", "-0.1"]),
        (dict(beta=torch.full((B, T, H), math.nan)), ["beta", "[0, inf)", "nan"]),
        (dict(beta=-1.0), ["beta", "[0, inf)"]),
        (dict(beta=torch.full((B, T), 0.5)), ["beta", "[B, T, H]", str([B, T])]),
        (dict(beta=torch.full((B, T, H, V + 1), 0.5)), ["beta", "[B, T, H, V]", str(V + 1)]),
        (dict(beta=torch.ones(B, T, H, dtype=torch.int64)), ["beta", "floating", "int64"]),
        (dict(g=torch.full((B, T, H), 0.3)), ["g", "g <= 0", "0.3"]),
        (dict(g=torch.full((B, T, H), math.nan)), ["g", "g <= 0", "nan"]),
        (dict(g=math.inf), ["g", "g <= 0", "inf"]),
        (dict(g=torch.zeros(B, T, H + 1)), ["g", "[B, T, H]", str([B, T, H + 1])]),
    ],
    ids=[
        "beta_negative",
        "beta_nan",
        "beta_float_negative",
        "beta_rank2",
        "beta_not_v",
        "beta_int",
        "g_positive",
        "g_nan",
        "g_inf",
        "g_heads",
    ],
)
def test_bad_g_and_beta_name_the_argument(changes, pieces):
    with pytest.raises(ValueError) as err:
        bad_call(**changes)()
    message = str(err.value)
    assert all(p in message for p in pieces), message
    assert "gates[" not in message, message


def test_per_channel_beta_is_taken_where_the_rule_takes_it():
    """DeltaNet takes beta per value channel [B, T, H, V]: the shape check allows it there."""
    q, k, v, beta, _, _ = inputs(6)
    per_channel = beta.unsqueeze(-1).expand(B, T, H, V).contiguous()
    o, _ = ops.chunk_delta_rule(q, k, v, per_channel, chunk_size=8)
    o_head, _ = ops.chunk_delta_rule(q, k, v, beta, chunk_size=8)
    torch.testing.assert_close(o, o_head, rtol=1e-6, atol=1e-6)


# chunk_mode and chunk_size of `functional` and `call` ------------------------------------------

TITANS = "specs/titans.yaml"  # mlp memory: no exact chunk form (its compiled form is "dual")


def titans_inputs(seed=7):
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(1, 24, 2, 4, generator=gen), dim=-1)
    k = F.normalize(torch.randn(1, 24, 2, 4, generator=gen), dim=-1)
    v = torch.randn(1, 24, 2, 4, generator=gen)
    gates = {"momentum": torch.full((1, 24, 2), 0.5)}
    g, beta = torch.full((1, 24, 2), math.log(0.95)), torch.full((1, 24, 2), 0.05)
    return q, k, v, g, beta, gates


@pytest.mark.parametrize("backend", ["chunk", "triton"])
def test_a_spec_without_an_exact_chunk_form_needs_chunk_mode(backend):
    """fla's ops are exact: the chunk-start approximation is never taken unasked."""
    with pytest.raises(ValueError) as err:
        ops.functional(TITANS, backend=backend)
    message = str(err.value)
    for piece in ["chunk_mode", "'titans'", "chunk-start", "'auto'", "'start'", "'recurrent'"]:
        assert piece in message, message
    q, k, v, g, beta, gates = titans_inputs()
    with pytest.raises(ValueError, match="chunk_mode"):
        ops.call(TITANS, q, k, v, g, beta, gates=gates, chunk_size=8)  # a size is not a mode


def test_chosen_chunk_start_form_runs_at_the_layers_chunk_size():
    q, k, v, g, beta, gates = titans_inputs()
    rule = ops._as_rule(TITANS)
    natural = {"decay": g.exp(), "lr": beta, **gates}
    exact, _ = rule(q * 0.5, k, v, natural, backend="recurrent")
    o_rec, _ = ops.functional(TITANS, backend="recurrent")(q, k, v, g, beta, gates=gates)
    torch.testing.assert_close(o_rec, exact, rtol=0, atol=0)  # the recurrence needs no mode
    for mode in ("auto", "start"):
        o, _ = ops.functional(TITANS, chunk_mode=mode)(q, k, v, g, beta, gates=gates)
        want, _ = rule(q * 0.5, k, v, natural, backend="chunk", chunk_size=16, chunk_mode=mode)
        torch.testing.assert_close(o, want, rtol=0, atol=0)


@pytest.mark.parametrize(
    "spec, chunk_mode, expected",
    [
        ("specs/gated_deltanet.yaml", None, ("auto", 64)),  # exact: 64 rows per chunk
        ("specs/omeganet.yaml", None, ("auto", 16)),  # exact, window c = 4: 64 // c
        ("specs/titans.yaml", "auto", ("auto", 16)),  # dual: the layer's chunk-start size
        ("specs/atlas.yaml", "start", ("start", 16)),
    ],
)
def test_default_chunk_size_follows_the_form(spec, chunk_mode, expected):
    rule = ops._as_rule(spec)
    assert ops.chunk_options(rule, "chunk", chunk_mode, None) == expected
    assert ops.chunk_options(rule, "chunk", chunk_mode, 8) == (expected[0], 8)


def test_an_integer_q_is_named_before_the_gates_are_read():
    q, k, v, beta, g, _ = inputs(8)
    with pytest.raises(ValueError, match="q: expected a floating dtype"):
        ops.chunk_gated_delta_rule(q.long(), k, v, g, beta)
