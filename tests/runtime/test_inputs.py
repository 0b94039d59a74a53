"""Bad input at the public boundary gets a ValueError that names the argument; edge cases that
are not bad input (T < chunk size, T = 1, low precision) work and keep their dtypes."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import miras

B, T, H, DK, DV = 2, 5, 3, 4, 6
f32, f64 = torch.float32, torch.float64

RULES = {
    "gdn": "specs/gated_deltanet.yaml",  # gates decay, lr; state a tensor
    "titans_matrix": {  # gates decay, lr, momentum; state a dict {W, S.W}
        "name": "titans_matrix",
        "memory": "matrix",
        "bias": "l2",
        "retention": "l2",
        "optimizer": "momentum",
    },
    "mlp": "specs/titans.yaml",  # an MLP memory: per-head gates only
    "mlp_resnorm": "specs/moneta.yaml",  # x + LN(MLP(x)): needs Dv = Dk
    "attention": "specs/attention.yaml",  # no state
}


def valid_call(rule_name: str, dtype=f32, t=T) -> dict:
    """Keyword arguments of a call that succeeds."""
    rule = miras.compile(RULES[rule_name])
    gen = torch.Generator().manual_seed(0)
    q = torch.nn.functional.normalize(torch.randn(B, t, H, DK, generator=gen), dim=-1).to(dtype)
    k = torch.nn.functional.normalize(torch.randn(B, t, H, DK, generator=gen), dim=-1).to(dtype)
    d_v = DK if rule_name == "mlp_resnorm" else DV  # x + LN(MLP(x)) maps Dk to Dk
    v = torch.randn(B, t, H, d_v, generator=gen).to(dtype)
    gates = {n: (0.5 + 0.4 * torch.rand(B, t, H, generator=gen)).to(dtype) for n in rule.gates}
    return dict(q=q, k=k, v=v, gates=gates, backend="chunk", chunk_size=4)


def call(rule_name: str, kwargs: dict):
    rule = miras.compile(RULES[rule_name])
    kwargs = dict(kwargs)
    q, k, v, gates = kwargs.pop("q"), kwargs.pop("k"), kwargs.pop("v"), kwargs.pop("gates")
    return rule(q, k, v, gates, output_final_state=True, **kwargs)


def set_arg(name, value_fn: Callable[[dict], object]):
    def mutate(a: dict) -> None:
        a[name] = value_fn(a)

    return mutate


def set_gate(name, value_fn):
    def mutate(a: dict) -> None:
        a["gates"] = {**a["gates"], name: value_fn(a)}

    return mutate


def drop_gate(name):
    def mutate(a: dict) -> None:
        a["gates"] = {n: g for n, g in a["gates"].items() if n != name}

    return mutate


def state_of(rule_name: str, transform):
    """An initial state built from the rule's default for these sizes, then altered."""

    def value(a: dict):
        state = miras.compile(RULES[rule_name]).initial_state(B, H, DK, DV, f32)
        return transform(state)

    return set_arg("initial_state", value)


def first_tokens(n: int):
    def mutate(a: dict) -> None:
        a.update({x: a[x][:, :n] for x in "qkv"})
        a["gates"] = {name: g[:, :n] for name, g in a["gates"].items()}

    return mutate


def gate_like(a: dict, fill: float, tail=()) -> torch.Tensor:
    return torch.full((B, a["q"].shape[1], H, *tail), fill)


