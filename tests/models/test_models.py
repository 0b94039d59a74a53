"""The memory layer, the mixers, the hybrids and the language model.

Decoding token by token equals the parallel forward (float64, the recurrent backend, and the
chunk backend at chunk size 1); every variant is causal and trains (forward and backward);
gates stay in their ranges; learned initial states stay in the retention's domain.
"""

from __future__ import annotations

import math

import pytest
import torch

import miras
from miras.components.base import HALF_OPEN_UNIT, POSITIVE, UNIT, Range
from miras.models import Attention, GateMaps, MirasLayer, build_model
from miras.models.layer import squash
from miras.training.recipe import loss_of

VOCAB, B, T = 11, 2, 13
SMALL = {"d_model": 16, "n_heads": 2, "n_layers": 2, "swa_window": 5, "mac_segment": 4}
GATED_DELTANET = {"name": "gdn", "retention": {"kind": "l2", "grad_at": "retained"}}
TITANS = {
    "name": "titans",
    "memory": {"kind": "mlp", "depth": 2, "expansion": 2},
    "retention": "l2",
    "optimizer": "momentum",
}
MEMORA = {
    "name": "memora",
    "memory": {"kind": "mlp", "expansion": 2, "residual_norm": True},
    "retention": "kl",
}
OMEGA = {
    "name": "omega",
    "feature_map": {"kind": "polynomial", "degree": 2},
    "retention": "l2",
    "window": {"c": 3, "gamma": "gate"},
}
ATTENTION = {"name": "attn", "memory": "nonparametric"}


pytestmark = pytest.mark.usefixtures("one_thread")


def model_of(spec: dict, dtype=torch.float64, **model):
    torch.manual_seed(0)
    return build_model({**spec, "model": {**SMALL, **model}}, VOCAB).to(dtype)


def tokens(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))


def decode(model, x: torch.Tensor) -> torch.Tensor:
    cache = model.empty_cache(x.shape[0])
    outputs = []
    for t in range(x.shape[1]):
        logits, cache = model.decode(x[:, t : t + 1], cache)
        outputs.append(logits)
    return torch.cat(outputs, dim=1)


# Decoding equals the parallel forward -------------------------------------------------------

DECODE_CASES = [
    pytest.param(GATED_DELTANET, {"variant": v, "backend": "recurrent"}, id=f"gdn-{v}")
    for v in ("lmm", "mal", "mag", "mac", "attention", "swa")
] + [
    pytest.param(GATED_DELTANET, {"chunk_size": 1}, id="gdn-chunk1"),
    pytest.param(GATED_DELTANET, {"variant": "mac", "chunk_size": 1}, id="gdn-mac-chunk1"),
    pytest.param(TITANS, {"backend": "recurrent", "persistent_tokens": 2}, id="titans-persistent"),
    pytest.param(
        MEMORA,
        {"variant": "mac", "backend": "recurrent", "persistent_tokens": 2},
        id="memora-mac-persistent",
    ),
    pytest.param(
        OMEGA,
        {"variant": "mag", "backend": "recurrent", "persistent_tokens": 1},
        id="omega-window-mag",
    ),
    pytest.param(ATTENTION, {"persistent_tokens": 2}, id="attention-spec"),
    pytest.param(ATTENTION, {"variant": "swa", "positions": "conv"}, id="swa-conv"),
    pytest.param(ATTENTION, {"variant": "swa", "persistent_tokens": 2}, id="swa-persistent"),
]


@pytest.mark.parametrize(("spec", "model"), DECODE_CASES)
def test_decoding_token_by_token_equals_the_parallel_forward(spec, model):
    m = model_of(spec, **model)
    x = tokens()
    parallel = m(x)
    stepped = decode(m, x)
    assert parallel.shape == (B, T, VOCAB)
    torch.testing.assert_close(stepped, parallel, rtol=1e-10, atol=1e-10)


def test_decoding_in_pieces_equals_one_pass():
    """A cache carries everything: two pieces (a prefill, then tokens) equal one pass."""
    m = model_of(GATED_DELTANET, variant="mal", backend="recurrent")
    x = tokens()
    logits_a, cache = m.decode(x[:, :6], m.empty_cache(B))
    logits_b, _ = m.decode(x[:, 6:], cache)
    torch.testing.assert_close(torch.cat([logits_a, logits_b], 1), m(x), rtol=1e-10, atol=1e-10)


