"""Decoding computes what the uncached forward computes, for every shipped spec and hybrid.

A prefill of P tokens through the cache, then one token at a time, equals one uncached forward
over the same tokens (docs/models.md, "Decoding"): where the chunk form is exact the cache
takes recurrent steps; the chunk-start and dual forms keep the memory at the chunk's start and
the partial chunk's inputs, so their chunk boundaries are the uncached forward's. P = 0 (every
token one at a time), a P inside a chunk and a P on a chunk boundary; chunk size 4 (T = 11,
a bit over two chunks) for every spec, and the specs' own chunk size 16 in float32.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from miras.models import build_model
from miras.models.layer import MirasLayer
from miras.spec import load_spec

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(__file__).resolve().parents[2]
SPECS = sorted(path.stem for path in (ROOT / "specs").glob("*.yaml"))
VOCAB = 13
TINY = {"d_model": 16, "n_heads": 2, "n_layers": 1, "gate_rank": 4}
CHUNK = 4
PREFILLS = (0, 5, 2 * CHUNK)  # none, inside the second chunk, on the third chunk's start


# Two optimizer steps per token (DeltaProduct's keys per step) on an MLP memory: the dual form,
# whose chunks count steps.
PRODUCT_MLP = {
    **load_spec(ROOT / "specs" / "deltaproduct.yaml").model_dump(mode="json"),
    "name": "deltaproduct_mlp",
    "memory": {"kind": "mlp", "depth": 2, "expansion": 2, "activation": "silu"},
}


def model_of(name: str, dtype=torch.float64, **model):
    if name == PRODUCT_MLP["name"]:
        data = {**PRODUCT_MLP, "model": {**TINY, **model}}
    else:
        spec = load_spec(ROOT / "specs" / f"{name}.yaml")
        data = {**spec.model_dump(mode="json"), "model": {**TINY, **model}}
    torch.manual_seed(0)
    return build_model(data, VOCAB).to(dtype).eval()


def tokens(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def decoded(model, x: torch.Tensor, prefill: int) -> torch.Tensor:
    """Logits [B, T, V] of `prefill` tokens in one cached call, then one token per call."""
    cache, pieces = model.empty_cache(x.shape[0]), []
    if prefill:
        logits, cache = model.decode(x[:, :prefill], cache)
        pieces.append(logits)
    for t in range(prefill, x.shape[1]):
        logits, cache = model.decode(x[:, t : t + 1], cache)
        pieces.append(logits)
    return torch.cat(pieces, dim=1)


def chunk_follows_boundaries(model) -> bool:
    return any(isinstance(m, MirasLayer) and m.chunk_follows_boundaries for m in model.modules())


@pytest.mark.parametrize("prefill", PREFILLS, ids=lambda p: f"prefill{p}")
@pytest.mark.parametrize("name", [*SPECS, PRODUCT_MLP["name"]])
def test_decode_equals_the_uncached_forward(name, prefill):
    model = model_of(name, chunk_size=CHUNK)
    x = tokens(2, 2 * CHUNK + 3)
    with torch.no_grad():
        full = model(x)
    torch.testing.assert_close(decoded(model, x, prefill), full, rtol=0, atol=1e-12)


def test_the_chunk_start_specs_are_the_ones_that_follow_boundaries():
    """The check above is not vacuous: the chunk-start and dual specs run the chunked decode
    (and differ from the recurrence at this chunk size), the exact ones do not need it."""
    follows = {name for name in SPECS if chunk_follows_boundaries(model_of(name, chunk_size=CHUNK))}
    assert {"titans", "atlas", "memora", "moneta", "yaad", "dla", "deep_transformer"} <= follows
    assert not follows & {"deltanet", "gated_deltanet", "attention", "mesanet", "omeganet"}
    chunked, recurrent = (
        model_of("titans", chunk_size=CHUNK),
        model_of("titans", backend="recurrent"),
    )
    recurrent.load_state_dict(chunked.state_dict())
    x = tokens(2, 2 * CHUNK + 3)
    with torch.no_grad():
        assert (chunked(x) - recurrent(x)).abs().max() > 1e-6


def test_steps_per_token_need_chunks_that_end_between_tokens():
    """Chunks of 3 optimizer steps at 2 steps per token end inside a token: refused, naming
    the chunk size and what to use."""
    model = model_of(PRODUCT_MLP["name"], chunk_size=3)
    with pytest.raises(ValueError, match=r"chunk_size: 3 is not a multiple of the 2 optimizer"):
        model.decode(tokens(1, 2), model.empty_cache(1))


HYBRIDS = {
    "mal": {"variant": "mal", "swa_window": 5},
    "mag": {"variant": "mag", "swa_window": 5},
    "mac-segment-8": {"variant": "mac", "mac_segment": 8},
    "mac-segment-6": {"variant": "mac", "mac_segment": 6},  # chunks restart mid-chunk
    "persistent-3": {"persistent_tokens": 3},  # boundaries count the persistent tokens
    "mac-persistent": {"variant": "mac", "mac_segment": 6, "persistent_tokens": 2},
}


@pytest.mark.parametrize("prefill", PREFILLS, ids=lambda p: f"prefill{p}")
@pytest.mark.parametrize("hybrid", list(HYBRIDS))
@pytest.mark.parametrize("name", ["titans", "atlas"])
def test_hybrid_decode_equals_the_uncached_forward(name, hybrid, prefill):
    model = model_of(name, chunk_size=CHUNK, **HYBRIDS[hybrid])
    x = tokens(2, 2 * CHUNK + 5, seed=1)
    with torch.no_grad():
        full = model(x)
    torch.testing.assert_close(decoded(model, x, prefill), full, rtol=0, atol=1e-12)


@pytest.mark.parametrize("prefill", [0, 19], ids=lambda p: f"prefill{p}")
@pytest.mark.parametrize("name", ["titans", "atlas", "memora", "dla"])
def test_float32_decode_at_the_specs_own_chunk_size(name, prefill):
    """Chunk size 16 (the chunk-start default), T = 37: a prefill of 19 leaves 3 tokens of a
    partial chunk in the cache."""
    model = model_of(name, dtype=torch.float32)
    assert {m.chunk_size for m in model.modules() if isinstance(m, MirasLayer)} == {16}
    x = tokens(2, 37, seed=2)
    with torch.no_grad():
        full = model(x)
    torch.testing.assert_close(decoded(model, x, prefill), full, rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    ("name", "variant"),
    [("titans", "lmm"), ("titans", "mac"), (PRODUCT_MLP["name"], "lmm")],
)
def test_padded_prompts_decode_like_each_sequence_alone(name, variant):
    """Prompts of 3, 6 and 9 tokens (left-padded, one cached call) leave partial chunks of
    different lengths (3, 2, 1 tokens at chunk 4; 1, 0, 1 at 2 steps per token); the batch
    then decodes row by row where they differ, each row equal to the uncached forward of its
    own sequence."""
    model = model_of(name, chunk_size=CHUNK, variant=variant, mac_segment=6)
    lengths, steps = [3, 6, 9], 5
    rows = [tokens(1, n + steps, seed=10 + i)[0] for i, n in enumerate(lengths)]
    width = max(lengths)
    prompts = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, (row, n) in enumerate(zip(rows, lengths, strict=True)):
        prompts[i, width - n :], mask[i, width - n :] = row[:n], 1
    with torch.no_grad():
        logits, cache = model.decode(prompts, model.empty_cache(len(rows)), attention_mask=mask)
        got = [[logits[i, -1]] for i in range(len(rows))]
        for t in range(steps - 1):
            column = torch.stack([row[n + t] for row, n in zip(rows, lengths, strict=True)])
            logits, cache = model.decode(column[:, None], cache)
            for i in range(len(rows)):
                got[i].append(logits[i, 0])
        for i, (row, n) in enumerate(zip(rows, lengths, strict=True)):
            alone = model(row[None, : n + steps - 1])[0, n - 1 :]
            torch.testing.assert_close(torch.stack(got[i]), alone, rtol=0, atol=1e-12)


def test_the_triton_backend_decodes_in_its_chunk_start_form():
    """The triton kernels in the chunk-start form (Gated DeltaNet, chunk_mode "start"; they
    cover matrix memories) run each partial chunk too: decode equals their uncached forward
    (float32, Triton's interpreter on a CPU)."""
    torch.manual_seed(0)
    layer = MirasLayer(
        ROOT / "specs" / "gated_deltanet.yaml", 16, 2, chunk_size=4, backend="triton",
        chunk_mode="start",
    )  # fmt: skip
    assert layer.chunk_follows_boundaries
    x = torch.randn(2, 7, 16)
    with torch.no_grad():
        full, _ = layer(x)
        _, cache = layer(x[:, :3], layer.empty_cache(2))
        steps = []
        for t in range(3, 7):
            y, cache = layer(x[:, t : t + 1], cache)
            steps.append(y)
    torch.testing.assert_close(torch.cat(steps, 1), full[:, 3:], rtol=0, atol=1e-5)
