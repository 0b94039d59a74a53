"""The language model's edges (miras/models/model.py): generating zero tokens, a bad count, an
empty input; and `miras.load_model(run_dir)` giving back a trained model (miras/checkpoint.py)."""

from __future__ import annotations

import pytest
import torch

import miras
from miras.models.model import build_model
from miras.tasks import make_task
from miras.training.evaluation import evaluate_model

pytestmark = pytest.mark.usefixtures("one_thread")

SPEC = {
    "name": "tiny-gdn",
    "retention": {"kind": "l2", "grad_at": "retained"},
    "model": {"d_model": 32, "n_heads": 2, "n_layers": 2, "chunk_size": 8},
}


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return build_model(SPEC, 16)


def test_zero_steps_generate_nothing(model):
    prompts = torch.randint(0, 16, (3, 5))
    out = model.generate(prompts, 0)
    assert out.shape == (3, 0) and out.dtype == prompts.dtype
    assert model.generate(prompts, 2).shape == (3, 2)


@pytest.mark.parametrize("steps", [-3, -1, 1.5, True, "2"])
def test_a_bad_step_count_is_refused(model, steps):
    with pytest.raises(ValueError, match=r"steps: expected an integer >= 0"):
        model.generate(torch.randint(0, 16, (2, 4)), steps)


def test_an_empty_input_gets_a_clear_error(model):
    empty = torch.zeros(2, 0, dtype=torch.long)
    with pytest.raises(ValueError, match=r"tokens: expected at least one token \(T >= 1\)"):
        model(empty)
    with pytest.raises(ValueError, match=r"tokens: expected at least one token \(T >= 1\)"):
        model.decode(empty, model.empty_cache(2))


def test_load_model_gives_back_the_trained_model(tmp_path):
    task = make_task("mqar", seq_len=32, num_pairs=4, vocab_size=32)
    result = miras.train(
        SPEC, task, steps=4, batch_size=8, eval_batches=2, progress=False, out_dir=tmp_path
    )
    loaded = miras.load_model(tmp_path)
    assert not loaded.training
    again = evaluate_model(loaded, task, batches=2, batch_size=8)
    assert again == pytest.approx({k: result.metrics[k] for k in again}, rel=1e-6)
    # The checkpoint file itself works too, and a missing run says so.
    same = miras.load_model(tmp_path / "checkpoint.pt")
    for a, b in zip(same.state_dict().values(), loaded.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    with pytest.raises(FileNotFoundError, match="no such file"):
        miras.load_model(tmp_path / "missing")
