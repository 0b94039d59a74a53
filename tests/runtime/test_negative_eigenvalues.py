"""The step size's ceiling `lr_max` (components/optimizer/steps.py): negative eigenvalues for
the delta rule (Grazzi et al. 2025; fla's allow_neg_eigval), the specs in specs/state_tracking/.

- the option: validated with named errors, left out of the normal form at its default (so the
  shipped specs keep their digests), carried into the plan as the gate's ceiling;
- the layer's gate spans (0, 2) with lr_max 2 (and stays in (0, 1) without);
- `miras check` samples the step size up to the ceiling, and the checks pass;
- every form against fla's naive recurrences with beta in (1, 2), where the eigenvalue along
  k is negative: the recurrence, the exact chunk form at odd T, the chunk-start form (chunk 1:
  the recurrence; chunk 4: the chunk-start reference of tests/runtime/test_form_contract.py),
  forward and backward; the Triton kernels in the interpreter at a tiny shape.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import miras
from miras.checks.end_to_end import check_end_to_end
from miras.checks.inputs import random_inputs, sizes_for
from miras.errors import SpecError
from miras.models.layer import GateMaps, MirasLayer
from miras.spec import load_spec
from tests.runtime.test_form_contract import plain_recurrence
from tests.runtime.test_known_models import (
    FLA_TOL,
    assert_rel_rms,
    f32_exact,
    fla_deltanet,
    fla_gated_deltanet,
    fla_naive,
    loss_and_grads,
)

ROOT = Path(__file__).resolve().parents[2]
NEGEIG = {
    "deltanet": ROOT / "specs/state_tracking/deltanet_negeig.yaml",
    "gated_deltanet": ROOT / "specs/state_tracking/gated_deltanet_negeig.yaml",
    "deltaproduct": ROOT / "specs/state_tracking/deltaproduct_negeig.yaml",
}
f64 = torch.float64

pytestmark = pytest.mark.usefixtures("one_thread")


# The option -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(NEGEIG))
def test_each_variant_is_its_shipped_spec_with_lr_max_2(name):
    """The same rule as the shipped spec (only name, description and lr_max differ), and the
    plan's lr gate has the ceiling 2."""
    variant = load_spec(NEGEIG[name]).normalized()
    shipped = load_spec(ROOT / f"specs/{name}.yaml").normalized()
    assert variant["optimizer"].pop("lr_max") == 2.0
    for key in ("name", "description"):
        variant.pop(key), shipped.pop(key)
    assert variant == shipped
    (lr,) = [g for g in miras.compile(NEGEIG[name], checked=False).plan.gates if g.name == "lr"]
    assert lr.defaults.ceiling == 2.0 and lr.role == "step_size"
    assert lr.defaults.start == 0.5  # the declared start stays


def test_lr_max_1_is_the_default_and_leaves_the_digest_alone():
    shipped = load_spec(ROOT / "specs/deltanet.yaml")
    explicit = load_spec({**shipped.normalized(), "optimizer": {"kind": "gd", "lr_max": 1}})
    assert "lr_max" not in shipped.normalized()["optimizer"]
    assert explicit == shipped and explicit.digest() == shipped.digest()
    assert load_spec(shipped.to_yaml()) == shipped
    negeig = load_spec(NEGEIG["deltanet"])
    assert load_spec(negeig.to_yaml()) == negeig  # the long form reads back
    (lr,) = miras.compile(shipped, checked=False).plan.gates
    assert lr.defaults.ceiling == 1.0


@pytest.mark.parametrize(
    ("optimizer", "message"),
    [
        ({"kind": "gd", "lr": 0.5, "lr_max": 2}, r"optimizer.lr_max: .*lr is fixed at 0.5"),
        ({"kind": "gd", "lr_max": 0}, r"optimizer.lr_max: expected a number in \(0, inf\), got 0"),
        ({"kind": "gd", "lr_max": "two"}, r"optimizer.lr_max: expected a number"),
        ({"kind": "gd", "lr_mx": 2}, r"optimizer.lr_mx: unknown field.*did you mean 'lr_max'"),
        ({"kind": "proximal", "lr_max": 2}, r"optimizer.lr_max"),
    ],
)
def test_bad_lr_max_is_named(optimizer, message):
    with pytest.raises(SpecError, match=message):
        load_spec({"name": "x", "bias": "l2", "optimizer": optimizer})


def test_momentum_takes_lr_max_too():
    spec = load_spec({"name": "x", "optimizer": {"kind": "momentum", "lr_max": 2}})
    gates = {g.name: g for g in miras.compile(spec, checked=False).plan.gates}
    assert gates["lr"].defaults.ceiling == 2.0 and gates["momentum"].defaults.ceiling is None


