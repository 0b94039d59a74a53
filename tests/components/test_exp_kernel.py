"""ATLAS section 4: the exponential kernel's feature map, `window: global`, the DeepTransformer
and Deep Omega Transformer specs, and the claim that the linear DeepTransformer tends to
softmax attention as the map's order P grows."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import miras
from miras.compiler.triton_kernels import unsupported_reason
from miras.components.feature_map.exp_kernel import ExpKernelMap
from miras.errors import SpecError
from miras.models.layer import MirasLayer
from miras.models.model import build_model
from miras.tasks import make_task

ROOT = Path(__file__).resolve().parents[2]
f64 = torch.float64
NEW_SPECS = [
    "specs/deep_transformer.yaml",
    "specs/sw_deep_transformer.yaml",
    "specs/deep_omega_transformer.yaml",
    "specs/examples/linear_deep_transformer.yaml",
    "specs/examples/linear_deep_omega_transformer.yaml",
]


def _randn(*shape, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return scale * torch.randn(*shape, generator=gen, dtype=f64)


# The map --------------------------------------------------------------------------------------


@pytest.mark.parametrize("order", range(5))
@pytest.mark.parametrize("gating", [False, True])
def test_inner_product_is_the_taylor_polynomial_of_exp(order, gating):
    fm = ExpKernelMap(order=order, gating=gating)
    q, k = _randn(6, 5, seed=1), _randn(6, 5, seed=2)
    a = fm.initial_params()["feature_map"].to(f64) if gating else None
    got = (fm.apply(q, a) * fm.apply(k, a)).sum(-1)
    dot = (q * k).sum(-1)
    want = sum(dot**p / math.factorial(p) for p in range(order + 1))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("order", range(5))
def test_gating_weighs_each_degree_by_its_coefficient_squared(order):
    fm = ExpKernelMap(order=order, gating=True)
    q, k = _randn(6, 4, seed=3), _randn(6, 4, seed=4)
    a = _randn(order + 1, seed=5)
    got = fm.features(q, {"feature_map": a}, None) * fm.features(k, {"feature_map": a}, None)
    dot = (q * k).sum(-1)
    want = sum(a[p] ** 2 * dot**p / math.factorial(p) for p in range(order + 1))
    torch.testing.assert_close(got.sum(-1), want, rtol=0, atol=1e-12)


def _unpacked(x: torch.Tensor, order: int) -> torch.Tensor:
    """[1, x, x (x) x / sqrt 2!, ...] with every ordered index tuple: width sum_p d^p."""
    blocks, power = [torch.ones(1, dtype=x.dtype)], torch.ones(1, dtype=x.dtype)
    for p in range(1, order + 1):
        power = torch.kron(power, x)
        blocks.append(power / math.sqrt(math.factorial(p)))
    return torch.cat(blocks)


@pytest.mark.parametrize("d, order", [(1, 4), (3, 3), (5, 2), (4, 4)])
def test_packing_keeps_the_inner_product_of_the_full_tensor_powers(d, order):
    fm = ExpKernelMap(order=order)
    xs = _randn(5, d, seed=6)
    packed = fm.apply(xs)
    full = torch.stack([_unpacked(x, order) for x in xs])
    torch.testing.assert_close(packed @ packed.T, full @ full.T, rtol=0, atol=1e-12)
    assert packed.shape[-1] == math.comb(d + order, order) == fm.output_dim(d)
    if d > 1 and order > 1:
        assert packed.shape[-1] < full.shape[-1]


def test_packed_monomials_are_each_present_once():
    fm = ExpKernelMap(order=3)
    d = 3
    x = torch.tensor([2.0, 3.0, 5.0], dtype=f64)  # primes: each monomial a distinct product
    values = fm.apply(x)
    expected = [1.0]
    for p in range(1, 4):
        for m in itertools.combinations_with_replacement(range(d), p):
            alpha = [m.count(i) for i in range(d)]
            weight = 1 / math.sqrt(math.prod(math.factorial(n) for n in alpha))
            expected.append(weight * math.prod(x[i].item() for i in m))
    torch.testing.assert_close(values, torch.tensor(expected, dtype=f64), rtol=1e-15, atol=0)


def test_feature_budget_is_refused_at_validation_and_at_run_time():
    spec = {"name": "big", "feature_map": {"kind": "exp_kernel", "order": 4}}
    with pytest.raises(SpecError, match=r"feature_map.max_features: .*C\(d \+ P, P\) = 58905"):
        miras.load_spec(spec)  # d_model 64, 2 heads: d = 32
    with pytest.raises(ValueError, match="over max_features = 10; lower order"):
        ExpKernelMap(order=2, max_features=10).apply(torch.zeros(4, 4))
    raised = {**spec, "feature_map": {**spec["feature_map"], "max_features": 60000}}
    assert miras.load_spec(raised).feature_map.output_dim(32) == 58905


# window: global --------------------------------------------------------------------------------

B, T, H, D = 2, 7, 2, 3


def _qkv(seed: int = 0):
    return tuple(_randn(B, T, H, D, seed=seed + i, scale=0.5) for i in range(3))


def _lr(value: float = 0.3):
    return {"lr": torch.full((B, T, H), value, dtype=f64)}


CASES = {
    "matrix_l2": {"memory": {"kind": "matrix", "init": "zeros"}, "bias": "l2"},
    "matrix_dot": {"memory": {"kind": "matrix", "init": "zeros"}, "bias": "dot"},
    "mlp_l2": {"memory": {"kind": "mlp", "depth": 2, "expansion": 2}, "bias": "l2"},
    "exp_kernel_huber": {
        "feature_map": {"kind": "exp_kernel", "order": 2},
        "bias": {"kind": "huber", "delta": 0.5},
    },
}


def _rule(case: str, window):
    spec = {"name": f"g_{case}", **CASES[case], "optimizer": {"kind": "gd", "lr": "gate"}}
    return miras.compile({**spec, "window": window}, checked=False)


FORMS = [("recurrent", "auto"), ("chunk", "auto"), ("chunk", "start")]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize(("backend", "mode"), FORMS, ids=["recurrent", "chunk", "chunk-start"])
@pytest.mark.parametrize("c", [T, T + 3])
def test_global_equals_a_window_at_least_the_sequence(case, backend, mode, c):
    q, k, v = _qkv()
    options = {"backend": backend, "chunk_size": 3, "chunk_mode": mode}
    whole, _ = _rule(case, "global")(q, k, v, _lr(), **options)
    window, _ = _rule(case, c)(q, k, v, _lr(), **options)
    torch.testing.assert_close(whole, window, rtol=1e-12, atol=1e-12)


def test_global_is_not_a_shorter_window():
    q, k, v = _qkv()
    whole, _ = _rule("matrix_l2", "global")(q, k, v, _lr(), backend="recurrent")
    short, _ = _rule("matrix_l2", T - 2)(q, k, v, _lr(), backend="recurrent")
    assert (whole - short).abs().max() > 1e-3


def direct_whole_prefix(q, k, v, lr: float, bias: str):
    """W_t = W_{t-1} - lr sum_{i<=t} dL/dW(W_{t-1}; k_i, v_i) from W_0 = 0, o_t = W_t q_t: the
    matrix memory, identity map, l2 (L = ||W k - v||^2 / 2 per channel sum) or dot bias."""
    w = torch.zeros(B, H, D, D, dtype=f64)
    out = []
    for t in range(T):
        g = torch.zeros_like(w)
        for i in range(t + 1):
            ki, vi = k[:, i], v[:, i]  # [B, H, D]
            err = (w @ ki.unsqueeze(-1)).squeeze(-1) - vi if bias == "l2" else -vi
            g = g + err.unsqueeze(-1) * ki.unsqueeze(-2)
        w = w - lr * g
        out.append((w @ q[:, t].unsqueeze(-1)).squeeze(-1))
    return torch.stack(out, dim=1)  # [B, T, H, D]


@pytest.mark.parametrize("bias", ["l2", "dot"])
@pytest.mark.parametrize("backend", ["recurrent", "chunk"])
def test_global_equals_the_direct_whole_prefix_update(bias, backend):
    q, k, v = _qkv(seed=3)
    rule = _rule(f"matrix_{bias}", "global")
    o, _ = rule(q, k, v, _lr(0.3), backend=backend, chunk_size=4)
    torch.testing.assert_close(o, direct_whole_prefix(q, k, v, 0.3, bias), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("backend", ["recurrent", "chunk"])
def test_global_state_carries_the_whole_prefix(backend):
    q, k, v = _qkv(seed=5)
    rule = _rule("matrix_l2", "global")
    whole, _ = rule(q, k, v, _lr(), backend=backend, chunk_size=2)
    first, state = rule(
        q[:, :4],
        k[:, :4],
        v[:, :4],
        {"lr": _lr()["lr"][:, :4]},
        backend=backend,
        chunk_size=2,
        output_final_state=True,
    )
    assert state["window.k"].shape[2] == 4 and bool((state["window.valid"] == 1).all())
    rest, state = rule(
        q[:, 4:],
        k[:, 4:],
        v[:, 4:],
        {"lr": _lr()["lr"][:, 4:]},
        backend=backend,
        chunk_size=2,
        initial_state=state,
        output_final_state=True,
    )
    assert state["window.k"].shape[2] == T
    torch.testing.assert_close(torch.cat([first, rest], 1), whole, rtol=1e-12, atol=1e-12)


def test_decoding_a_global_layer_token_by_token_equals_one_pass():
    """The model's cache carries the whole prefix (window.k grows by one token a step)."""
    spec = miras.load_spec(ROOT / "specs/deep_transformer.yaml").model_dump(mode="json")
    spec["model"] = {**spec["model"], "n_layers": 1, "backend": "recurrent"}
    torch.manual_seed(0)
    model = build_model(miras.load_spec(spec), 16).double()
    layer = next(m for m in model.modules() if isinstance(m, MirasLayer))
    x = _randn(1, 5, spec["model"]["d_model"], seed=9)
    whole, _ = layer(x, layer.empty_cache(1))
    cache, steps = layer.empty_cache(1), []
    for t in range(5):
        y, cache = layer(x[:, t : t + 1], cache)
        steps.append(y)
    assert cache["memory"]["window.k"].shape[2] == 5
    torch.testing.assert_close(torch.cat(steps, 1), whole, rtol=1e-12, atol=1e-12)


