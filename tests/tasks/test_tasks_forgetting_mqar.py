"""Forgetting MQAR (miras/tasks/forgetting_mqar.py): the label is the latest value of its key,
recomputed from the context by a plain loop; re-assignments, streams, errors, a short run."""

from __future__ import annotations

from pathlib import Path

import pytest

import miras
from miras.tasks import IGNORE, SPLITS, make_task

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(__file__).resolve().parents[2]
SMALL = {"vocab_size": 64, "seq_len": 64, "num_pairs": 8, "num_updates": 4}


def latest_values(inputs: list[int], context: int) -> list[int]:
    """The labels a row must have, from its tokens alone: the first `context` tokens are
    `key value` assignments in order, each replacing the key's value; after them, a token
    that is a key is a query, labelled with the most recent value assigned to it."""
    value_of: dict[int, int] = {}
    for t in range(0, context, 2):
        value_of[inputs[t]] = inputs[t + 1]
    return [IGNORE] * context + [value_of.get(tok, IGNORE) for tok in inputs[context:]]


@pytest.mark.parametrize("random_non_queries", [False, True])
def test_every_label_is_the_latest_value_of_its_key(random_non_queries):
    task = make_task("forgetting_mqar", **SMALL, random_non_queries=random_non_queries)
    n, u = 8, 4
    context = 2 * (n + u)
    for split in SPLITS:
        batch = task.batch(split, 2, 32)
        for inputs, labels in zip(batch.inputs.tolist(), batch.labels.tolist(), strict=True):
            assert labels == latest_values(inputs, context)
            keys = inputs[0 : 2 * n : 2]
            first = dict(zip(keys, inputs[1 : 2 * n : 2], strict=True))
            updated = inputs[2 * n : context : 2]
            assert len(set(updated)) == u and set(updated) <= set(keys)  # U distinct keys
            values = inputs[1:context:2]
            assert len(set(values)) == n + u  # a new value is never an old one
            queried = {inputs[t]: labels[t] for t in range(context, 64) if labels[t] != IGNORE}
            assert sorted(queried) == sorted(keys)  # every key once
            changed = {k for k in keys if queried[k] != first[k]}
            assert changed == set(updated)  # exactly the re-assigned keys changed label


def test_a_mixture_keeps_the_updates_in_every_setting():
    task = make_task("forgetting_mqar", **SMALL, train_mixture=[[48, 6], [96, 12]])
    for index, (t, n) in enumerate([(48, 6), (96, 12), (48, 6)]):
        batch = task.batch("train", index, 8)
        assert batch.inputs.shape == (8, t)
        for inputs, labels in zip(batch.inputs.tolist(), batch.labels.tolist(), strict=True):
            assert labels == latest_values(inputs, 2 * (n + 4))


def test_train_valid_and_test_never_share_a_sequence():
    task = make_task("forgetting_mqar", **SMALL)
    seen = {
        split: {tuple(r) for i in range(6) for r in task.batch(split, i, 16).inputs.tolist()}
        for split in SPLITS
    }
    assert not seen["train"] & seen["valid"]
    assert not seen["train"] & seen["test"]
    assert not seen["valid"] & seen["test"]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"num_pairs": 4, "num_updates": 5}, r"num_updates=5 re-assigns distinct keys"),
        (
            {"seq_len": 60, "num_pairs": 12, "num_updates": 8},
            r"needs seq_len >= 4 \* num_pairs \+ 2 \* num_updates = 64, got seq_len=60",
        ),
        (
            {"vocab_size": 32, "seq_len": 128, "num_pairs": 12, "num_updates": 8},
            r"needs 20 distinct values but vocab_size=32 has 16",
        ),
        ({"num_updates": 0}, r"option 'num_updates': expected an integer >= 1, got 0"),
        ({"test_grid": [[64, 2]]}, r"test_grid\[0\]: num_updates=8 re-assigns distinct keys"),
    ],
)
def test_bad_options_are_named(options, message):
    with pytest.raises(ValueError, match=message):
        make_task("forgetting_mqar", **options)


def test_a_short_run_reduces_the_loss():
    task = make_task("forgetting_mqar", vocab_size=32, seq_len=32, num_pairs=4, num_updates=2)
    spec = miras.load_spec(ROOT / "specs" / "deltanet.yaml")
    spec = spec.model_copy(
        update={"model": spec.model.model_copy(update={"n_layers": 1, "d_model": 16, "n_heads": 1})}
    )
    result = miras.train(
        spec, task, steps=20, batch_size=32, lr=1e-2, warmup=2, progress=False, eval_batches=1
    )
    first, last = sum(result.losses[:3]) / 3, sum(result.losses[-3:]) / 3
    assert last < first - 0.2, (first, last)