# (id, rule, mutation of a valid call, words the message must contain; the first is the
# argument's name, which the message starts with: "<argument>: what was expected, got ...")
# fmt: off
BAD = [
    ("q_rank3", "gdn", set_arg("q", lambda a: a["q"][0]), ["q", "4 axes"]),
    ("v_rank5", "gdn", set_arg("v", lambda a: a["v"][None]), ["v", "4 axes"]),
    ("q_not_tensor", "gdn", set_arg("q", lambda a: a["q"].tolist()), ["q", "tensor"]),
    ("k_wider_than_q", "gdn", set_arg("k", lambda a: torch.randn(B, T, H, DK + 1)), ["q and k", "equal shapes"]),
    ("k_longer_than_q", "gdn", set_arg("k", lambda a: torch.randn(B, T + 1, H, DK)), ["q and k"]),
    ("v_batch_mismatch", "gdn", set_arg("v", lambda a: torch.randn(B + 1, T, H, DV)), ["v", "[B, T, H]"]),
    ("v_heads_mismatch", "gdn", set_arg("v", lambda a: torch.randn(B, T, H + 1, DV)), ["v"]),
    ("mixed_dtypes", "gdn", set_arg("v", lambda a: a["v"].double()), ["q, k, v", "one dtype"]),
    ("integer_dtype", "gdn", set_arg("q", lambda a: a["q"].long()), ["q", "floating"]),
    ("no_tokens", "gdn", first_tokens(0), ["q, k, v", "T >= 1"]),
    ("missing_gate", "gdn", drop_gate("lr"), ["gates", "'lr'", "decay, lr"]),
    ("no_gates_at_all", "titans_matrix", set_arg("gates", lambda a: None), ["gates", "'decay'", "'momentum'", "decay, lr, momentum"]),
    ("unknown_gate", "gdn", set_gate("beta", lambda a: gate_like(a, 0.5)), ["gates", "'beta'", "decay, lr"]),
    ("gates_not_a_dict", "gdn", set_arg("gates", lambda a: a["gates"]["lr"]), ["gates"]),
    ("gate_not_tensor", "gdn", set_gate("lr", lambda a: [0.5]), ["gates['lr']", "tensor"]),
    ("scalar_gate_out_of_range", "gdn", set_gate("decay", lambda a: 1.5), ["gates['decay']", "(0, 1]"]),
    ("gate_rank2", "gdn", set_gate("lr", lambda a: torch.full((B, T), 0.5)), ["gates['lr']", "[B, T, H]"]),
    ("gate_channels_not_dv", "gdn", set_gate("lr", lambda a: gate_like(a, 0.5, (DK,))), ["gates['lr']", "[B, T, H, Dv]"]),
    ("decay_1.5", "gdn", set_gate("decay", lambda a: gate_like(a, 1.5)), ["gates['decay']", "(0, 1]", "1.5"]),
    ("decay_0", "gdn", set_gate("decay", lambda a: gate_like(a, 0.0)), ["gates['decay']", "(0, 1]"]),
    ("decay_nan", "gdn", set_gate("decay", lambda a: gate_like(a, float("nan"))), ["gates['decay']", "(0, 1]"]),
    ("lr_negative", "gdn", set_gate("lr", lambda a: gate_like(a, -0.1)), ["gates['lr']", "[0, inf)"]),
    ("momentum_1", "titans_matrix", set_gate("momentum", lambda a: gate_like(a, 1.0)), ["gates['momentum']", "[0, 1)"]),
    ("chunk_size_0", "gdn", set_arg("chunk_size", lambda a: 0), ["chunk_size", "positive"]),
    ("chunk_size_-3", "gdn", set_arg("chunk_size", lambda a: -3), ["chunk_size", "-3"]),
    ("chunk_size_2.5", "gdn", set_arg("chunk_size", lambda a: 2.5), ["chunk_size", "2.5"]),
    ("chunk_size_True", "gdn", set_arg("chunk_size", lambda a: True), ["chunk_size", "True"]),
    ("chunk_size_str", "gdn", set_arg("chunk_size", lambda a: "64"), ["chunk_size"]),
    ("backend_unknown", "gdn", set_arg("backend", lambda a: "cuda"), ["backend", "recurrent", "chunk", "'cuda'"]),
    ("backend_triton_mlp_resnorm", "mlp_resnorm", set_arg("backend", lambda a: "triton"), ["backend", "triton", "memory.residual_norm", "mlp of depth 2", "'chunk'", "'recurrent'"]),
    ("mlp_per_channel_lr", "mlp", set_gate("lr", lambda a: gate_like(a, 0.5, (DV,))), ["gates['lr']", "per-channel", "per head"]),
    ("mlp_residual_norm_dv_ne_dk", "mlp_resnorm", set_arg("v", lambda a: torch.randn(B, T, H, DV)), ["v", "Dv"]),
    ("state_wrong_shape", "gdn", state_of("gdn", lambda s: s.transpose(-1, -2)), ["initial_state", "[2, 3, 6, 4]"]),
    ("state_missing_key", "titans_matrix", state_of("titans_matrix", lambda s: {"W": s["W"]}), ["initial_state", "S.W"]),
    ("state_unknown_key", "titans_matrix", state_of("titans_matrix", lambda s: {**s, "Z": s["W"]}), ["initial_state", "'Z'"]),
    ("state_tensor_for_dict", "titans_matrix", state_of("titans_matrix", lambda s: s["W"]), ["initial_state", "dict", "tensor"]),
    ("state_key_wrong_shape", "mlp", state_of("mlp", lambda s: {**s, "W1": s["W1"][..., :-1]}), ["initial_state['W1']", "expected shape"]),
    ("state_a_list", "gdn", state_of("gdn", lambda s: [s]), ["initial_state", "list"]),
    ("state_for_attention", "attention", state_of("gdn", lambda s: s), ["initial_state", "None"]),
]
# fmt: on