# The layer ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "ceiling"), [(NEGEIG["deltanet"], 2.0), ("specs/deltanet.yaml", 1.0)]
)
def test_the_layers_gate_spans_zero_to_the_ceiling(path, ceiling):
    """lr = ceiling * sigmoid(raw): raw from -30 to 30 covers (0, ceiling), values above 1 only
    with lr_max 2; the start is 0.5 either way."""
    rule = miras.compile(ROOT / path if isinstance(path, str) else path, checked=False)
    maps = GateMaps(rule.plan.gates, d_model=8, n_heads=2, rank=4)
    x = torch.randn(1, 3, 8)
    assert torch.allclose(maps(x)["lr"], torch.full((1, 3, 2), 0.5), atol=1e-6)  # the start
    with torch.no_grad():
        maps.up.bias.copy_(torch.linspace(-30, 30, 2))
        low, high = maps(x)["lr"][0, 0].tolist()
        assert 0 <= low < 1e-6 and ceiling - 1e-5 < high <= ceiling
        maps.up.bias.fill_(2.0)  # sigmoid(2) = 0.881
        assert maps(x)["lr"][0, 0, 0].item() == pytest.approx(ceiling * 0.8808, rel=1e-4)
    layer = MirasLayer(NEGEIG["deltanet"], 8, 2)
    assert layer.gates.infos[0].defaults.ceiling == 2.0


def test_a_layer_with_lr_above_1_trains_a_step_and_its_gradient_reaches_the_gate():
    torch.manual_seed(0)
    layer = MirasLayer(NEGEIG["deltaproduct"], 16, 2, chunk_size=4).double()
    with torch.no_grad():
        layer.gates.up.bias[-4:].fill_(3.0)  # the 2 x 2 per-step betas: 2 sigmoid(3) = 1.90
    x = torch.randn(2, 9, 16, dtype=f64)
    gates = layer.memory_inputs(x, None)[3]
    assert gates["lr"].shape == (2, 18, 2) and gates["lr"].min() > 1.8
    y, _ = layer(x)
    y.pow(2).sum().backward()
    assert torch.isfinite(y).all() and layer.gates.up.bias.grad[-4:].abs().sum() > 0


# The checks -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(NEGEIG))
def test_check_samples_the_step_size_up_to_2_and_passes(name):
    rule = miras.compile(NEGEIG[name])  # the compile checks (derived pieces against autograd)
    assert rule.checks and all(r.passed for r in rule.checks)
    _, _, _, gates = random_inputs(rule, sizes_for(rule), seed=0)
    assert gates["lr"].max() > 1.5 and gates["lr"].min() > 0.1
    results = check_end_to_end(rule, triton=False)
    failures = [f"{r.piece}: {r.error:.3g}" for r in results if not r.passed]
    assert results and not failures


def test_check_keeps_a_default_step_size_below_1():
    rule = miras.compile(ROOT / "specs/deltanet.yaml", checked=False)
    _, _, _, gates = random_inputs(rule, sizes_for(rule), seed=0)
    assert gates["lr"].min() >= 0.1 and gates["lr"].max() <= 1.0


# Every form against fla, beta in (1, 2) -------------------------------------------------------

B, T, H, DK, DV = 2, 13, 2, 6, 5  # odd T and widths, Dk != Dv


def inputs(seed: int, n: int = 1, decay: bool = False):
    """float32-exact float64 q, k (unit rows) [B, T, H, Dk] (k, v with n per token), v, beta in
    (1, 2) [B, T*n, H] (eigenvalue 1 - beta < 0 along k), a decay in (0.8, 1), W0; leaves."""
    gen = torch.Generator().manual_seed(seed)

    def draw(*shape):
        return torch.randn(*shape, generator=gen, dtype=f64)

    q = f32_exact(F.normalize(draw(B, T, H, DK), dim=-1))
    k = f32_exact(F.normalize(draw(B, T * n, H, DK), dim=-1))
    v = f32_exact(draw(B, T * n, H, DV))
    gates = {"lr": f32_exact(1.0 + torch.rand(B, T * n, H, generator=gen, dtype=f64))}
    if decay:
        gates["decay"] = f32_exact(0.8 + 0.2 * torch.rand(B, T, H, generator=gen, dtype=f64))
    w0 = f32_exact(0.3 * draw(B, H, DV, DK))
    leaves = [q, k, v, *gates.values(), w0]
    for x in leaves:
        x.requires_grad_(True)
    return q, k, v, gates, w0, leaves


FORMS = {
    "recurrent": dict(backend="recurrent"),
    "exact_chunk_4": dict(backend="chunk", chunk_size=4, chunk_mode="exact"),
    "exact_chunk_64": dict(backend="chunk", chunk_size=64, chunk_mode="exact"),
    "chunk_start_1": dict(backend="chunk", chunk_size=1, chunk_mode="start"),
}
FLA = {"deltanet": fla_deltanet, "gated_deltanet": fla_gated_deltanet}


