"""The exact chunk form (`chunk_mode="exact"`, miras/runtime/exact_chunk.py) against the
recurrence, and the affine analysis that decides which specs get it (miras/derive/affine.py).

- Every affine case at b in {1, 7, 16, 64} equals `recurrent` to 1e-10 in float64: outputs,
  final state (memory and momentum) and the gradients of a random functional of both w.r.t.
  q, k, v, every gate and the initial state; relative RMS 1e-5 in float32.
- A long sequence (T = 1000, float64, forward) at b = 64.
- fla's exact chunked references at chunk 64 on equal inputs.
- `chunk_mode`: "exact" refused with the reason, "start" equal to the chunk-start path.
- The analysis on both sides: affine formulas that do not look it, and ones that look affine
  but are not.
"""

from __future__ import annotations

import functools
import importlib
import warnings

import pytest
import torch
import torch.nn.functional as F

import miras
from miras.components.base import HALF_OPEN_UNIT, UNIT
from miras.derive.affine import analyze
from miras.runtime import chunk
from miras.spec import load_spec

f64 = torch.float64
EXACT = dict(rtol=1e-10, atol=1e-10)
F32_TOL = 1e-5  # relative RMS, float32 against the float64 recurrence
B, H, DK, DV = 1, 2, 6, 4  # Dk != Dv so a transposed state cannot pass

GDN = dict(bias="l2", retention={"kind": "l2", "grad_at": "retained"})
# name: (spec fields, gates given per value channel)
CASES = {
    "deltanet": (dict(bias="l2", retention="none"), ()),
    "gated_deltanet": (GDN, ()),
    "l2_grad_at_state": (dict(bias="l2", retention={"kind": "l2", "grad_at": "state"}), ()),
    "momentum_decay": (dict(bias="l2", retention="l2", optimizer="momentum"), ()),
    "window2_gamma": (dict(bias="l2", retention="l2", window={"c": 2, "gamma": "gate"}), ()),
    "window3_gamma_momentum_retained": (
        dict(
            bias="l2",
            retention={"kind": "l2", "grad_at": "retained"},
            optimizer="momentum",
            window={"c": 3, "gamma": "gate"},
        ),
        (),
    ),
    "per_channel_gdn": (GDN, ("lr", "decay")),
    "per_channel_momentum_window2": (
        dict(bias="l2", retention="l2", optimizer="momentum", window={"c": 2, "gamma": 0.7}),
        ("lr", "decay", "momentum"),
    ),
    "custom_quadratic_gate": (
        dict(
            bias={"kind": "custom", "loss": "0.5*sum(e**2)*c", "params": {"c": "gate"}},
            retention="l2",
        ),
        ("c",),
    ),
    "custom_slope_reads_v": (
        dict(bias={"kind": "custom", "loss": "(1 + v**2)*e**2/4"}, retention="none"),
        (),
    ),
    "retnet_dot": (dict(bias="dot", retention="l2"), ()),
}


pytestmark = pytest.mark.usefixtures("one_thread")


@functools.cache
def rule_of(name: str):
    return miras.compile({"name": name, **CASES[name][0]})


# Not helpers.random_inputs: every fifth momentum is exactly 0 (the closed end of its range),
# learning rates reach 0.9, and a random initial state joins the leaves.
def make_inputs(name: str, t_len: int, seed: int = 0, dtype=f64):
    """Unit-norm q, k; v ~ N(0, 1); gates in their ranges (every fifth momentum exactly 0, the
    closed end of its range); a random initial state (memory and momentum); all leaves."""
    rule = rule_of(name)
    per_channel = CASES[name][1]
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, t_len, H, DK, generator=gen, dtype=f64), dim=-1)
    k = F.normalize(torch.randn(B, t_len, H, DK, generator=gen, dtype=f64), dim=-1)
    v = torch.randn(B, t_len, H, DV, generator=gen, dtype=f64)
    gates = {}
    for info in rule.plan.gates:
        shape = (B, t_len, H, DV) if info.name in per_channel else (B, t_len, H)
        r = torch.rand(*shape, generator=gen, dtype=f64)
        if info.allowed == UNIT:
            g = 0.8 + 0.2 * r
        elif info.allowed == HALF_OPEN_UNIT:
            g = 0.9 * r
            g[:, 1::5] = 0.0
        else:
            g = 0.1 + 0.8 * r
        gates[info.name] = g
    default = rule.initial_state(B, H, DK, DV, f64)
    names = list(default) if isinstance(default, dict) else ["W"]
    init = {n: 0.3 * torch.randn(B, H, DV, DK, generator=gen, dtype=f64) for n in names}
    leaves = [q, k, v, *gates.values(), *init.values()]
    leaves = [x.to(dtype).requires_grad_(True) for x in leaves]
    q, k, v = leaves[:3]
    gates = dict(zip(gates, leaves[3 : 3 + len(gates)], strict=True))
    init = dict(zip(init, leaves[3 + len(gates) :], strict=True))
    return q, k, v, gates, init, leaves