@pytest.mark.parametrize("rule_name,mutate,words", [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_input_raises_named_value_error(rule_name, mutate, words):
    kwargs = valid_call(rule_name)
    call(rule_name, kwargs)  # the unaltered call succeeds
    mutate(kwargs)
    with pytest.raises(ValueError) as info:
        call(rule_name, kwargs)
    message = str(info.value)
    assert words[0] in message.split(":")[0], message
    for word in words[1:]:
        assert word in message, f"{word!r} not in {message!r}"


# What is not bad input ------------------------------------------------------------------------


@pytest.mark.parametrize("rule_name", ["gdn", "titans_matrix", "mlp"])
def test_sequence_shorter_than_chunk(rule_name):
    """T = 5 < chunk_size = 64 is one partial chunk: the same as chunk_size = T."""
    kwargs = valid_call(rule_name, dtype=f64)
    o_long, s_long = call(rule_name, {**kwargs, "chunk_size": 64})
    o_t, s_t = call(rule_name, {**kwargs, "chunk_size": T})
    assert o_long.shape == (B, T, H, DV)
    torch.testing.assert_close(o_long, o_t, rtol=0, atol=0)
    for a, b in zip(flat(s_long), flat(s_t), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("rule_name", ["gdn", "titans_matrix", "mlp", "attention"])
def test_single_token(rule_name):
    """T = 1: both backends run, and agree (one token is its own chunk)."""
    kwargs = valid_call(rule_name, dtype=f64, t=1)
    o_r, s_r = call(rule_name, {**kwargs, "backend": "recurrent"})
    o_c, s_c = call(rule_name, {**kwargs, "backend": "chunk", "chunk_size": 64})
    assert o_r.shape == (B, 1, H, DV)
    assert bool(torch.isfinite(o_r).all())
    torch.testing.assert_close(o_c, o_r, rtol=1e-12, atol=1e-12)
    for a, b in zip(flat(s_c), flat(s_r), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def flat(state) -> list[torch.Tensor]:
    if state is None:
        return []
    return list(state.values()) if isinstance(state, dict) else [state]


@pytest.mark.parametrize("backend", ["recurrent", "chunk"])
@pytest.mark.parametrize("rule_name", ["gdn", "titans_matrix", "mlp"])
@pytest.mark.parametrize(
    "dtype,state_dtype",
    [(f32, f32), (f64, f64), (torch.bfloat16, f32)],
    ids=["float32", "float64", "bfloat16"],
)
def test_dtypes(rule_name, backend, dtype, state_dtype):
    """The output has the inputs' dtype; the state is float32, float64 for float64 inputs."""
    kwargs = valid_call(rule_name, dtype=dtype)
    o, state = call(rule_name, {**kwargs, "backend": backend})
    assert o.dtype == dtype
    assert bool(torch.isfinite(o.float()).all())
    tensors = flat(state)
    assert tensors
    for s in tensors:
        assert s.dtype == state_dtype