@pytest.mark.parametrize("form", sorted(FORMS))
@pytest.mark.parametrize("name", sorted(FLA))
def test_every_form_matches_fla_with_negative_eigenvalues(name, form):
    rule = miras.compile(NEGEIG[name], checked=False)
    q, k, v, gates, w0, leaves = inputs(seed=1, decay=name == "gated_deltanet")
    o, state = rule(q, k, v, gates, initial_state=w0, output_final_state=True, **FORMS[form])
    o_ref, state_ref = FLA[name](q, k, v, gates, w0)
    assert_rel_rms(o, o_ref, FLA_TOL, "o")
    assert_rel_rms(state, state_ref, FLA_TOL, "final state")
    grads = loss_and_grads(o, state, leaves)
    grads_ref = loss_and_grads(o_ref.double(), state_ref.double(), leaves)
    for what, g, g_ref in zip(["q", "k", "v", *gates, "W0"], grads, grads_ref, strict=True):
        assert_rel_rms(g, g_ref, FLA_TOL, f"d/d{what}")


@pytest.mark.parametrize("form", sorted(FORMS))
def test_deltaproduct_matches_fla_with_negative_eigenvalues(form):
    """Both Householder factors of each token with beta in (1, 2): fla's
    naive_recurrent_gated_delta_product (q scaled by Dk^-0.5, passed pre-multiplied)."""
    rule = miras.compile(NEGEIG["deltaproduct"], checked=False)
    q, k, v, gates, w0, leaves = inputs(seed=2, n=2, decay=True)
    o, state = rule(q, k, v, gates, initial_state=w0, output_final_state=True, **FORMS[form])
    naive = fla_naive("gated_delta_product", "naive_recurrent_gated_delta_product")
    o_ref, s_ref = naive(
        q * DK**0.5, k, v, gates["decay"].log(), gates["lr"], scale=DK**-0.5,
        initial_state=w0.transpose(-1, -2), output_final_state=True, num_householder=2,
    )  # fmt: skip
    assert_rel_rms(o, o_ref, FLA_TOL, "o")
    assert_rel_rms(state, s_ref.transpose(-1, -2), FLA_TOL, "final state")
    grads = loss_and_grads(o, state, leaves)
    grads_ref = loss_and_grads(o_ref.double(), s_ref.transpose(-1, -2).double(), leaves)
    for what, g, g_ref in zip(["q", "k", "v", "lr", "decay", "W0"], grads, grads_ref, strict=True):
        assert_rel_rms(g, g_ref, FLA_TOL, f"d/d{what}")


@pytest.mark.parametrize("name", ["deltanet", "gated_deltanet"])
def test_the_chunk_start_form_matches_its_reference_with_negative_eigenvalues(name):
    """At chunk 4 the chunk-start form is its own model (every gradient of a chunk at the
    chunk's start state); against that model written out, forward and backward."""
    rule = miras.compile(NEGEIG[name], checked=False)
    retained = name == "gated_deltanet"
    q, k, v, gates, w0, leaves = inputs(seed=3, decay=retained)
    o, state = rule(q, k, v, gates, initial_state=w0, output_final_state=True,
                    backend="chunk", chunk_size=4, chunk_mode="start")  # fmt: skip
    o_ref, final = plain_recurrence(q, k, v, gates, {"W": w0}, block=4, retained=retained)
    torch.testing.assert_close(o, o_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(state, final["W"], rtol=1e-10, atol=1e-10)
    grads = loss_and_grads(o, state, leaves)
    for g, g_ref in zip(grads, loss_and_grads(o_ref, final["W"], leaves), strict=True):
        torch.testing.assert_close(g, g_ref, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("name", sorted(NEGEIG))
def test_the_triton_kernels_take_beta_above_1(name):
    """The step size reaches the kernels as a gate value: the interpreter at a tiny shape
    against the recurrence, float32, forward and backward."""
    rule = miras.compile(NEGEIG[name], checked=False)
    n = 2 if name == "deltaproduct" else 1
    q, k, v, gates, w0, _ = inputs(seed=4, n=n, decay=name != "deltanet")
    leaves32 = [x.detach().float().requires_grad_(True) for x in (q, k, v, *gates.values(), w0)]
    q_, k_, v_, *g_, w_ = leaves32
    gates32 = dict(zip(gates, g_, strict=True))
    o, state = rule(q_, k_, v_, gates32, initial_state=w_, output_final_state=True,
                    backend="triton", chunk_size=4)  # fmt: skip
    o_ref, state_ref = rule(q_, k_, v_, gates32, initial_state=w_, output_final_state=True,
                            backend="recurrent")  # fmt: skip
    assert_rel_rms(o, o_ref, 1e-5, "o")
    assert_rel_rms(state, state_ref, 1e-5, "final state")
    grads = torch.autograd.grad((o * o_ref.detach()).sum() + state.sum(), leaves32)
    grads_ref = torch.autograd.grad((o_ref * o_ref.detach()).sum() + state_ref.sum(), leaves32)
    for g, g_ref in zip(grads, grads_ref, strict=True):
        assert_rel_rms(g, g_ref, 1e-4, "gradient")