def run(name, inputs, backend, chunk_size=1, chunk_mode="auto", grads=True):
    """o, the final memory tensors, and gradients of a random functional of both."""
    q, k, v, gates, init, leaves = inputs
    o, state = rule_of(name)(
        q, k, v, gates, backend=backend, chunk_size=chunk_size, chunk_mode=chunk_mode,
        initial_state=init, output_final_state=True,
    )  # fmt: skip
    state = state if isinstance(state, dict) else {"W": state}
    outs = [o, *(state[n] for n in sorted(state) if not n.startswith("window."))]
    if not grads:
        return outs, []
    gen = torch.Generator().manual_seed(11)
    loss = sum((x * torch.randn(x.shape, generator=gen, dtype=f64).to(x.dtype)).sum() for x in outs)
    return outs, list(torch.autograd.grad(loss, leaves))


@functools.cache
def reference(name: str, t_len: int):
    """The recurrence in float64 (computed once per case and length)."""
    outs, grads = run(name, make_inputs(name, t_len), "recurrent")
    return [x.detach() for x in outs], [g.detach() for g in grads]


def rel_rms(actual: torch.Tensor, expected: torch.Tensor) -> float:
    a, e = actual.double(), expected.double()
    return ((a - e).pow(2).mean().sqrt() / e.pow(2).mean().sqrt()).item()


@pytest.mark.parametrize("chunk_size", [1, 7, 16, 64])
@pytest.mark.parametrize("t_len", [63, 100])
@pytest.mark.parametrize("name", sorted(CASES))
def test_exact_chunk_equals_recurrent_float64(name, t_len, chunk_size):
    outs, grads = run(name, make_inputs(name, t_len), "chunk", chunk_size, "exact")
    ref_outs, ref_grads = reference(name, t_len)
    for got, want in zip(outs + grads, ref_outs + ref_grads, strict=True):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, **EXACT)


@pytest.mark.parametrize("chunk_size", [16, 64])
@pytest.mark.parametrize("name", sorted(CASES))
def test_exact_chunk_float32(name, chunk_size):
    outs, grads = run(name, make_inputs(name, 100, dtype=torch.float32), "chunk", chunk_size)
    assert outs[0].dtype == torch.float32
    ref_outs, ref_grads = reference(name, 100)
    for i, (got, want) in enumerate(zip(outs + grads, ref_outs + ref_grads, strict=True)):
        err = rel_rms(got, want)
        assert err <= F32_TOL, f"tensor {i}: relative RMS {err:.3g} > {F32_TOL}"


@pytest.mark.parametrize("name", ["window3_gamma_momentum_retained", "per_channel_gdn"])
def test_long_sequence_forward(name):
    inputs = make_inputs(name, 1000, seed=5)
    with torch.no_grad():
        want, _ = run(name, inputs, "recurrent", grads=False)
        got, _ = run(name, inputs, "chunk", 64, "exact", grads=False)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, **EXACT)


def test_auto_picks_exact_and_start_matches_chunk_start_path(monkeypatch):
    """auto is exact for gated_deltanet; "start" is the chunk-start path, bit for bit."""
    name = "gated_deltanet"
    inputs = make_inputs(name, 63)
    auto, _ = run(name, inputs, "chunk", 16, grads=False)
    exact, _ = run(name, inputs, "chunk", 16, "exact", grads=False)
    for a, e in zip(auto, exact, strict=True):
        assert torch.equal(a, e)

    calls = []
    original = chunk.forward

    def spy(rt, seq, state, chunk_size, recompute=None):
        calls.append(chunk_size)
        return original(rt, seq, state, chunk_size, recompute)

    monkeypatch.setattr(chunk, "forward", spy)
    start, _ = run(name, inputs, "chunk", 16, "start", grads=False)
    assert calls == [16]  # the chunk-start module ran, and only it
    ref, _ = reference(name, 63)
    assert rel_rms(start[0], ref[0]) > 1e-3  # and it really is the approximation here


