"""specs/deltaproduct.yaml (Gated DeltaProduct, n = 2 keys and values per token) end to end:
the spec reproduces fla-core's naive recurrence, the layer feeds it n keys, values and
learning rates per token, a probe writes n pairs per token, a tiny MQAR model trains, and a
study searches n."""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F

import miras
from miras.models.layer import MirasLayer
from miras.probes.suite import capacity
from miras.spec import load_spec
from tests.helpers import tiny_mqar_losses
from tests.runtime.test_known_models import assert_rel_rms, fla_naive
from tests.search_support import search_grid

ROOT = Path(__file__).resolve().parents[2]
DELTAPRODUCT = ROOT / "specs/deltaproduct.yaml"


def test_the_spec_is_fla_naive_recurrent_gated_delta_product():
    """The rule of the shipped spec with fla's gates (decay exp(g), lr beta, q scaled) on
    fla's packing equals fla's recurrence (float32, relative RMS 1e-5)."""
    gen = torch.Generator().manual_seed(0)
    n, b, t, h, d = 2, 2, 19, 2, 8
    q = torch.randn(b, t, h, d, generator=gen)
    k = F.normalize(torch.randn(b, t * n, h, d, generator=gen), dim=-1)
    v = torch.randn(b, t * n, h, d, generator=gen)
    beta = torch.rand(b, t * n, h, generator=gen)
    g = torch.log(0.5 + 0.5 * torch.rand(b, t, h, generator=gen))
    rule = miras.compile(DELTAPRODUCT)
    assert rule.plan.chunk_form.form == "exact"
    o, s = rule(q * d**-0.5, k, v, {"lr": beta, "decay": g.exp()}, chunk_size=8,
                output_final_state=True)  # fmt: skip
    naive = fla_naive("gated_delta_product", "naive_recurrent_gated_delta_product")
    o_ref, s_ref = naive(q, k, v, g, beta, scale=d**-0.5, output_final_state=True,
                         num_householder=n)  # fmt: skip
    assert_rel_rms(o, o_ref, 1e-5, "o")
    assert_rel_rms(s.transpose(-1, -2), s_ref, 1e-5, "final state")


def test_the_layer_feeds_n_keys_values_and_learning_rates_per_token():
    torch.manual_seed(0)
    layer = MirasLayer(DELTAPRODUCT, 16, 2, chunk_size=4).double()
    x = torch.randn(2, 7, 16, dtype=torch.float64)
    q, k, v, gates, _ = layer.memory_inputs(x, None)
    assert q.shape == (2, 7, 2, 8) and k.shape == v.shape == (2, 14, 2, 8)
    assert gates["lr"].shape == (2, 14, 2) and gates["decay"].shape == (2, 7, 2)
    # Step j of token t is the j-th slice of the token's projection (fla's packing).
    raw = layer.conv(layer.qkv(x))[0][..., 16:48].unflatten(-1, (2, 2, 8))  # [B, T, n, H, d]
    torch.testing.assert_close(k[:, 1::2], F.normalize(raw[:, :, 1], dim=-1))
    # In pieces with the cache (decoding one token) equals one pass.
    y, _ = layer(x)
    cache = layer.empty_cache(2)
    pieces = []
    for part in (x[:, :3], x[:, 3:4], x[:, 4:]):
        out, cache = layer(part, cache)
        pieces.append(out)
    torch.testing.assert_close(torch.cat(pieces, dim=1), y, rtol=1e-10, atol=1e-10)


def test_a_probe_writes_n_pairs_per_token():
    """Orthogonal keys at lr 1 without forgetting: the delta rule recalls up to d_k pairs
    exactly, and so does DeltaProduct writing them two per token, an odd count included
    (one empty step in front)."""
    result = capacity(DELTAPRODUCT, keys="orthogonal", pair_counts=[5, 8], d_k=8, trials=4,
                      seeds=2, gates={"lr": 1.0, "decay": 1.0})  # fmt: skip
    errors = [e for point in result.points for e in point.errors]
    assert len(errors) == 4 and max(errors) < 1e-12, errors


def test_deltaproduct_trains_on_a_tiny_mqar():
    """A one-layer DeltaProduct model on MQAR at T = 32 (4 pairs): the loss falls in 40 steps."""
    first, last, final = tiny_mqar_losses(DELTAPRODUCT)
    assert math.isfinite(final) and last < first - 0.2, (first, last)


def test_a_study_searches_the_steps_per_token(tmp_path):
    """`optimizer.steps: {choices: [2, 3]}` with keys per step, through the search API: the
    grid trains one trial of each n."""
    trials = search_grid(
        tmp_path,
        {
            "memory": "matrix",
            "bias": "l2",
            "retention": {"kind": "l2", "grad_at": "retained"},
            "optimizer": {"kind": "gd", "steps": {"choices": [2, 3]}, "keys": "per_step"},
            "model": {"d_model": 16, "n_layers": 1, "n_heads": 1},
        },
        trials=2,
    )
    assert sorted(load_spec(t.user_attrs["spec"]).optimizer.steps for t in trials) == [2, 3]
    for t in trials:
        assert math.isfinite(t.user_attrs["metrics"]["loss"])


def test_a_diverged_layer_names_the_token_and_step_that_overshoots():
    """With keys per step, k and lr are packed [B, T*n, ...]: the overshooting step lr *
    ||phi(k)||^2 is found among the steps of the tokens up to the diverged one and named as
    (token, step) (it was read from the first tokens' worth of packed steps, as token numbers)."""
    layer = MirasLayer(DELTAPRODUCT, 16, 2)
    k = F.normalize(torch.randn(1, 12, 2, 8, generator=torch.Generator().manual_seed(0)), dim=-1)
    lr = torch.full((1, 12, 2), 0.1)
    lr[0, 7, 0] = 3.0  # token 3, step 1
    text = layer._likely_cause(k, {"lr": lr, "decay": torch.ones(1, 6, 2)}, 4, 0, 0)
    assert "reaches 3 at token 3, step 1" in text and "overshoots" in text, text
