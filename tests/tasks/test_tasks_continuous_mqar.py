"""Stacked continuous MQAR (miras/tasks/continuous_mqar.py): labels recomputed from the
vectors, the frozen spherical vocabulary, the task's model io through build_model, training,
a checkpoint and `miras.evaluate`."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import miras
from miras.models.model import build_model
from miras.tasks import IGNORE, SPLITS, make_task
from miras.training.evaluation import evaluate_model

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(__file__).resolve().parents[2]
SMALL = {"vocab_size": 16, "embed_dim": 8, "num_pairs": 4}


def tiny_spec(d_model: int = 16):
    spec = miras.load_spec(ROOT / "specs" / "deltanet.yaml")
    model = {"n_layers": 1, "conv_size": 0, "d_model": d_model, "n_heads": 1}
    return spec.model_copy(update={"model": spec.model.model_copy(update=model)})


def index_of(vector: np.ndarray, table: np.ndarray) -> int:
    """The row of `table` equal to `vector` (exactly one)."""
    (found,) = np.nonzero((table == vector).all(axis=1))[0]
    return int(found)


def test_every_label_is_the_value_of_its_key_in_the_context():
    task = make_task("continuous_mqar", vocab_size=64, embed_dim=8, num_pairs=12)
    keys, values = task.embeddings()
    n, d = 12, 8
    for split in SPLITS:
        batch = task.batch(split, 1, 16)
        assert batch.inputs.shape == (16, 24, 16) and batch.inputs.dtype == torch.float32
        for row, labels in zip(batch.inputs.numpy(), batch.labels.tolist(), strict=True):
            value_of = {}
            for t in range(n):  # [key ; value] tokens
                value_of[index_of(row[t, :d], keys)] = index_of(row[t, d:], values)
            assert len(value_of) == n and len(set(value_of.values())) == n  # distinct
            expected = [IGNORE] * n
            for t in range(n, 2 * n):  # [key ; 0] queries
                assert not row[t, d:].any()
                expected.append(value_of[index_of(row[t, :d], keys)])
            assert labels == expected
            assert sorted(expected[n:]) == sorted(value_of.values())  # every key once


def test_the_vocabulary_is_unit_vectors_of_the_seed_shared_by_the_splits():
    task = make_task("continuous_mqar", **SMALL)
    keys, values = task.embeddings()
    assert keys.shape == values.shape == (16, 8)
    assert np.allclose(np.linalg.norm(keys, axis=1), 1) and np.allclose(
        np.linalg.norm(values, axis=1), 1
    )
    again = make_task("continuous_mqar", **SMALL).embeddings()
    assert np.array_equal(again[0], keys) and np.array_equal(again[1], values)
    other = make_task("continuous_mqar", **SMALL, seed=1).embeddings()
    assert not np.array_equal(other[0], keys)
    for split in SPLITS:  # every split's tokens are rows of the same tables
        first = task.batch(split, 0, 4).inputs[:, 0, :8].numpy()
        assert all((keys == vector).all(axis=1).any() for vector in first)


def test_train_valid_and_test_never_share_a_sequence():
    task = make_task("continuous_mqar", vocab_size=64, embed_dim=8, num_pairs=8)
    seen = {
        split: {r.numpy().tobytes() for i in range(6) for r in task.batch(split, i, 16).inputs}
        for split in SPLITS
    }
    assert not seen["train"] & seen["valid"]
    assert not seen["train"] & seen["test"]
    assert not seen["valid"] & seen["test"]


def test_the_model_reads_vectors_and_scores_against_the_frozen_values():
    task = make_task("continuous_mqar", **SMALL)
    model = build_model(tiny_spec(16), task.vocab_size, task.model_io(16))
    assert isinstance(model.embed, torch.nn.Identity)  # d_model = 2 d_e: no projection
    batch = task.batch("train", 0, 3)
    logits = model(batch.inputs)
    assert logits.shape == (3, 8, 16)
    y = model.norm(torch.randn(2, 5, 16))
    values = torch.from_numpy(task.embeddings()[1].copy())
    assert torch.allclose(model.readout(y), model.readout.proj(y) @ values.T)
    # The values are a buffer outside the state dict (the task rebuilds them) and not trained.
    assert not any("values" in name for name in model.state_dict())
    assert all(p.data_ptr() != model.readout.values.data_ptr() for p in model.parameters())
    wide = build_model(tiny_spec(32), task.vocab_size, task.model_io(32))
    assert isinstance(wide.embed, torch.nn.Linear) and wide.embed.weight.shape == (32, 16)
    assert wide(batch.inputs).shape == (3, 8, 16)


def test_a_short_run_reduces_the_loss_and_its_checkpoint_rebuilds_the_io(tmp_path):
    task = make_task("continuous_mqar", **SMALL)
    result = miras.train(
        tiny_spec(16),
        task,
        steps=20,
        batch_size=64,
        lr=3e-2,
        warmup=0,
        progress=False,
        eval_batches=2,
        out_dir=tmp_path,
    )
    first, last = sum(result.losses[:3]) / 3, sum(result.losses[-3:]) / 3
    assert last < first - 0.05, (first, last)
    data = miras.training.load_checkpoint(tmp_path)
    assert data["task"]["io"] == {"vocab_size": 16, "embed_dim": 8, "seed": 0}
    model = build_model(tiny_spec(16), task.vocab_size, task.model_io(16))
    model.load_state_dict(data["model"])
    direct = evaluate_model(model, task, batches=2, batch_size=64, split="test")
    assert miras.evaluate(tmp_path, batches=2, split="test") == pytest.approx(direct)
    assert miras.evaluate(tmp_path, batches=2) == pytest.approx(result.metrics)
    with pytest.raises(ValueError, match=r"trained on the embeddings of .*seed=0.*seed=1"):
        miras.evaluate(tmp_path, make_task("continuous_mqar", **SMALL, seed=1))
    with pytest.raises(ValueError, match=r"task 'mqar' gives token ids"):
        miras.evaluate(tmp_path, make_task("mqar", vocab_size=16, seq_len=16, num_pairs=2))


def test_the_query_marker_adds_one_channel_set_on_the_queries_only():
    plain = make_task("continuous_mqar", **SMALL)
    marked = make_task("continuous_mqar", **SMALL, query_marker=True)
    assert plain.token_dim == 16 and marked.token_dim == 17
    n = SMALL["num_pairs"]
    for split in SPLITS:
        a, b = plain.batch(split, 2, 8), marked.batch(split, 2, 8)
        assert b.inputs.shape == (8, 2 * n, 17)
        # The same rows and labels; the one channel more is 0 on the pairs, 1 on the queries.
        assert torch.equal(b.inputs[..., :16], a.inputs) and torch.equal(b.labels, a.labels)
        assert not b.inputs[:, :n, 16].any() and (b.inputs[:, n:, 16] == 1).all()
    # The input layer reads the wider token; the checkpoint's io says so, and only then.
    model = build_model(tiny_spec(16), marked.vocab_size, marked.model_io(16))
    assert isinstance(model.embed, torch.nn.Linear) and model.embed.weight.shape == (16, 17)
    assert model(marked.batch("train", 0, 3).inputs).shape == (3, 2 * n, 16)
    assert marked.io_options() == {**plain.io_options(), "query_marker": True}
    assert "query_marker" not in plain.io_options()


def test_a_checkpoint_with_the_marker_refuses_the_task_without_it(tmp_path):
    marked = make_task("continuous_mqar", **SMALL, query_marker=True)
    miras.train(
        tiny_spec(16), marked, steps=2, batch_size=4, warmup=0, progress=False,
        eval_batches=1, out_dir=tmp_path,
    )  # fmt: skip
    assert miras.evaluate(tmp_path, batches=1)["accuracy"] >= 0
    with pytest.raises(ValueError, match=r"query_marker=True"):
        miras.evaluate(tmp_path, make_task("continuous_mqar", **SMALL))


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"vocab_size": 8, "num_pairs": 9}, r"num_pairs=9 needs 9 distinct keys"),
        ({"embed_dim": 0}, r"option 'embed_dim': expected an integer >= 1, got 0"),
        ({"vocab_size": 1 << 20}, r"option 'vocab_size': expected an integer <= 65536"),
        ({"query_marker": "maybe"}, r"option 'query_marker': expected true or false, got 'maybe'"),
    ],
)
def test_bad_options_are_named(options, message):
    with pytest.raises(ValueError, match=message):
        make_task("continuous_mqar", **options)


def test_a_study_on_the_task_validates_its_objectives():
    # The study reads the task's metric names off zero logits [B, T, V]: shaped by the labels,
    # since the inputs are [B, T, 2 d_e] vectors.
    from miras.search.study import load_study

    study = {
        "name": "tiny-continuous",
        "task": {"name": "continuous_mqar", "options": SMALL},
        "spec": {"memory": "matrix", "bias": "l2", "model": {"d_model": 16, "conv_size": 0}},
        "train": {"steps": 2, "batch_size": 4},
        "objectives": ["accuracy"],
    }
    assert load_study(study).task.name == "continuous_mqar"