def test_exact_refused_with_the_reason():
    rule = miras.compile({"name": "yaad_matrix", "bias": "huber", "retention": "l2"})
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 5, 1, 4, generator=gen) for _ in range(3))
    gates = {n: torch.full((1, 5, 1), 0.5) for n in rule.gates}
    with pytest.raises(ValueError, match="chunk_mode") as err:
        rule(q, k, v, gates, chunk_mode="exact")
    assert "huber bias" in str(err.value) and "chunk_mode='start'" in str(err.value)
    o, _ = rule(q, k, v, gates)  # auto: the chunk-start form, no error
    assert o.shape == v.shape
    with pytest.raises(ValueError, match="chunk_mode: expected one of auto, start, exact"):
        rule(q, k, v, gates, chunk_mode="fast")


def test_triton_computes_the_exact_form():
    """Triton computes the exact form too (auto on an affine spec; tests/kernels/test_triton_exact.py
    holds it to the chunk backend), and at chunk size 1, where the two forms are one model."""
    rule = rule_of("gated_deltanet")
    q, k, v, gates, _, _ = make_inputs("gated_deltanet", 5, dtype=torch.float32)
    want, _ = rule(q, k, v, gates, backend="recurrent")
    for chunk_size in (4, 1):
        o, _ = rule(q, k, v, gates, backend="triton", chunk_size=chunk_size)
        assert rel_rms(o, want) <= F32_TOL


# fla's exact chunked references ----------------------------------------------------------------


def fla_naive(op: str, name: str):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fla warns at import that Triton has no GPU here
        return getattr(importlib.import_module(f"fla.ops.{op}.naive"), name)


def f32_exact(x: torch.Tensor) -> torch.Tensor:
    """float64 values that float32 represents exactly, so fla's float32 sees equal numbers."""
    return x.float().double()


def test_gated_deltanet_matches_fla_naive_chunk():
    """fla's `naive_chunk_gated_delta_rule` (float32 inside) at chunk 64, T = 100 (padded)."""
    rule = miras.compile("specs/gated_deltanet.yaml")
    gen = torch.Generator().manual_seed(2)
    b, t_len, h, d = 2, 100, 2, 16
    q, k = (
        f32_exact(F.normalize(torch.randn(b, t_len, h, d, generator=gen, dtype=f64), dim=-1))
        for _ in "qk"
    )
    v = f32_exact(torch.randn(b, t_len, h, d, generator=gen, dtype=f64))
    beta = f32_exact(0.1 + 0.8 * torch.rand(b, t_len, h, generator=gen, dtype=f64))
    decay = f32_exact(0.8 + 0.2 * torch.rand(b, t_len, h, generator=gen, dtype=f64))
    s0 = f32_exact(0.3 * torch.randn(b, h, d, d, generator=gen, dtype=f64))
    o, s = rule(
        q, k, v, {"lr": beta, "decay": decay}, chunk_size=64, chunk_mode="exact",
        initial_state=s0, output_final_state=True,
    )  # fmt: skip
    o_ref, s_ref = fla_naive("gated_delta_rule", "naive_chunk_gated_delta_rule")(
        q, k, v, decay.log(), beta, chunk_size=64, scale=1.0,
        initial_state=s0.transpose(-1, -2), output_final_state=True,
    )  # fmt: skip
    assert rel_rms(o, o_ref) <= F32_TOL
    assert rel_rms(s, s_ref.transpose(-1, -2)) <= F32_TOL


