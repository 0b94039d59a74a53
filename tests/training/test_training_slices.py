"""`evaluate_model` on a split with slices (miras/training.py): the mean over slices under
each metric's name and every slice's own as f"{metric}_{label}"."""

from __future__ import annotations

from pathlib import Path

import pytest

import miras
from miras.models.model import build_model
from miras.tasks import make_task
from miras.training.evaluation import evaluate_model

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(__file__).resolve().parents[2]
GRID = {
    "vocab_size": 64,
    "seq_len": 32,
    "num_pairs": 4,
    "train_mixture": [[16, 2], [32, 4]],
    "test_grid": [[64, 4], [64, 8], [64, 16]],
}


@pytest.fixture(scope="module")
def model():
    spec = miras.load_spec(ROOT / "specs" / "deltanet.yaml")
    small = spec.model.model_copy(update={"n_layers": 1, "d_model": 16, "n_heads": 1})
    return build_model(spec.model_copy(update={"model": small}), 64)


def test_a_grid_is_scored_per_slice_and_on_average(model):
    task = make_task("mqar", **GRID)
    scores = evaluate_model(model, task, batches=2, batch_size=4, split="test")
    labels = ["n4", "n8", "n16"]
    assert set(scores) == {"loss", "accuracy"} | {
        f"{m}_{n}" for m in ("loss", "accuracy") for n in labels
    }
    for metric in ("loss", "accuracy"):
        mean = sum(scores[f"{metric}_{n}"] for n in labels) / 3
        assert scores[metric] == pytest.approx(mean)
    for label, part in task.slices("test").items():  # each slice: its own batches
        alone = evaluate_model(model, part, batches=2, batch_size=4, split="test")
        assert alone == pytest.approx(
            {"loss": scores[f"loss_{label}"], "accuracy": scores[f"accuracy_{label}"]}
        )


def test_one_slice_keeps_the_plain_names(model):
    task = make_task("mqar", **GRID)
    assert set(evaluate_model(model, task, batches=1, batch_size=4)) == {"loss", "accuracy"}
    plain = make_task("mqar", vocab_size=64, seq_len=32, num_pairs=4)
    test = evaluate_model(model, plain, batches=1, batch_size=4, split="test")
    valid = evaluate_model(model, plain, batches=1, batch_size=4, split="valid")
    assert set(test) == {"loss", "accuracy"} and test != valid  # another stream


def test_training_on_a_mixture_evaluates_valid(model):
    task = make_task("mqar", **GRID)
    spec = model.spec
    result = miras.train(spec, task, steps=4, batch_size=8, progress=False, eval_batches=1)
    assert set(result.metrics) == {"loss", "accuracy"}
