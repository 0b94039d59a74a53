"""optimizer exact (MesaNet): the validation's refusals, the recurrent reference against an
autograd argmin, the chunk form against the reference (forward, backward, any chunk size,
pieces with carried state), float64 gradcheck, and the errors at the boundary."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import miras
from miras.checks.minimizer import check_minimizer_end_to_end
from miras.errors import SpecError
from tests.helpers import tiny_mqar_losses

ROOT = Path(__file__).resolve().parents[2]
MESANET = ROOT / "specs/mesanet.yaml"


def exact_spec(**fields) -> dict:
    spec = {
        "name": "exact_test",
        "memory": "matrix",
        "bias": "l2",
        "retention": {"kind": "l2", "decay": "gate"},
        "optimizer": {"kind": "exact", "ridge": "gate"},
        "window": {"c": "global", "gamma": "gate"},
    }
    spec.update(fields)
    return spec


# Not helpers.random_inputs: MesaNet's gates by name in their own ranges (a decay from 0.5,
# gamma past 1, the ridge per key channel [B, T, H, Dk]).
def inputs(rule, b=2, t=23, h=2, d=5, dv=3, dtype=torch.float64, per_key=True, seed=0):
    """q, k (unit rows), v and every gate of `rule` in its range; the ridge per key channel."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.rand(*shape, generator=gen, dtype=dtype)

    q = torch.nn.functional.normalize(torch.randn(b, t, h, d, generator=gen, dtype=dtype), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(b, t, h, d, generator=gen, dtype=dtype), dim=-1)
    v = torch.randn(b, t, h, dv, generator=gen, dtype=dtype)
    ranges = {
        "decay": lambda: 0.5 + 0.5 * rand(b, t, h),
        "gamma": lambda: 0.1 + rand(b, t, h),
        "ridge": lambda: 0.25 + rand(b, t, h, d) if per_key else 0.25 + rand(b, t, h),
    }
    return q, k, v, {name: ranges[name]() for name in rule.gates}


# Validation --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "path", "reason"),
    [
        ({"bias": "huber"}, "bias.kind", r"not (affine|quadratic) in y"),
        ({"bias": {"kind": "lp", "p": 3}}, "bias.kind", r"not (affine|quadratic) in y"),
        ({"memory": "mlp"}, "memory.kind", "not linear in its weights"),
        ({"retention": "kl"}, "retention.kind", "not a decay of the past terms"),
        ({"retention": {"kind": "l2", "grad_at": "retained"}}, "retention.grad_at", "no gradient"),
    ],
    ids=["huber", "lp", "mlp", "kl", "grad_at"],
)
def test_a_spec_whose_objective_is_not_quadratic_is_refused_with_the_reason(fields, path, reason):
    with pytest.raises(SpecError) as err:
        miras.load_spec(exact_spec(**fields))
    text = str(err.value)
    assert f"{path}: " in text and re.search(reason, text), text


def test_the_shipped_spec_passes_miras_check():
    rule = miras.compile(MESANET)
    assert rule.gates == ["decay", "ridge", "gamma"]
    assert rule.plan.chunk_form.form == "minimizer" and rule.plan.chunk_form.slope == 1.0
    results = rule.check(triton=False)
    assert results and all(r.passed for r in results), [(r.piece, r.error) for r in results]


# The reference against the autograd argmin -------------------------------------------------------


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"retention": "none", "optimizer": {"kind": "exact", "ridge": 0.5}},
        {"bias": "dot", "window": "global"},  # s = 0: W_t = H_vk diag(ridge)^-1
        {"bias": {"kind": "custom", "loss": "2*e**2"}, "retention": {"kind": "l2", "decay": 0.9}},
        {"feature_map": {"kind": "polynomial", "degree": 2}},
        {"window": {"c": 3, "gamma": "gate"}},
        {"window": 1, "retention": {"kind": "l2", "decay": 0.8}},
    ],
    ids=[
        "mesanet",
        "no-decay-fixed-ridge",
        "dot",
        "custom-quadratic",
        "polynomial",
        "window-3",
        "window-1",
    ],
)
def test_both_forms_equal_the_autograd_argmin_of_the_objective(fields):
    rule = miras.compile(exact_spec(**fields))
    results = check_minimizer_end_to_end(rule, seed=3)
    assert all(r.passed for r in results), [(r.piece, r.error) for r in results]


