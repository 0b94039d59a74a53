"""Attention masks in every model build_mixer can make: a padded batch (left or right padding)
equals running each sequence alone, logits on the real tokens and the parameters' gradient of a
loss on the real tokens (float64, 1e-10); bad masks raise ValueErrors that name the argument.
"""

from __future__ import annotations

import pytest
import torch
import yaml

from miras.models import build_model

VOCAB = 11
SMALL = {
    "d_model": 16,
    "n_heads": 2,
    "n_layers": 2,
    "swa_window": 3,
    "mac_segment": 4,
    "chunk_size": 4,
}
TIGHT = dict(rtol=1e-10, atol=1e-10)

# One case per kind of model build_mixer makes: (spec file, model section on top of SMALL).
CASES = [
    pytest.param("specs/deltanet.yaml", {}, id="deltanet"),
    pytest.param("specs/titans.yaml", {"persistent_tokens": 2}, id="titans-persistent"),
    pytest.param("specs/deep_transformer.yaml", {}, id="deep_transformer"),
    pytest.param(
        "specs/deltanet.yaml", {"variant": "attention", "persistent_tokens": 2}, id="attention"
    ),
    pytest.param("specs/deltanet.yaml", {"variant": "swa"}, id="swa"),
    pytest.param(
        "specs/deltanet.yaml", {"variant": "attention", "positions": "conv"}, id="attention-conv"
    ),
    pytest.param("specs/swa.yaml", {"positions": "conv"}, id="swa-spec-conv"),
    pytest.param("specs/gated_deltanet.yaml", {"variant": "mal"}, id="mal"),
    pytest.param("specs/gated_deltanet.yaml", {"variant": "mag"}, id="mag"),
    pytest.param("specs/gated_deltanet.yaml", {"variant": "mac", "persistent_tokens": 2}, id="mac"),
    pytest.param("specs/deep_transformer.yaml", {"variant": "mac"}, id="deep_transformer-mac"),
]

pytestmark = pytest.mark.usefixtures("one_thread")


def model_of(path: str, model: dict):
    with open(path) as f:
        spec = yaml.safe_load(f)
    torch.manual_seed(0)
    return build_model({**spec, "model": {**SMALL, **model}}, VOCAB).double()


def sequences(lengths: list[int], seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g) for n in lengths]


def padded_batch(seqs: list[torch.Tensor], padding: str, length: int | None = None):
    """Sequences -> tokens [B, T] (random tokens at padding, so none can leak unseen) and the
    attention mask [B, T], each row's tokens at the left or the right end."""
    t = max(len(s) for s in seqs) if length is None else length
    g = torch.Generator().manual_seed(99)
    tokens = torch.randint(0, VOCAB, (len(seqs), t), generator=g)
    mask = torch.zeros(len(seqs), t, dtype=torch.long)
    for b, s in enumerate(seqs):
        span = slice(t - len(s), t) if padding == "left" else slice(0, len(s))
        tokens[b, span], mask[b, span] = s, 1
    return tokens, mask


def parameter_grads(model, loss) -> list[torch.Tensor]:
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    return [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads, strict=True)]


@pytest.mark.parametrize("padding", ["left", "right"])
@pytest.mark.parametrize(("path", "model"), CASES)
def test_padded_batch_equals_each_sequence_alone(path, model, padding):
    m = model_of(path, model)
    seqs = sequences([9, 5, 2], seed=1)
    tokens, mask = padded_batch(seqs, padding)
    logits = m(tokens, attention_mask=mask)
    assert bool(torch.isfinite(logits).all())  # padding's outputs are don't-care, but finite
    w = torch.randn(logits.shape, generator=torch.Generator().manual_seed(2), dtype=logits.dtype)
    grads = parameter_grads(m, (logits * w * mask[..., None]).sum())
    alone = [torch.zeros_like(g) for g in grads]
    for b, s in enumerate(seqs):
        real = mask[b].bool()
        logits_b = m(s[None])
        torch.testing.assert_close(logits[b, real], logits_b[0], **TIGHT)
        grads_b = parameter_grads(m, (logits_b[0] * w[b, real]).sum())
        for total, g in zip(alone, grads_b, strict=True):
            total += g
    assert any(bool(g.abs().max() > 0) for g in grads)
    for g, g_alone in zip(grads, alone, strict=True):
        torch.testing.assert_close(g, g_alone, **TIGHT)


def test_an_all_padding_row_is_finite_and_leaves_the_others_alone():
    m = model_of("specs/gated_deltanet.yaml", {"variant": "mal"})
    seqs = sequences([6, 3], seed=3)
    tokens, mask = padded_batch([*seqs, torch.zeros(0, dtype=torch.long)], "left")
    logits = m(tokens, attention_mask=mask)
    assert bool(torch.isfinite(logits).all())
    for b, s in enumerate(seqs):
        torch.testing.assert_close(logits[b, mask[b].bool()], m(s[None])[0], **TIGHT)


# Bad masks ------------------------------------------------------------------------------------

BAD_MASKS = [
    pytest.param(torch.tensor([[1, 0, 1, 1]] * 2), ["row 0", "contiguous"], id="holes"),
    pytest.param(torch.tensor([[1, 2, 1, 1]] * 2), ["0 (padding) or 1"], id="values"),
    pytest.param(torch.full((2, 4), 0.5), ["0 (padding) or 1"], id="fractions"),
    pytest.param(torch.ones(2, 3), ["[B, T] = [2, 4]", "[2, 3]"], id="shape"),
    pytest.param(torch.ones(4, dtype=torch.long), ["[B, T] = [2, 4]", "[4]"], id="one-axis"),
    pytest.param([[1, 1, 1, 1]] * 2, ["[B, T] = [2, 4]", "list"], id="not-a-tensor"),
]


@pytest.mark.parametrize(("mask", "words"), BAD_MASKS)
def test_bad_masks_raise_value_errors_naming_the_argument(mask, words):
    m = model_of("specs/gated_deltanet.yaml", {"variant": "mag"})
    tokens = torch.zeros(2, 4, dtype=torch.long)
    calls = [
        lambda: m(tokens, attention_mask=mask),
        lambda: m.decode(tokens, m.empty_cache(2), attention_mask=mask),
        lambda: m.generate(tokens, 2, attention_mask=mask),
    ]
    for call in calls:
        with pytest.raises(ValueError) as err:
            call()
        for word in ["attention_mask", *words]:
            assert word in str(err.value)


@pytest.mark.parametrize(("path", "model"), CASES)
def test_every_mixer_checks_its_mask(path, model):
    """Each mixer is public on its own: it refuses a bad mask, with or without a cache."""
    mixer = model_of(path, model).blocks[0].mixer
    x = torch.randn(2, 4, SMALL["d_model"], dtype=torch.float64)
    for cache in (None, mixer.empty_cache(2)):
        with pytest.raises(ValueError, match="attention_mask: row 1 is not one contiguous"):
            mixer(x, cache, torch.tensor([[1, 1, 1, 1], [0, 1, 0, 1]]))
