"""Decoding a batch of prompts of different lengths: prefill the padded batch (left or right
padding) into the cache with its attention mask, then decode all rows at once, token by token;
every row equals decoding its sequence alone (float64, 1e-10), for every kind of model."""

from __future__ import annotations

import pytest
import torch

from tests.models.test_model_masks import CASES, TIGHT, model_of, padded_batch, sequences

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS = 4


def decode_alone(m, prompt: torch.Tensor, continuation: torch.Tensor, cut: int = 0):
    """One sequence: prompt [n] in one call (or two, cut at `cut`: a chunk-start memory
    depends on where its chunks start), then continuation [S] token by token -> (the logits of
    prompt[cut:] [n - cut, V], the steps' logits [S, V])."""
    cache = m.empty_cache(1)
    if cut:
        _, cache = m.decode(prompt[None, :cut], cache)
    logits = torch.zeros(1, 0, m.vocab_size, dtype=torch.float64)
    if cut < len(prompt):  # a call with no tokens is no call
        logits, cache = m.decode(prompt[None, cut:], cache)
    steps = []
    for t in range(len(continuation)):
        step, cache = m.decode(continuation[None, t : t + 1], cache)
        steps.append(step[0, 0])
    return logits[0], torch.stack(steps)


@pytest.mark.parametrize("padding", ["left", "right"])
@pytest.mark.parametrize(("path", "model"), CASES)
def test_batched_decoding_equals_each_sequence_alone(path, model, padding):
    m = model_of(path, model)
    prompts = sequences([5, 2, 7], seed=4)
    tokens, mask = padded_batch(prompts, padding)
    continuation = torch.randint(0, 11, (len(prompts), STEPS), generator=torch.Generator())
    with torch.no_grad():
        logits, cache = m.decode(tokens, m.empty_cache(len(prompts)), attention_mask=mask)
        steps = []
        for t in range(STEPS):
            step, cache = m.decode(continuation[:, t : t + 1], cache)
            steps.append(step[:, 0])
        steps = torch.stack(steps, dim=1)  # [B, S, V]
        for b, prompt in enumerate(prompts):
            prompt_alone, steps_alone = decode_alone(m, prompt, continuation[b])
            torch.testing.assert_close(logits[b, mask[b].bool()], prompt_alone, **TIGHT)
            torch.testing.assert_close(steps[b], steps_alone, **TIGHT)


@pytest.mark.parametrize(("path", "model"), CASES)
def test_prefill_in_padded_pieces_equals_one_sequence_alone(path, model):
    """Two padded pieces per row (a row may have no tokens in a piece, or be left-padded after
    its past): each row continues from its own last token."""
    m = model_of(path, model)
    prompts = sequences([6, 4, 5], seed=5)
    cuts = [2, 0, 5]  # row b's first piece: its first cuts[b] tokens
    first, first_mask = padded_batch(
        [p[:c] for p, c in zip(prompts, cuts, strict=True)], "right", 5
    )
    second, second_mask = padded_batch(
        [p[c:] for p, c in zip(prompts, cuts, strict=True)], "left", 4
    )
    continuation = torch.randint(0, 11, (len(prompts), 2), generator=torch.Generator())
    with torch.no_grad():
        cache = m.empty_cache(len(prompts))
        _, cache = m.decode(first, cache, attention_mask=first_mask)
        logits, cache = m.decode(second, cache, attention_mask=second_mask)
        step_0, cache = m.decode(continuation[:, :1], cache)
        step_1, cache = m.decode(continuation[:, 1:], cache)
        for b, (prompt, c) in enumerate(zip(prompts, cuts, strict=True)):
            prompt_alone, steps_alone = decode_alone(m, prompt, continuation[b], c)
            real = second_mask[b].bool()
            torch.testing.assert_close(logits[b, real], prompt_alone, **TIGHT)
            torch.testing.assert_close(step_0[b, 0], steps_alone[0], **TIGHT)
            torch.testing.assert_close(step_1[b, 0], steps_alone[1], **TIGHT)


@pytest.mark.parametrize("padding", ["left", "right"])
def test_generate_equals_each_prompt_alone(padding):
    m = model_of("specs/gated_deltanet.yaml", {"variant": "mag"})
    prompts = sequences([3, 6, 1], seed=6)
    tokens, mask = padded_batch(prompts, padding)
    generated = m.generate(tokens, 5, attention_mask=mask)
    assert generated.shape == (3, 5)
    for b, prompt in enumerate(prompts):
        assert torch.equal(generated[b], m.generate(prompt[None], 5)[0])


def test_generate_refuses_an_empty_prompt():
    m = model_of("specs/deltanet.yaml", {})
    tokens = torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="prompts: every row needs at least one token"):
        m.generate(tokens, 2, attention_mask=torch.tensor([[1, 1, 1], [0, 0, 0]]))
