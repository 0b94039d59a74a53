"""MirasCache against the uncached forward, for every shipped spec and each hybrid: a prefill in
pieces then decoding token by token equals one forward over the whole sequence; left-padded
prompts decode as each prompt alone; packed sequences (cu_seqlens) equal each alone.
Every memory at chunk size 4, so the pieces cut chunks anywhere (the chunk-start and dual
forms' cache keeps their chunk boundaries). float64 to 1e-12; float32 within 1e-5."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", reason="the hf extra: pip install -e '.[hf]'")

from miras.hf import MirasCache
from tests.hf.hf_models import VOCAB, build, cases, tokens

pytestmark = pytest.mark.usefixtures("one_thread")

TOLERANCE = {
    torch.float64: dict(rtol=0, atol=1e-12),
    torch.float32: dict(rtol=1e-5, atol=1e-5),
}
LENGTH = 11
PIECES = [3, 1, 4]  # then token by token


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize(("path", "extra"), cases())
def test_prefill_in_pieces_then_decoding_equals_the_uncached_forward(path, extra, dtype):
    m = build(path, extra, dtype)
    ids = tokens(2, LENGTH, seed=1)
    with torch.no_grad():
        full = m(ids, use_cache=False).logits
        cache, pieces, at = None, [], 0
        for n in PIECES + [1] * (LENGTH - sum(PIECES)):
            out = m(ids[:, at : at + n], past_key_values=cache, use_cache=True)
            cache, at = out.past_key_values, at + n
            pieces.append(out.logits)
    assert isinstance(cache, MirasCache) and cache.get_seq_length() == LENGTH
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, **TOLERANCE[dtype])


@pytest.mark.parametrize(("path", "extra"), cases())
def test_greedy_generation_of_left_padded_prompts_equals_each_prompt_alone(path, extra):
    m = build(path, extra)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g) for n in (5, 2, 7)]
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, width - len(p) :], mask[b, width - len(p) :] = p, 1
    kwargs = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    together = m.generate(ids, attention_mask=mask, **kwargs)[:, width:]
    for b, p in enumerate(prompts):
        alone = m.generate(p[None], attention_mask=torch.ones(1, len(p)), **kwargs)
        assert torch.equal(together[b], alone[0, len(p) :])
        # and the uncached forward agrees: each step's token is the argmax of the logits
        seq = alone[0]
        with torch.no_grad():
            logits = m(seq[None], use_cache=False).logits[0]
        assert torch.equal(logits[len(p) - 1 : -1].argmax(-1), seq[len(p) :])


@pytest.mark.parametrize(("path", "extra"), cases())
def test_a_packed_batch_equals_its_sequences_alone(path, extra):
    """cu_seqlens, and a 2-D padding mask unpadded into it: no state crosses a boundary."""
    m = build(path, extra)
    lengths = [4, 1, 6]
    seqs = [tokens(1, n, seed=10 + n)[0] for n in lengths]
    packed = torch.cat(seqs)[None]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    with torch.no_grad():
        out = m(packed, cu_seqlens=cu, labels=packed)
        alone = [m(s[None], use_cache=False).logits[0] for s in seqs]
        torch.testing.assert_close(out.logits[0], torch.cat(alone), **TOLERANCE[torch.float64])
        # the same sequences right-padded in a [3, 6] batch, unpadded with their mask
        width = max(lengths)
        padded = torch.zeros(len(seqs), width, dtype=torch.long)
        mask = torch.zeros_like(padded)
        for b, s in enumerate(seqs):
            padded[b, : len(s)], mask[b, : len(s)] = s, 1
        by_mask = m(padded, attention_mask=mask).logits
        valid = mask.bool()
        unpadded = padded[valid][None]
        cu_mask = torch.cat([torch.zeros(1, dtype=torch.long), mask.sum(1).cumsum(0)])
        torch.testing.assert_close(
            m(unpadded, cu_seqlens=cu_mask).logits[0], by_mask[valid], **TOLERANCE[torch.float64]
        )
    # the loss never asks a sequence's last token for the next sequence's first
    alone_loss = [m(s[None], labels=s[None]) for s in seqs if len(s) > 1]
    total = sum(o.loss * (n - 1) for o, n in zip(alone_loss, [4, 6], strict=True))
    torch.testing.assert_close(out.loss, total / 8, **TOLERANCE[torch.float64])


@pytest.mark.parametrize("flash_kwargs", [False, True], ids=["position_ids", "cu_seq_lens"])
def test_transformers_packing_collator_keeps_sequences_apart(flash_kwargs):
    """DataCollatorWithFlattening packs examples in one row with position_ids that restart
    at 0 (or cu_seq_lens_q): the model reads them, so no state crosses a boundary."""
    from transformers import DataCollatorWithFlattening

    m = build("specs/gated_deltanet.yaml", {})
    seqs = [tokens(1, n, seed=20 + n)[0] for n in (5, 3, 6)]
    collate = DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs)
    batch = collate([{"input_ids": s.tolist()} for s in seqs])
    with torch.no_grad():
        out = m(**batch)
        alone = [m(s[None], labels=s[None]) for s in seqs]
    torch.testing.assert_close(
        out.logits[0], torch.cat([o.logits[0] for o in alone]), **TOLERANCE[torch.float64]
    )
    total = sum(o.loss * (len(s) - 1) for o, s in zip(alone, seqs, strict=True))
    torch.testing.assert_close(out.loss, total / 11, **TOLERANCE[torch.float64])
