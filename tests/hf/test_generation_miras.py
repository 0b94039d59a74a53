"""generate() decoding modes on MirasCache: greedy, sampling and beam search each equal their
run without a cache (every step then recomputes the whole prefix); assisted decoding, which
needs to roll a state back, is refused with a message."""

from __future__ import annotations

import pytest
import torch
from hf_models import build, tokens

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


def test_a_chunk_start_memory_above_chunk_size_1_warns_once_that_the_cache_differs():
    from hf_models import SMALL

    from miras.hf import MirasForCausalLM

    approximate = MirasForCausalLM.from_spec("specs/titans.yaml", 64, **SMALL, chunk_size=4)
    with pytest.warns(UserWarning, match=r"chunk-start approximation \(dual form\).*chunk_size"):
        approximate.generate(tokens(1, 3, seed=13), max_new_tokens=2, do_sample=False)
    exact = build("specs/titans.yaml", {})  # chunk size 1: the recurrence itself
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        exact.generate(tokens(1, 3, seed=13), max_new_tokens=2, do_sample=False)
    assert exact.model.approximate == ""
    assert build("specs/deltanet.yaml", {}).model.approximate == ""  # exact at chunk size 4
