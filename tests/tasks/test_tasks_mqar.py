"""MQAR's generator (miras/tasks/mqar.py): labels recomputed from the context by a plain loop,
random fillers, the train mixture, the test grid and its slices, disjoint split streams."""

from __future__ import annotations

import pytest
import torch

from miras.tasks import IGNORE, SPLITS, make_task

pytestmark = pytest.mark.usefixtures("one_thread")

GRID = {
    "vocab_size": 64,
    "seq_len": 32,
    "num_pairs": 4,
    "train_mixture": [[16, 2], [32, 4], [64, 8]],
    "test_grid": [[128, 8], [128, 16], [128, 24]],
}


def recomputed(inputs: list[int], context: int) -> list[int]:
    """The labels a row must have, from its tokens alone: the first `context` tokens are
    `key value` pairs (a later pair of a key replaces its value); after them, a token that is
    a key is a query, labelled with the key's value; nothing else is scored."""
    value_of: dict[int, int] = {}
    for t in range(0, context, 2):
        value_of[inputs[t]] = inputs[t + 1]
    labels = [IGNORE] * context
    for token in inputs[context:]:
        labels.append(value_of.get(token, IGNORE))
    return labels


def check_rows(batch, num_pairs: int, context: int, zeros: bool) -> None:
    for inputs, labels in zip(batch.inputs.tolist(), batch.labels.tolist(), strict=True):
        assert labels == recomputed(inputs, context)
        keys = inputs[0 : 2 * num_pairs : 2]
        queried = [inputs[t] for t in range(len(inputs)) if labels[t] != IGNORE]
        assert sorted(queried) == sorted(keys)  # every key once
        if zeros:
            fillers = [inputs[t] for t in range(context, len(inputs)) if labels[t] == IGNORE]
            assert set(fillers) == {0}


@pytest.mark.parametrize("random_non_queries", [False, True])
def test_every_label_is_the_value_of_its_key_in_the_context(random_non_queries):
    task = make_task(
        "mqar", vocab_size=64, seq_len=96, num_pairs=12, random_non_queries=random_non_queries
    )
    for split in SPLITS:
        batch = task.batch(split, 1, 32)
        check_rows(batch, 12, 24, zeros=not random_non_queries)


def test_random_fillers_are_spread_and_never_a_key_of_the_row():
    # Zoology draws fillers from all V tokens, so one can repeat a key (unscored); here they
    # come from the V - N tokens that are not the row's keys, so the plain loop above, which
    # takes every later key token for a query, recomputes the labels exactly.
    task = make_task("mqar", vocab_size=64, seq_len=128, num_pairs=16, random_non_queries=True)
    batch = task.batch("train", 0, 64)
    check_rows(batch, 16, 32, zeros=False)
    after = batch.inputs[:, 32:][batch.labels[:, 32:] == IGNORE]
    assert len(set(after.tolist())) > 40  # of the 48 tokens a row allows
    plain = make_task("mqar", vocab_size=64, seq_len=128, num_pairs=16).batch("train", 0, 64)
    # The fillers are drawn after everything else: the keys, values and queries are the same.
    assert torch.equal(plain.labels, batch.labels)
    assert torch.equal(plain.inputs[:, :32], batch.inputs[:, :32])


def test_a_mixture_draws_every_setting_in_turn_reproducibly():
    task = make_task("mqar", **GRID)
    settings = [(16, 2), (32, 4), (64, 8)]
    for index in range(6):
        batch = task.batch("train", index, 8)
        t, n = settings[index % 3]
        assert batch.inputs.shape == (8, t)
        assert ((batch.labels != IGNORE).sum(1) == n).all()
        check_rows(batch, n, 2 * n, zeros=True)
        again = task.batch("train", index, 8)
        assert torch.equal(again.inputs, batch.inputs)
    assert task.settings("valid") == [(32, 4)]  # valid: (seq_len, num_pairs)
    assert task.settings("test") == [(128, 8), (128, 16), (128, 24)]


def test_test_slices_have_the_requested_pairs_and_are_the_grid_batches():
    task = make_task("mqar", **GRID)
    slices = task.slices("test")
    assert list(slices) == ["n8", "n16", "n24"]
    for k, (label, part) in enumerate(slices.items()):
        n = int(label[1:])
        assert part.slices("test") == {"": part}
        for index in range(3):
            batch = part.batch("test", index, 4)
            assert batch.inputs.shape == (4, 128)
            assert ((batch.labels != IGNORE).sum(1) == n).all()
            check_rows(batch, n, 2 * n, zeros=True)
            if index % 3 == k:  # the whole task's batch `index` is this setting's
                whole = task.batch("test", index, 4)
                assert torch.equal(whole.inputs, batch.inputs)
    assert task.slices("valid") == {"": task}
    # Settings of several T are labelled by both.
    assert list(task.slices("train")) == ["t16_n2", "t32_n4", "t64_n8"]


def test_slices_are_independent_draws():
    part = make_task("mqar", **GRID).slices("test")
    small = part["n8"].batch("test", 0, 16).inputs[:, 0:16:2]
    large = part["n16"].batch("test", 0, 16).inputs[:, 0:16:2]  # its first 8 keys
    assert not torch.equal(small, large)


@pytest.mark.parametrize("options", [{}, GRID], ids=["plain", "grid"])
def test_train_valid_and_test_never_share_a_sequence(options):
    task = make_task("mqar", **options)
    seen: dict[str, set] = {}
    for split in SPLITS:
        rows = set()
        for index in range(6):
            rows |= {tuple(r) for r in task.batch(split, index, 16).inputs.tolist()}
        seen[split] = rows
    assert not seen["train"] & seen["valid"]
    assert not seen["train"] & seen["test"]
    assert not seen["valid"] & seen["test"]


def test_options_rebuild_the_grid_task():
    task = make_task("mqar", **GRID, random_non_queries=True)
    assert make_task("mqar", **task.options()) == task
    given = {"seq_len": 32, "num_pairs": 4}
    assert make_task("mqar", train_mixture=[given]) == make_task("mqar", train_mixture=[[32, 4]])


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"test_grid": [[64, 32]]},
            r"test_grid\[0\]: num_pairs=32 needs seq_len >= 4 \* num_pairs = 128, got seq_len=64",
        ),
        (
            {"vocab_size": 32, "train_mixture": [[16, 2], [128, 20]]},
            r"train_mixture\[1\]: num_pairs=20 needs 20 distinct keys but vocab_size=32",
        ),
        ({"test_grid": [[64, 4], [64, 4]]}, r"test_grid\[1\]: .* is listed twice"),
        ({"test_grid": [[64]]}, r"option 'test_grid\[0\]': expected \[seq_len, num_pairs\]"),
        ({"test_grid": []}, r"option 'test_grid': expected at least one"),
        ({"train_mixture": [{"seq_len": 64}]}, r"option 'train_mixture\[0\]\.num_pairs'"),
    ],
)
def test_bad_settings_are_named(options, message):
    with pytest.raises(ValueError, match=message):
        make_task("mqar", **options)


def test_a_bad_split_is_named():
    with pytest.raises(ValueError, match=r"split: expected one of 'train', 'valid', 'test'"):
        make_task("mqar").slices("tset")