def test_deltanet_matches_fla_chunkwise():
    """fla's `delta_rule_chunkwise` (the WY form; here in float64) at chunk 64, zero state."""
    rule = miras.compile("specs/deltanet.yaml")
    gen = torch.Generator().manual_seed(3)
    b, t_len, h, d = 2, 128, 2, 16
    q, k = (
        F.normalize(torch.randn(b, h, t_len, d, generator=gen, dtype=f64), dim=-1) for _ in "qk"
    )
    v = torch.randn(b, h, t_len, d, generator=gen, dtype=f64)
    beta = 0.1 + 0.8 * torch.rand(b, h, t_len, generator=gen, dtype=f64)
    o, s = rule(
        *(x.transpose(1, 2) for x in (q, k, v)), {"lr": beta.transpose(1, 2)},
        chunk_size=64, chunk_mode="exact", output_final_state=True,
    )  # fmt: skip
    chunkwise = fla_naive("delta_rule", "delta_rule_chunkwise")
    o_ref, s_ref = chunkwise(q * d**0.5, k, v, beta, chunk_size=64)  # it scales q by d^-0.5
    torch.testing.assert_close(o, o_ref.transpose(1, 2), **EXACT)
    torch.testing.assert_close(s, s_ref.transpose(-1, -2), **EXACT)


# The analysis --------------------------------------------------------------------------------


def form_of(**fields):
    return analyze(load_spec({"name": "probe", **fields}))


def custom(loss: str, **params):
    return {"kind": "custom", "loss": loss, "params": params}


@pytest.mark.parametrize(
    ("loss", "params", "slope"),
    [
        ("e**2*(1 + 0*e**3)", {}, 2.0),  # the zero term vanishes
        ("sqrt(e**4)", {}, 2.0),  # |e|^2 for real e
        ("log(exp(e**2/2))", {}, 1.0),
        ("e*y", {}, 2.0),  # (y - v) y: a quadratic in y, not in e alone
        ("0.5*sum(e**2)*c", {"c": 3}, 3.0),  # a channel sum entering linearly
        ("0.5*sum(e**2)*c", {"c": "gate"}, None),  # a slope that is a gate
        ("(1 + v**2)*e**2", {}, None),  # a slope that reads v
        ("sum(e**2)*sum(v**2)", {}, None),  # a channel sum of v alone
        ("-e", {}, 0.0),  # linear: the gradient does not read the state
    ],
)
def test_affine_biases_that_do_not_look_it(loss, params, slope):
    form = form_of(bias=custom(loss, **params))
    assert form.form == "exact", form.reason
    assert form.slope == slope


@pytest.mark.parametrize(
    ("bias", "why"),
    [
        (custom("e**2 + e**4*1e-9"), "not affine in y"),  # a tiny quartic is still quartic
        (custom("log(cosh(e))"), "not affine in y"),
        (custom("sum(e)**2"), "couples the value channels"),
        ("huber", "huber bias"),
        ({"kind": "lp", "p": 3}, "lp bias"),
        ({"kind": "robust", "radius": 0.1}, "couples the value channels"),
    ],
)
def test_biases_that_look_affine_but_are_not(bias, why):
    form = form_of(bias=bias)
    assert form.form == "start"
    assert why in form.reason


@pytest.mark.parametrize(
    ("fields", "why"),
    [
        (dict(memory={"kind": "mlp", "depth": 2}), "mlp memory"),
        (dict(retention={"kind": "lq", "q": 4}), "lq retention"),
        (dict(retention="kl"), "kl retention"),
        (dict(optimizer="muon"), "muon optimizer"),
    ],
)
def test_other_components_that_are_not_affine(fields, why):
    form = form_of(bias="l2", **fields)
    assert form.form == "start" and why in form.reason


def test_shipped_specs_forms():
    forms = {
        name: analyze(load_spec(f"specs/{name}.yaml")).form
        for name in ("deltanet", "gated_deltanet", "omeganet", "linear_attention", "retnet")
    }
    assert set(forms.values()) == {"exact"}, forms
    for name in ("titans", "moneta", "yaad", "memora", "atlas"):
        assert analyze(load_spec(f"specs/{name}.yaml")).form == "start", name


def test_derivation_says_the_form():
    text = str(miras.compile("specs/gated_deltanet.yaml").derivation())
    assert "chunk: exact (the step is affine in W" in text
    text = str(miras.compile({"name": "h", "bias": "huber", "retention": "l2"}).derivation())
    assert "chunk: chunk-start approximation (Titans section 3.2), because" in text
    assert "huber bias" in text