def test_chunk_start_decoding_is_the_chunk_semantics_not_the_recurrence():
    """At chunk size 4 the chunk-start form (chunk_mode "start") takes gradients at chunk
    starts: it differs from the exact recurrence (docs/chunking.md), and decoding computes
    what it computes, not the recurrence (docs/models.md, "Decoding"). (The default, "auto",
    solves Gated DeltaNet's chunks exactly.)"""
    chunked = model_of(GATED_DELTANET, chunk_size=4, chunk_mode="start")
    exact = model_of(GATED_DELTANET, backend="recurrent")
    exact.load_state_dict(chunked.state_dict())  # the lr gate starts lower in the chunk-start form
    x = tokens()
    assert (chunked(x) - exact(x)).abs().max() > 1e-6
    torch.testing.assert_close(decode(chunked, x), chunked(x), rtol=1e-10, atol=1e-10)


# Every variant is causal and trains ---------------------------------------------------------

VARIANTS = ("lmm", "mal", "mag", "mac", "attention", "swa")


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_variant_is_causal(variant):
    m = model_of(GATED_DELTANET, variant=variant, chunk_size=4)
    x = tokens()
    y = x.clone()
    y[:, 7] = (y[:, 7] + 1) % VOCAB
    a, b = m(x), m(y)
    torch.testing.assert_close(a[:, :7], b[:, :7], rtol=0, atol=1e-12)
    assert (a[:, 7:] - b[:, 7:]).abs().max() > 1e-8


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_variant_runs_forward_and_backward(variant):
    m = model_of(GATED_DELTANET, dtype=torch.float32, variant=variant, persistent_tokens=2)
    x = tokens()
    loss = loss_of(m(x), x)
    loss.backward()
    grads = {n: p.grad for n, p in m.named_parameters()}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
    if variant not in ("attention", "swa"):  # the memory's own parameters learn
        # (gates.down starts with no gradient: gates.up starts at zero, LoRA-style)
        memory = [g for n, g in grads.items() if "state0" in n or "gates.up" in n]
        assert memory and all(g.abs().sum() > 0 for g in memory)


@pytest.mark.parametrize(
    "spec",
    [TITANS, MEMORA, OMEGA, {"name": "yaad", "bias": "huber", "retention": "l2"}],
    ids=["titans", "memora", "omega", "huber"],
)
def test_memory_layers_of_other_components_train(spec):
    m = model_of(spec, dtype=torch.float32, n_layers=1)
    loss = loss_of(m(tokens()), tokens(1))
    loss.backward()
    assert torch.isfinite(loss)
    missing = [n for n, p in m.named_parameters() if p.grad is None]
    assert not missing, f"no gradient reached {missing}"
    assert all(torch.isfinite(p.grad).all() for p in m.parameters())


# Gates, states and parameters ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("allowed", "ceiling"),
    [
        (UNIT, None),
        (HALF_OPEN_UNIT, None),
        (POSITIVE, None),
        (POSITIVE, 1.0),
        (Range(2, 3, lo_closed=True), None),
    ],
    ids=["decay", "momentum", "positive", "lr", "closed-open"],
)
def test_squash_stays_inside_the_range_even_at_extremes(allowed, ceiling):
    raw = torch.tensor([-1e4, -100.0, -20.0, 0.0, 20.0, 100.0, 1e4])
    y = squash(raw, allowed, ceiling)
    assert all(value in allowed for value in y.tolist())
    if ceiling is not None:
        assert y.max() <= ceiling


def test_gates_start_where_intended():
    rule = miras.compile({"name": "t", "retention": "l2", "optimizer": "momentum"})
    gates = GateMaps(rule.plan.gates, 16, 4, rank=4)(torch.randn(2, 3, 16))
    assert sorted(gates) == sorted(rule.gates)
    decay = gates["decay"][0, 0]
    # RetNet's multi-scale decays, 1 - 2^(-5 - h) for head h
    torch.testing.assert_close(decay, torch.tensor([31 / 32, 63 / 64, 127 / 128, 255 / 256]))
    torch.testing.assert_close(gates["lr"], torch.full_like(gates["lr"], 0.5))
    assert gates["decay"].shape == (2, 3, 4)


def test_many_heads_start_with_finite_gates():
    """Past 48 heads RetNet's 1 - 2^(-5 - h) rounds to 1.0, the closed end of the decay range."""
    rule = miras.compile({"name": "t", "retention": "l2"})
    decay = GateMaps(rule.plan.gates, 64, 64, rank=4)(torch.randn(1, 2, 64))["decay"]
    assert torch.isfinite(decay).all() and (decay > 0.96).all() and (decay <= 1).all()


