"""The learning-rate gate's starting value follows the chunk form (miras.models.layer.GateMaps).

In the chunk-start and dual forms a chunk of b tokens takes all b gradients at one state, so
the summed step is up to b times one token's; the gate starts at its declared start (the
optimizer's `gate_defaults`, STEP_SIZE_GATE) / b there, and at that start in the exact form (each
token's gradient at its own state)."""

from __future__ import annotations

import pytest
import torch

from miras.components.base import STEP_SIZE_GATE
from miras.models.layer import MirasLayer

START = STEP_SIZE_GATE.start  # the learning rate's declared start, 0.5


def _lr_start(layer: MirasLayer) -> float:
    """The first head's learning rate at init (the gate's projection starts at zero)."""
    return layer.gates(torch.zeros(1, 1, layer.d_model))["lr"][0, 0, 0].item()


@pytest.mark.parametrize(
    ("spec", "chunk", "summed"),
    [("titans", 16, 16), ("titans", 4, 4), ("deltanet", 16, 1), ("gated_deltanet", 64, 1)],
)
def test_lr_starts_at_one_tokens_step_per_chunk(spec, chunk, summed):
    layer = MirasLayer(f"specs/{spec}.yaml", 32, 2, chunk_size=chunk)
    value = _lr_start(layer)
    assert value == pytest.approx(START / summed, rel=1e-5)


def test_forced_chunk_start_scales_an_exact_spec():
    layer = MirasLayer("specs/deltanet.yaml", 32, 2, chunk_size=8, chunk_mode="start")
    assert _lr_start(layer) == pytest.approx(START / 8, rel=1e-5)


def test_titans_layer_stays_finite_at_init():
    # d_model 256 in 4 heads of 64, chunk 16 (the deep-memory benchmark's sizes): with the
    # learning rate at 0.5 per token the memory reached |W| ~ 6e7 after 10 chunks and NaN
    # after 224 tokens on these inputs.
    torch.manual_seed(0)
    layer = MirasLayer("specs/titans.yaml", 256, 4, chunk_size=16)
    with torch.no_grad():
        o, cache = layer(torch.randn(2, 512, 256), layer.empty_cache(2))
    assert torch.isfinite(o).all()
    weights = cache["memory"]
    assert max(w.abs().max().item() for w in weights.values()) < 10.0