# The choice in the layer and the spec ----------------------------------------------------------

MODEL = {"d_model": 16, "n_heads": 2, "n_layers": 1, "chunk_size": 4}


def test_model_auto_is_the_recurrence_at_chunk_4():
    """A Gated DeltaNet model at chunk size 4 (auto: exact) equals the same model on the
    recurrent backend; "start" (the spec's model.chunk_mode) does not."""
    from miras.models import build_model

    def model(**fields):
        torch.manual_seed(0)
        spec = {"name": "gdn", **GDN, "model": {**MODEL, **fields}}
        return build_model(spec, 11).to(f64)

    x = torch.randint(0, 11, (2, 13), generator=torch.Generator().manual_seed(0))
    exact = model(backend="recurrent")(x)
    torch.testing.assert_close(model()(x), exact, **EXACT)
    assert (model(chunk_mode="start")(x) - exact).abs().max() > 1e-6


def test_layer_refuses_exact_for_a_non_affine_rule_when_built():
    from miras.models import MirasLayer

    with pytest.raises(ValueError, match="huber bias"):
        MirasLayer({"name": "h", "bias": "huber", "retention": "l2"}, 8, 2, chunk_mode="exact")


def test_default_chunk_size_follows_the_form():
    """No chunk size given: 64 // c where the form is exact (the chunk size is then a speed
    knob; a chunk solves n*c rows), 16 for the chunk-start form (where it changes the model);
    a given one is kept."""
    from miras.models import MirasLayer, build_model

    huber = {"name": "h", "bias": "huber", "retention": "l2"}
    assert load_spec({"name": "g", **GDN}).model.chunk_size is None
    assert MirasLayer({"name": "g", **GDN}, 8, 2).chunk_size == 64
    assert MirasLayer({"name": "g", **GDN}, 8, 2, chunk_mode="start").chunk_size == 16
    assert MirasLayer(huber, 8, 2).chunk_size == 16
    assert MirasLayer({"name": "g", **GDN}, 8, 2, chunk_size=5).chunk_size == 5
    window3 = {"name": "w", **GDN, "window": {"c": 3, "gamma": 0.5}}
    assert MirasLayer(window3, 8, 2).chunk_size == 21
    model = build_model({"name": "g", **GDN, "model": {"d_model": 8, "n_heads": 2}}, 11)
    assert {m.chunk_size for m in model.modules() if isinstance(m, MirasLayer)} == {64}


def test_spec_model_chunk_mode_is_validated():
    with pytest.raises(ValueError, match="chunk_mode"):
        load_spec({"name": "x", "model": {"chunk_mode": "fast"}})
    assert load_spec({"name": "x", "model": {"chunk_mode": "start"}}).model.chunk_mode == "start"


def test_chunk_major_storage_and_its_products():
    """`chunk_major` stores [B, H, N, ...] chunk by chunk (each chunk's [B, H, ...] block one
    contiguous piece, which the scan writes with out=); `_chunk_matmul` equals a @ b on that
    storage, on the plain layout and on a mix of the two."""
    from miras.runtime.exact_chunk import _chunk_matmul, chunk_major

    gen = torch.Generator().manual_seed(0)
    plain_a = torch.randn(2, 3, 5, 4, 6, generator=gen, dtype=f64)
    plain_b = torch.randn(2, 3, 5, 6, 7, generator=gen, dtype=f64)
    a, b = chunk_major(plain_a, plain_a.shape), chunk_major(plain_b, plain_b.shape)
    a.copy_(plain_a)
    b.copy_(plain_b)
    assert a.shape == plain_a.shape and a[:, :, 2].is_contiguous()
    assert not plain_a[:, :, 2].is_contiguous()
    expected = plain_a @ plain_b
    for x, y in [(a, b), (plain_a, plain_b), (a, plain_b), (plain_a, b)]:
        torch.testing.assert_close(_chunk_matmul(x, y), expected, rtol=0, atol=1e-12)
    assert _chunk_matmul(a, b)[:, :, 1].is_contiguous()  # the chunk-major path was taken
    torch.testing.assert_close(_chunk_matmul(a, b.mT.mT), expected, rtol=0, atol=1e-12)