def test_triton_refuses_global_with_its_reason():
    rule = _rule("matrix_l2", "global")
    assert "window: global" in unsupported_reason(rule.spec)
    with pytest.raises(ValueError, match="does not cover spec 'g_matrix_l2': window: global"):
        rule(*_qkv(), _lr(), backend="triton")


def test_global_spec_round_trips_and_names_bad_windows():
    spec = miras.load_spec({"name": "g", "window": "global"})
    assert spec.window.is_global and miras.load_spec(spec.to_yaml()) == spec
    with pytest.raises(SpecError, match=r"window.c: expected an integer in .* or 'global'"):
        miras.load_spec({"name": "g", "window": {"c": "all"}})


# The specs --------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", NEW_SPECS, ids=lambda p: Path(p).stem)
def test_new_spec_trains_a_few_steps_on_mqar(path):
    spec = miras.load_spec(ROOT / path).model_dump(mode="json")
    spec["model"] = {**spec["model"], "n_layers": 1, "chunk_size": 8}
    task = make_task("mqar", seq_len=8, num_pairs=2, vocab_size=16)
    result = miras.train(
        spec, task, steps=3, eval_every=3, batch_size=4, progress=False, eval_batches=1, warmup=1
    )
    assert len(result.losses) == 3 and all(math.isfinite(x) for x in result.losses)


