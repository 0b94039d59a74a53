"""Feature maps: `normalize: true` (every map, components/base.py FeatureMap.phi) divides
phi(k) and phi(q) by their l2 norm per head, and the learning-rate gate's start accounts for
the map's norm bound B = max ||phi(k)||^2 over unit keys (miras.models.layer.GateMaps)."""

from __future__ import annotations

import pytest
import torch

import miras
from miras.checks.end_to_end import check_end_to_end
from miras.components.base import STEP_SIZE_GATE
from miras.models.layer import MirasLayer, feature_norm_bound
from miras.models.model import build_model
from miras.tasks import make_task

pytestmark = pytest.mark.usefixtures("one_thread")

ELU_MAP = {"kind": "custom", "formula": "where(x > 0, x + 1, exp(x))"}
MAPS = {
    "identity": "identity",
    "polynomial": {"kind": "polynomial", "degree": 2},
    "taylor": "taylor",
    "exp_kernel": {"kind": "exp_kernel", "order": 2},
    "custom": ELU_MAP,
}


def _spec(feature_map, normalize: bool | None = None, **extra) -> dict:
    if normalize is not None:
        feature_map = {"kind": feature_map} if isinstance(feature_map, str) else feature_map
        feature_map = {**feature_map, "normalize": normalize}
    return {
        "name": "fm",
        "feature_map": feature_map,
        "bias": "l2",
        "retention": "none",
        "optimizer": {"kind": "gd", "lr": "gate"},
        **extra,
    }


def _lr_start(layer: MirasLayer) -> float:
    return layer.gates(torch.zeros(1, 1, layer.d_model))["lr"][0, 0, 0].item()


@pytest.mark.parametrize("kind", MAPS)
def test_normalize_divides_phi_by_its_l2_norm(kind):
    plain = miras.compile(_spec(MAPS[kind]))
    unit = miras.compile(_spec(MAPS[kind], normalize=True))
    x = torch.randn(2, 3, 5, 4, dtype=torch.float64) * 2  # [B, H, T, D], not unit rows
    x[0, 0, 0] = 0.0  # the window's padding key: phi(0) = 0 stays 0 where the map gives 0
    want = plain.runtime.feature(x, plain.default_params(torch.float64))
    got = unit.runtime.feature(x, unit.default_params(torch.float64))
    norm = want.norm(dim=-1, keepdim=True)
    expected = torch.where(norm > 0, want / norm.clamp_min(1e-300), want)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    live = norm.squeeze(-1) > 0
    torch.testing.assert_close(got.norm(dim=-1)[live], torch.ones_like(norm.squeeze(-1)[live]))


def test_normalize_is_off_by_default_and_shown_in_the_derivation():
    spec = miras.load_spec(_spec(ELU_MAP))
    assert spec.feature_map.normalize is False
    text = str(miras.compile(_spec(ELU_MAP, normalize=True)).derivation())
    assert "then phi(x) / ||phi(x)||_2" in text


def test_a_normalized_map_passes_the_end_to_end_check():
    # Every backend against the autograd oracle, forward and backward, on the normalized map.
    rule = miras.compile(_spec(ELU_MAP, normalize=True))
    results = check_end_to_end(rule, triton=False)
    assert results and all(r.passed for r in results), [str(r) for r in results]


@pytest.mark.parametrize(
    ("kind", "bound"),
    [
        ("identity", 1.0),
        ("polynomial", 1.5**2),  # (a_1 + a_2)^2 at a one-hot key
        ("taylor", 2.5),  # 1 + ||k||^2 + ||k||^4 / 2
        ("exp_kernel", 2.5),  # sum_p 1 / p! to order 2
        ("custom", 16 + 2 * 4 + 1),  # elu + 1 at the constant key: d + 2 sqrt(d) + 1, d = 16
    ],
)
def test_the_feature_norm_bound_of_each_map(kind, bound):
    rule = miras.compile(_spec(MAPS[kind]))
    assert feature_norm_bound(rule, 16) == pytest.approx(bound, rel=1e-9)
    unit = miras.compile(_spec(MAPS[kind], normalize=True))
    assert feature_norm_bound(unit, 16) == pytest.approx(1.0, rel=1e-9)


@pytest.mark.parametrize(("kind", "chunk"), [("identity", 64), ("taylor", 64), ("custom", 16)])
def test_the_lr_start_keeps_the_worst_keys_step_at_most_one(kind, chunk):
    layer = MirasLayer(_spec(MAPS[kind]), 32, 2, chunk_size=chunk)
    bound = feature_norm_bound(layer.rule, 16)
    start = _lr_start(layer)
    assert start == pytest.approx(min(STEP_SIZE_GATE.start, 1 / bound), rel=1e-5)
    assert start * bound <= 1 + 1e-5


def test_the_lr_start_divides_by_the_chunk_too():
    spec = _spec(ELU_MAP)
    layer = MirasLayer(spec, 32, 2, chunk_size=8, chunk_mode="start")
    assert _lr_start(layer) == pytest.approx(1 / (8 * (16 + 8 + 1)), rel=1e-5)


def test_an_elu_model_stays_finite_at_initialization_on_text():
    # Heads of 32 as the default model: elu + 1 gives ||phi(k)||^2 ~ 33 to 44, and at the
    # start 0.5 the step lr ||phi(k)||^2 was ~16 and the forward overflowed by token 45.
    task = make_task("text", seq_len=128)
    torch.manual_seed(0)
    model = build_model(_spec(ELU_MAP), task.vocab_size)
    with torch.no_grad():
        logits = model(task.batch("train", 0, 2).inputs)
    assert torch.isfinite(logits).all()
