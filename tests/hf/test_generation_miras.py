"""generate() decoding modes on MirasCache: greedy, sampling and beam search each equal their
run without a cache (every step then recomputes the whole prefix); assisted decoding, which
needs to roll a state back, is refused with a message."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", reason="the hf extra: pip install -e '.[hf]'")

from tests.hf.hf_models import build, tokens

pytestmark = pytest.mark.usefixtures("one_thread")

SPECS = ["specs/gated_deltanet.yaml", "specs/titans.yaml", "specs/swa.yaml"]


def left_padded():
    ids = tokens(2, 5, seed=11)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    return ids, mask


@pytest.mark.parametrize("path", SPECS)
@pytest.mark.parametrize(
    "mode",
    [
        dict(do_sample=False),
        dict(do_sample=True, top_k=8, temperature=0.9),
        dict(do_sample=False, num_beams=3, num_return_sequences=2),
    ],
    ids=["greedy", "sampling", "beam"],
)
def test_each_decoding_mode_equals_its_uncached_run(path, mode):
    m = build(path, {})
    ids, mask = left_padded()
    runs = []
    for use_cache in (True, False):
        torch.manual_seed(5)
        runs.append(
            m.generate(
                ids, attention_mask=mask, max_new_tokens=5, pad_token_id=0, use_cache=use_cache,
                **mode,
            )
        )  # fmt: skip
    assert runs[0].shape[1] == ids.shape[1] + 5
    assert torch.equal(runs[0], runs[1])


def test_assisted_decoding_is_refused():
    m = build("specs/deltanet.yaml", {})
    helper = build("specs/deltanet.yaml", {}, seed=1)
    with pytest.raises(ValueError, match="stateful"):
        m.generate(tokens(1, 4, seed=12), assistant_model=helper, max_new_tokens=3)


@pytest.mark.parametrize("chunk_size", [4, 16])
@pytest.mark.parametrize("path", ["specs/titans.yaml", "specs/atlas.yaml", "specs/memora.yaml"])
def test_greedy_generate_of_a_chunk_start_memory_has_its_uncached_logits(path, chunk_size):
    """The chunk-start (atlas, memora) and dual (titans) forms: a cached greedy generate's
    logits at every step equal the uncached run's (float64, 1e-12), across chunk boundaries
    (a prompt of 6, 20 new tokens), with no warning."""
    import warnings

    m = build(path, {"chunk_size": chunk_size})
    ids = tokens(2, 6, seed=13)
    runs = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for use_cache in (True, False):
            out = m.generate(
                ids, max_new_tokens=20, do_sample=False, use_cache=use_cache, pad_token_id=0,
                output_logits=True, return_dict_in_generate=True,
            )  # fmt: skip
            runs.append(out)
    cached, uncached = runs
    assert torch.equal(cached.sequences, uncached.sequences)
    torch.testing.assert_close(
        torch.stack(cached.logits), torch.stack(uncached.logits), rtol=0, atol=1e-12
    )