def test_dot_at_c1_with_a_matrix_memory_is_the_delta_rule_on_mapped_keys():
    spec = miras.load_spec(ROOT / "specs/examples/linear_deep_omega_transformer.yaml")
    online = spec.model_copy(update={"window": spec.window.model_copy(update={"c": 1})})
    rule = miras.compile(online, checked=False)
    q, k, v = _qkv(seed=7)
    beta = torch.rand(B, T, H, generator=torch.Generator().manual_seed(8), dtype=f64)
    gates = {"lr": beta, "gamma": torch.ones(B, T, H, dtype=f64)}
    o, _ = rule(q, k, v, gates, backend="recurrent")
    fm = spec.feature_map
    w = rule.initial_state(B, H, D, D, f64)  # [B, H, Dv, Dphi]
    out = []
    for t in range(T):  # W_t = W_{t-1} - beta_t (W_{t-1} phi(k_t) - v_t) phi(k_t)^T
        phi_k, phi_q = fm.apply(k[:, t]), fm.apply(q[:, t])
        err = (w @ phi_k.unsqueeze(-1)).squeeze(-1) - v[:, t]
        w = w - beta[:, t, :, None, None] * err.unsqueeze(-1) * phi_k.unsqueeze(-2)
        out.append((w @ phi_q.unsqueeze(-1)).squeeze(-1))
    torch.testing.assert_close(o, torch.stack(out, 1), rtol=1e-12, atol=1e-12)


