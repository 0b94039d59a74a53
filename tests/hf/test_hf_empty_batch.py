"""An empty batch (B = 0) through the transformers bridge, for every shipped spec and each
hybrid (docs/hf.md): logits of no rows, a loss of 0 with zero gradients (the mean over no
targets, which a plain mean would make 0 / 0), a cached step, the padded forward; and the
errors where an empty batch has no meaning (generate, packed sequences).

The logits and the cached step are held to B = 1 by `helpers.assert_empty_batch`."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", reason="the hf extra: pip install -e '.[hf]'")

from miras.hf.modeling_miras import IGNORE_INDEX, shifted_loss
from tests.helpers import assert_empty_batch
from tests.hf.hf_models import build, cases, tokens

pytestmark = pytest.mark.usefixtures("one_thread")
T = 6


@pytest.mark.parametrize(("path", "extra"), cases())
def test_forward_and_loss_at_empty_batch(path, extra):
    model = build(path, extra, torch.float32)
    params = dict(model.named_parameters())

    def call(batch: int):
        ids = tokens(batch, T, seed=1)
        mask = torch.ones_like(ids)
        out = model(ids, labels=ids, use_cache=True)
        step = model(ids[:, :1], past_key_values=out.past_key_values, use_cache=True)
        padded = model(ids, attention_mask=mask, labels=ids)
        outputs = {"logits": out.logits, "step": step.logits, "padded": padded.logits}
        return outputs, params

    assert_empty_batch(call)
    grads = {}
    for batch in (1, 0):
        ids = tokens(batch, T, seed=1)
        loss = model(ids, labels=ids).loss
        grads[batch] = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
    assert loss.item() == 0.0
    for name, g1, g0 in zip(params, grads[1], grads[0], strict=True):
        assert (g0 is None) == (g1 is None), name
        assert g0 is None or (g0.shape == params[name].shape and torch.count_nonzero(g0) == 0)


def test_a_loss_without_targets_is_zero():
    """Every label -100 (here in a batch of rows): the mean over no targets is 0, not NaN; with
    targets it is their mean, as cross_entropy's."""
    logits = torch.randn(2, 4, 5, requires_grad=True)
    labels = torch.full((2, 4), IGNORE_INDEX)
    loss = shifted_loss(logits, labels)
    (grad,) = torch.autograd.grad(loss, logits)
    assert loss.item() == 0.0 and torch.count_nonzero(grad) == 0
    labels[0, 2], labels[1, 1] = 3, 1
    want = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, 5), labels[:, 1:].reshape(-1), ignore_index=IGNORE_INDEX
    )
    torch.testing.assert_close(shifted_loss(logits, labels), want)


@pytest.mark.parametrize("argument", ["inputs", "input_ids"])
def test_generate_refuses_an_empty_batch_by_name(argument):
    model = build("specs/gated_deltanet.yaml", {}, torch.float32)
    ids = tokens(0, T, seed=1)
    with pytest.raises(ValueError, match=rf"{argument}: generate needs at least one row"):
        model.generate(**{argument: ids}, max_new_tokens=2, do_sample=False)


def test_packed_sequences_refuse_an_empty_batch_by_name():
    model = build("specs/gated_deltanet.yaml", {}, torch.float32)
    with pytest.raises(ValueError, match=r"cu_seqlens: expected packed sequences in one row"):
        model(tokens(0, T, seed=1), cu_seqlens=torch.tensor([0, 2, T]))