def test_the_oracle_catches_a_wrong_statistic(monkeypatch):
    """The check is not vacuous: a chunk form that forgets the decay of H_vk fails it."""
    from miras.runtime import exact_minimizer

    rule = miras.compile(exact_spec())
    real = exact_minimizer.inputs

    def no_decay(rt, phi_k, v, gates):
        log_a, gamma, r = real(rt, phi_k, v, gates)
        return torch.zeros_like(log_a), gamma, r

    monkeypatch.setattr(exact_minimizer, "inputs", no_decay)
    results = check_minimizer_end_to_end(rule, seed=3)
    assert not any(r.passed for r in results)


# The chunk form against the reference ------------------------------------------------------------


@pytest.mark.parametrize("chunk_size", [1, 4, 7, 64])
@pytest.mark.parametrize("per_key", [True, False], ids=["ridge-per-key", "ridge-per-head"])
def test_chunk_equals_recurrent_forward_and_backward(chunk_size, per_key):
    rule = miras.compile(MESANET)
    q, k, v, gates = inputs(rule, per_key=per_key)
    init = {
        "H_kk": (lambda a: a @ a.mT)(torch.randn(2, 2, 5, 5, dtype=torch.float64)),
        "H_vk": torch.randn(2, 2, 3, 5, dtype=torch.float64),
    }
    leaves = [q, k, v, *gates.values(), *init.values()]

    def run(backend):
        xs = [x.detach().clone().requires_grad_() for x in leaves]
        qq, kk, vv, *rest = xs
        g = dict(zip(gates, rest[: len(gates)], strict=True))
        state = dict(zip(init, rest[len(gates) :], strict=True))
        o, final = rule(
            qq, kk, vv, g, backend=backend, chunk_size=chunk_size, initial_state=state,
            output_final_state=True,
        )  # fmt: skip
        (o.sin().sum() + final["H_kk"].sum() + final["H_vk"].cos().sum()).backward()
        return o, final, [x.grad for x in xs]

    o1, f1, g1 = run("recurrent")
    o2, f2, g2 = run("chunk")
    torch.testing.assert_close(o2, o1, rtol=1e-10, atol=1e-12)
    for name in f1:
        torch.testing.assert_close(f2[name], f1[name], rtol=1e-10, atol=1e-12)
    for a, b in zip(g2, g1, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("c", [1, 3])
@pytest.mark.parametrize("chunk_size", [1, 2, 5])
def test_a_finite_window_chunked_equals_its_recurrence_in_pieces(c, chunk_size):
    """The last c tokens, carried between calls: chunked at any size equals token by token,
    and three calls with the carried window equal one, forward and backward."""
    rule = miras.compile(exact_spec(window={"c": c, "gamma": "gate"}))
    q, k, v, gates = inputs(rule, t=17)
    leaves = [q, k, v, *gates.values()]

    def run(backend, pieces):
        xs = [x.detach().clone().requires_grad_() for x in leaves]
        qq, kk, vv, *rest = xs
        g = dict(zip(gates, rest, strict=True))
        state, outs = None, []
        for sl in pieces:
            o, state = rule(
                qq[:, sl], kk[:, sl], vv[:, sl], {n: x[:, sl] for n, x in g.items()},
                backend=backend, chunk_size=chunk_size, initial_state=state,
                output_final_state=True,
            )  # fmt: skip
            outs.append(o)
        o = torch.cat(outs, 1)
        (o.sin().sum() + state["window.r"].sum()).backward()
        # c = 1 reads no decay: no gradient (None) on one path, zeros on the other.
        return o, state, [torch.zeros_like(x) if x.grad is None else x.grad for x in xs]

    o1, s1, g1 = run("recurrent", [slice(0, 17)])
    o2, s2, g2 = run("chunk", [slice(0, 6), slice(6, 7), slice(7, 17)])
    torch.testing.assert_close(o2, o1, rtol=1e-10, atol=1e-12)
    assert sorted(s1) == ["window.gamma", "window.k", "window.log_decay", "window.r"]
    for name in s1:
        assert s1[name].shape[2] == c
        torch.testing.assert_close(s2[name], s1[name], rtol=1e-12, atol=1e-12)
    for a, b in zip(g2, g1, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


def test_gradcheck_float64_at_a_tiny_size():
    rule = miras.compile(MESANET)
    q, k, v, gates = inputs(rule, b=1, t=6, h=1, d=3, dv=2)
    names = list(gates)
    # An initial H_kk = I + (P + P^T) / 2: perturbing any entry of P keeps it symmetric.
    p = 0.1 * torch.randn(1, 1, 3, 3, dtype=torch.float64)
    h_vk = torch.randn(1, 1, 2, 3, dtype=torch.float64)

    def fn(q, k, v, p, h_vk, *gate_values):
        state = {"H_kk": torch.eye(3, dtype=p.dtype) + (p + p.mT) / 2, "H_vk": h_vk}
        g = dict(zip(names, gate_values, strict=True))
        return rule(q, k, v, g, chunk_size=4, initial_state=state)[0]

    leaves = [x.requires_grad_() for x in (q, k, v, p, h_vk, *gates.values())]
    assert torch.autograd.gradcheck(fn, leaves, eps=1e-6, atol=1e-6)


def test_pieces_with_carried_statistics_equal_one_pass():
    rule = miras.compile(MESANET)
    q, k, v, gates = inputs(rule, t=30)
    whole, final = rule(q, k, v, gates, chunk_size=8, output_final_state=True)
    state, outs = None, []
    for sl in (slice(0, 11), slice(11, 12), slice(12, 30)):
        o, state = rule(
            q[:, sl], k[:, sl], v[:, sl], {n: g[:, sl] for n, g in gates.items()},
            chunk_size=8, initial_state=state, output_final_state=True,
        )  # fmt: skip
        outs.append(o)
    torch.testing.assert_close(torch.cat(outs, 1), whole, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(state["H_kk"], final["H_kk"], rtol=1e-12, atol=1e-12)


def test_float32_chunk_stays_near_the_float64_reference():
    rule = miras.compile(MESANET)
    q, k, v, gates = inputs(rule, t=100, d=16, dv=16)
    reference, _ = rule(q, k, v, gates, backend="recurrent")
    o, _ = rule(q.float(), k.float(), v.float(), {n: g.float() for n, g in gates.items()})
    error = (o.double() - reference).pow(2).mean().sqrt() / reference.pow(2).mean().sqrt()
    assert o.dtype == torch.float32 and error < 1e-5


# The boundary ------------------------------------------------------------------------------------


def test_initial_state_must_be_the_statistics():
    rule = miras.compile(MESANET)
    q, k, v, gates = inputs(rule)
    with pytest.raises(ValueError, match=r"initial_state: .*keys \['H_kk', 'H_vk'\], got Tensor"):
        rule(q, k, v, gates, initial_state=torch.zeros(2, 2, 3, 5, dtype=torch.float64))
    bad = {"H_kk": torch.zeros(2, 2, 4, 4, dtype=torch.float64), "H_vk": torch.zeros(2, 2, 3, 5)}
    with pytest.raises(ValueError, match=r"initial_state\['H_kk'\]: expected shape \[2, 2, 5, 5\]"):
        rule(q, k, v, gates, initial_state=bad)
    skew = torch.zeros(2, 2, 5, 5, dtype=torch.float64)
    skew[..., 0, 1] = 1.0
    bad = {"H_kk": skew, "H_vk": torch.zeros(2, 2, 3, 5)}
    with pytest.raises(ValueError, match=r"initial_state\['H_kk'\]: expected a symmetric matrix"):
        rule(q, k, v, gates, initial_state=bad)


def test_a_ridge_of_the_wrong_width_names_the_key_width():
    rule = miras.compile(MESANET)
    q, k, v, gates = inputs(rule)
    gates["ridge"] = gates["ridge"][..., :2]
    with pytest.raises(ValueError, match=r"gates\['ridge'\]: expected .* or \[B, T, H, Dk\]"):
        rule(q, k, v, gates)


def test_a_system_that_is_not_positive_definite_in_float32_names_the_token():
    """A ridge far below the statistics' rounding: Cholesky fails, and the error says where."""
    rule = miras.compile(exact_spec(optimizer={"kind": "exact", "ridge": 1e-12}))
    q, k, v, gates = inputs(rule, dtype=torch.float32, d=8)
    k = k * 1e3
    with pytest.raises(ValueError, match=r"not positive definite in float32 at token \d+"):
        rule(q, k, v, gates, backend="recurrent")


def test_the_triton_backend_and_the_chunk_start_mode_are_refused():
    rule = miras.compile(MESANET)
    q, k, v, gates = inputs(rule)
    with pytest.raises(ValueError, match="does not cover spec 'mesanet': the exact optimizer"):
        rule(q, k, v, gates, backend="triton")
    with pytest.raises(ValueError, match="chunk_mode: 'start' does not apply"):
        rule(q, k, v, gates, chunk_mode="start")


def test_packed_sequences_equal_each_sequence_alone():
    rule = miras.compile(MESANET)
    q, k, v, gates = inputs(rule, b=1, t=20)
    bounds = [0, 7, 20]
    cu = torch.tensor(bounds)
    o, final = rule(q, k, v, gates, cu_seqlens=cu, output_final_state=True)
    for i in range(2):
        sl = slice(bounds[i], bounds[i + 1])
        alone, state = rule(
            q[:, sl], k[:, sl], v[:, sl], {n: g[:, sl] for n, g in gates.items()},
            output_final_state=True,
        )  # fmt: skip
        torch.testing.assert_close(o[:, sl], alone)
        torch.testing.assert_close(final["H_vk"][i : i + 1], state["H_vk"])


# The layer, a trained task, the probes, a study ------------------------------------------------


@pytest.mark.parametrize("window", ["global", 3])
def test_a_layer_decodes_token_by_token_as_it_runs_in_parallel(window):
    """The state starts empty and is not learned (a learned H_kk could leave the PSD cone);
    one token at a time from the cache equals the parallel chunk form."""
    from miras.models.layer import MirasLayer

    torch.manual_seed(0)
    spec = miras.load_spec(MESANET).model_copy(
        update={"window": miras.load_spec(exact_spec(window=window)).window}
    )
    layer = MirasLayer(spec, d_model=16, n_heads=2).double()
    assert not any(("H_" in n or "window" in n) for n, _ in layer.named_parameters())
    x = torch.randn(2, 13, 16, dtype=torch.float64)
    whole, _ = layer(x)
    cache, pieces = layer.empty_cache(2), []
    for t in range(13):
        y, cache = layer(x[:, t : t + 1], cache)
        pieces.append(y)
    torch.testing.assert_close(torch.cat(pieces, 1), whole, rtol=1e-10, atol=1e-12)


def test_mesanet_trains_on_a_tiny_mqar():
    """A one-layer MesaNet on MQAR at T = 32 (4 pairs): the loss falls in 40 steps."""
    import math

    first, last, final = tiny_mqar_losses(MESANET)
    assert math.isfinite(final) and last < first - 0.2, (first, last)


def test_the_probes_read_the_minimizer_the_statistics_stand_for():
    """Below d_k pairs the exact minimizer with a small ridge recalls almost exactly; one
    delta-rule step per pair does not (capacity probe, in context, one pass)."""
    from miras.probes.suite import capacity, interference, outliers

    opts = dict(d_k=8, trials=4, seeds=2)
    exact = capacity(MESANET, pair_counts=[4], **opts).rows()[0]["mean"]
    delta = capacity(ROOT / "specs/deltanet.yaml", pair_counts=[4], **opts).rows()[0]["mean"]
    assert exact < 0.05 < delta
    for probe in (interference, outliers):  # the other probes run on it too
        rows = probe(
            MESANET, d_k=8, trials=2, seeds=1, gates={"decay": 1, "ridge": 0.1, "gamma": 1}
        ).rows()
        assert rows and all(0 <= r["mean"] < 2 for r in rows)


def test_a_study_searches_the_exact_optimizer(tmp_path):
    """`optimizer.kind: {choices: [gd, exact]}` through the search API: the grid trains one
    trial of each (a global window and an l2 decay, which both take)."""
    import math

    from tests.search_support import search_grid

    trials = search_grid(
        tmp_path,
        {
            "memory": "matrix",
            "bias": "l2",
            "retention": {"kind": "l2", "decay": "gate"},
            "optimizer": {"kind": {"choices": ["gd", "exact"]}},
            "window": "global",
            "model": {"d_model": 16, "n_layers": 1, "n_heads": 1},
        },
        trials=2,
    )
    kinds = sorted(miras.load_spec(t.user_attrs["spec"]).optimizer.kind for t in trials)
    assert kinds == ["exact", "gd"]
    assert all(math.isfinite(t.user_attrs["metrics"]["loss"]) for t in trials)


def test_the_hf_model_continues_from_its_cache_without_an_approximation_warning(recwarn):
    """The minimizer form is exact at every chunk size: prefill in pieces equals one forward,
    and no warning calls it the chunk-start approximation."""
    pytest.importorskip("transformers")
    from miras.hf import MirasForCausalLM

    torch.manual_seed(0)
    model = MirasForCausalLM.from_spec(MESANET, vocab_size=50, d_model=32, n_layers=1, n_heads=2)
    x = torch.randint(0, 50, (2, 12))
    with torch.no_grad():
        full = model.eval()(x).logits
        first = model(x[:, :7], use_cache=True)
        rest = model(x[:, 7:], past_key_values=first.past_key_values, use_cache=True).logits
    torch.testing.assert_close(torch.cat([first.logits, rest], 1), full, rtol=1e-4, atol=1e-5)
    assert not [w for w in recwarn if "approximation" in str(w.message)]