# ATLAS's claim: the linear DeepTransformer tends to softmax attention -------------------------


def claim_errors(orders, seed: int = 0, length: int = 12, d: int = 4):
    """Relative error of the linear DeepTransformer (specs/examples/linear_deep_transformer.yaml
    at order P) against sum_{i<=t} exp(q_t . k_i) v_i, on q, k with |q . k| <= 1 (unit rows)."""
    gen = torch.Generator().manual_seed(seed)
    q, k = (
        F.normalize(torch.randn(1, length, 2, d, generator=gen, dtype=f64), dim=-1)
        for _ in range(2)
    )
    v = torch.randn(1, length, 2, d, generator=gen, dtype=f64)
    scores = torch.einsum("bthd,bshd->bhts", q, k).exp().tril()
    want = torch.einsum("bhts,bshd->bthd", scores, v)
    base = miras.load_spec(ROOT / "specs/examples/linear_deep_transformer.yaml")
    errors = []
    for order in orders:
        fm = base.feature_map.model_copy(update={"order": order})
        rule = miras.compile(base.model_copy(update={"feature_map": fm}), checked=False)
        got, _ = rule(q, k, v, backend="chunk", chunk_size=4)
        errors.append(((got - want).norm() / want.norm()).item())
    return errors


def test_linear_deep_transformer_tends_to_softmax_attention():
    errors = claim_errors(range(1, 7))
    assert all(b < a for a, b in itertools.pairwise(errors)), errors
    assert errors[-1] < 1e-3, errors


def test_normalized_variant_matches_sdpa_within_the_taylor_error():
    gen = torch.Generator().manual_seed(1)
    q, k = (
        F.normalize(torch.randn(1, 10, 2, 4, generator=gen, dtype=f64), dim=-1) for _ in range(2)
    )
    v = torch.randn(1, 10, 2, 4, generator=gen, dtype=f64)
    rule = miras.compile(ROOT / "specs/examples/linear_deep_transformer.yaml", checked=False)
    num, _ = rule(q, k, v, backend="chunk", chunk_size=4)
    den, _ = rule(q, k, torch.ones_like(v[..., :1]), backend="chunk", chunk_size=4)
    got = num / den
    want = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=1.0
    ).transpose(1, 2)
    # The Taylor error: each weight exp(s) is replaced by T_4(s), off by a relative delta at
    # most max |exp(s) - T_4(s)| / exp(s) over the causal pairs; normalized weights then move
    # by at most 2 delta / (1 - delta) in l1, so each output entry by that times max |v|.
    s = torch.einsum("bthd,bshd->bhts", q, k)
    taylor = sum(s**p / math.factorial(p) for p in range(5))
    causal = torch.ones(10, 10, dtype=torch.bool).tril()
    delta = ((s.exp() - taylor).abs() / s.exp())[..., causal].max().item()
    bound = 2 * delta / (1 - delta) * v.abs().max().item()
    assert 0 < delta < 0.07
    assert (got - want).abs().max().item() <= bound
    err = ((got - want).norm() / want.norm()).item()
    order2 = rule.spec.feature_map.model_copy(update={"order": 2})
    worse = miras.compile(rule.spec.model_copy(update={"feature_map": order2}), checked=False)
    num2, _ = worse(q, k, v, backend="chunk", chunk_size=4)
    den2, _ = worse(q, k, torch.ones_like(v[..., :1]), backend="chunk", chunk_size=4)
    assert ((num2 / den2 - want).norm() / want.norm()).item() > err