def test_learned_state_stays_in_the_retention_domain():
    """KL's state lives on w > 0: the learned W_0 is stored as log W."""
    layer = MirasLayer(MEMORA, 16, 2)
    state = layer.state0(3)
    assert all(w.shape[0] == 3 and (w > 0).all() for w in state.values())
    with torch.no_grad():
        for p in layer.state0.learned.values():
            p.sub_(100.0)  # far below zero in the raw space
    assert all((w > 0).all() for w in layer.state0(1).values())


def test_preconditioner_statistics_start_at_zero_unlearned():
    """A preconditioner's curvature sum A ("P.W") is not a parameter: a learned A turned
    negative after an optimizer step, and log(A + eps) made the layer's output NaN."""
    layer = MirasLayer(miras.load_spec("specs/precond_gdn.yaml"), 16, 2)
    assert [n for n, _ in layer.state0.named_parameters()] == ["learned.W"]
    state = layer.state0(3)
    assert state["P.W"].shape[0] == 3 and (state["P.W"] == 0).all()


def test_polynomial_coefficients_are_parameters():
    layer = MirasLayer(OMEGA, 16, 2)
    names = [n for n, _ in layer.named_parameters()]
    assert "rule_params.feature_map" in names
    assert layer.rule_params["feature_map"].shape == (2,)


def test_parameter_counts_are_comparable():
    """The baselines and the memory model are of the same size (within a factor of 1.5)."""
    counts = {
        v: sum(p.numel() for p in model_of(GATED_DELTANET, variant=v).parameters())
        for v in ("lmm", "attention")
    }
    assert counts["lmm"] / counts["attention"] < 1.5


# Bad configurations get named errors --------------------------------------------------------


def test_a_hybrid_of_attention_with_itself_is_refused():
    with pytest.raises(ValueError, match=r"model.variant: 'mag'.*nonparametric"):
        model_of(ATTENTION, variant="mag")


def test_nonparametric_spec_is_not_a_memory_layer():
    with pytest.raises(ValueError, match=r"miras\.models\.Attention"):
        MirasLayer(ATTENTION, 16, 2)


def test_model_section_errors_name_the_field():
    with pytest.raises(miras.SpecError) as info:
        miras.load_spec({"name": "x", "model": {"d_model": 30, "n_heads": 4, "variant": "mca"}})
    text = str(info.value)
    assert "model.variant" in text and "lmm, mal, mag, mac" in text
    with pytest.raises(miras.SpecError, match=r"n_heads \(4\) must divide d_model \(30\)"):
        miras.load_spec({"name": "x", "model": {"d_model": 30, "n_heads": 4}})
    with pytest.raises(miras.SpecError, match="did you mean 'swa_window'"):
        miras.load_spec({"name": "x", "model": {"swa_windw": 3}})


def test_the_model_section_does_not_change_the_rule_digest():
    a = miras.load_spec({"name": "x", "model": {"d_model": 32}})
    assert a.digest() == miras.load_spec({"name": "x"}).digest()
    assert miras.load_spec(a.to_yaml()) == a


def test_rotary_attention_sees_relative_positions():
    """Rotary scores depend on the distance only: shifting every position changes nothing."""
    from miras.models.mixers import rotary

    q, k = (
        torch.randn(1, 1, 5, 8, dtype=torch.float64),
        torch.randn(1, 1, 5, 8, dtype=torch.float64),
    )
    pos = torch.arange(5)
    scores = rotary(q, pos) @ rotary(k, pos).transpose(-1, -2)
    shifted = rotary(q, pos + 7) @ rotary(k, pos + 7).transpose(-1, -2)
    torch.testing.assert_close(scores, shifted)
    assert not math.isclose(scores.sum().item(), (q @ k.transpose(-1, -2)).sum().item())


def test_sliding_window_sees_only_the_window():
    attn = Attention(8, 2, window=3, positions="none").double()
    x = torch.randn(1, 10, 8, dtype=torch.float64)
    y = x.clone()
    y[:, 2] += 1.0  # token 2 is outside the window of tokens 5..9
    a, _ = attn(x)
    b, _ = attn(y)
    torch.testing.assert_close(a[:, 5:], b[:, 5:])
    assert (a[:, 2:5] - b[:, 2:5]).abs().max() > 1e-6
