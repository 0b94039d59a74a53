"""MirasForCausalLM as a transformers model: the Auto classes, save_pretrained /
from_pretrained to bit-identical logits for every shipped spec, labels shifted inside forward,
logits_to_keep, activation checkpointing, and the errors for bad input."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers", reason="the hf extra: pip install -e '.[hf]'")

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from miras.hf import MirasConfig, MirasForCausalLM, MirasModel
from miras.models import LanguageModel
from tests.hf.hf_models import SMALL, VOCAB, build, cases, tokens

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize(("path", "extra"), cases())
def test_save_and_load_round_trip_to_bit_identical_logits(path, extra, tmp_path):
    m = build(path, extra, torch.float32)
    ids = tokens(2, 7, seed=2)
    with torch.no_grad():
        before = m(ids).logits
    m.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").is_file()
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == "miras" and saved["model"]["d_model"] == SMALL["d_model"]
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert isinstance(loaded, MirasForCausalLM)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, before)


def test_the_auto_classes_know_model_type_miras(tmp_path):
    config = MirasConfig.from_spec("specs/deltanet.yaml", VOCAB, **SMALL)
    config.save_pretrained(tmp_path)
    assert isinstance(AutoConfig.from_pretrained(tmp_path), MirasConfig)
    assert isinstance(AutoModel.from_config(config), MirasModel)
    assert isinstance(AutoModelForCausalLM.from_config(config), MirasForCausalLM)


def test_from_spec_applies_model_overrides_and_keeps_the_spec_text():
    m = MirasForCausalLM.from_spec("specs/titans.yaml", VOCAB, d_model=32, n_layers=1)
    assert isinstance(m.model.lm, LanguageModel) and len(m.model.lm.blocks) == 1
    assert m.config.hidden_size == 32 and m.config.model["n_heads"] == 2
    assert "name: titans" in m.config.spec and "model:" not in m.config.spec


def test_a_bad_model_override_names_the_field():
    with pytest.raises(Exception, match="n_heads"):
        MirasForCausalLM.from_spec("specs/deltanet.yaml", VOCAB, d_model=30, n_heads=4)


def test_labels_are_shifted_inside_forward_and_padding_is_no_target():
    m = build("specs/deltanet.yaml", {})
    ids = tokens(2, 6, seed=4)
    out = m(ids, labels=ids)
    by_hand = torch.nn.functional.cross_entropy(
        out.logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1)
    )
    torch.testing.assert_close(out.loss, by_hand, rtol=1e-12, atol=1e-12)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # left padding in row 1: its first two are no target
    padded = m(ids, attention_mask=mask, labels=ids)
    targets = ids.clone()
    targets[1, :2] = -100
    by_hand = torch.nn.functional.cross_entropy(
        padded.logits[:, :-1].reshape(-1, VOCAB), targets[:, 1:].reshape(-1)
    )
    torch.testing.assert_close(padded.loss, by_hand, rtol=1e-12, atol=1e-12)


def test_logits_to_keep_keeps_the_last_positions_or_the_given_ones():
    m = build("specs/gated_deltanet.yaml", {})
    ids = tokens(2, 8, seed=5)
    with torch.no_grad():
        full = m(ids).logits
        close = dict(rtol=1e-12, atol=1e-12)  # a smaller head product rounds its own way
        torch.testing.assert_close(m(ids, logits_to_keep=1).logits, full[:, -1:], **close)
        torch.testing.assert_close(m(ids, logits_to_keep=3).logits, full[:, -3:], **close)
        index = torch.tensor([0, 5])
        torch.testing.assert_close(m(ids, logits_to_keep=index).logits, full[:, index], **close)


def test_activation_checkpointing_gives_the_same_loss_and_gradients():
    m = build("specs/titans.yaml", {})
    m.train()
    ids = tokens(2, 9, seed=6)
    loss = m(ids, labels=ids).loss
    grads = torch.autograd.grad(loss, list(m.parameters()), allow_unused=True)
    m.activation_checkpointing_enable()
    assert m.model.gradient_checkpointing
    again = m(ids, labels=ids).loss
    grads_again = torch.autograd.grad(again, list(m.parameters()), allow_unused=True)
    torch.testing.assert_close(again, loss, rtol=0, atol=0)
    for g, h in zip(grads, grads_again, strict=True):
        if g is None:
            assert h is None
        else:
            torch.testing.assert_close(h, g, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        (dict(attention_mask=torch.ones(2, 1, 4, 4)), ["2-D padding mask", "[2, 1, 4, 4]"]),
        (dict(attention_mask=torch.ones(2, 3)), ["[B, T] = [2, 4]", "[2, 3]"]),
        (dict(cu_seqlens=torch.tensor([0, 3])), ["cu_seqlens", "0 to the tokens T = 4"]),
        (dict(cu_seqlens=torch.tensor([0, 2, 2, 4])), ["cu_seqlens", "at least one token"]),
    ],
    ids=["4d-mask", "mask-shape", "cu-short", "cu-empty"],
)
def test_bad_inputs_name_the_argument(kwargs, words):
    m = build("specs/deltanet.yaml", {})
    ids = tokens(1 if "cu_seqlens" in kwargs else 2, 4, seed=7)
    with pytest.raises(ValueError) as err:
        m(ids, use_cache=False, **kwargs)
    for word in words:
        assert word in str(err.value)


def test_a_cache_of_another_kind_is_refused():
    from transformers import DynamicCache

    m = build("specs/deltanet.yaml", {})
    with pytest.raises(TypeError, match="MirasCache"):
        m(tokens(1, 3, seed=8), past_key_values=DynamicCache())
