"""State-tracking tasks (miras/tasks/state_tracking.py): the labels against independent
computations (sympy's permutations for the group words, Python integers for the arithmetic),
determinism given the seed, and the test split's longer slices scored past the train length."""

from __future__ import annotations

import itertools

import pytest
import torch
from sympy.combinatorics import Permutation

from miras.tasks import IGNORE, make_task


def test_parity_labels_are_the_xor_of_the_bits_so_far():
    batch = make_task("parity", seq_len=40).batch("train", 0, 16)
    for bits, labels in zip(batch.inputs.tolist(), batch.labels.tolist(), strict=True):
        assert set(bits) <= {0, 1}
        assert labels == [sum(bits[: t + 1]) % 2 for t in range(len(bits))]


@pytest.mark.parametrize("modulus", [2, 5, 7])
def test_modular_arithmetic_evaluates_left_to_right(modulus):
    task = make_task("modular_arithmetic", seq_len=23, modulus=modulus)
    batch = task.batch("valid", 2, 16)
    symbol = {modulus: "+", modulus + 1: "-", modulus + 2: "*"}
    for tokens, labels in zip(batch.inputs.tolist(), batch.labels.tolist(), strict=True):
        value = tokens[0]
        assert labels[0] == value
        for t in range(1, len(tokens)):
            if t % 2:  # an operation: unlabelled
                assert tokens[t] in symbol and labels[t] == IGNORE
                continue
            assert 0 <= tokens[t] < modulus
            op, a = symbol[tokens[t - 1]], tokens[t]
            value = eval(f"({value}) {op} {a}") % modulus  # Python's % is the residue in 0..m-1
            assert labels[t] == value


@pytest.mark.parametrize(("group", "n"), [("S3", 3), ("S5", 5)])
def test_group_word_labels_are_the_running_products(group, n):
    """Element i is the i-th permutation in lexicographic order; the product a b is a after b,
    (a b)[j] = a[b[j]], which is sympy's b * a (sympy applies the left factor first)."""
    elements = sorted(itertools.permutations(range(n)))
    index = {p: i for i, p in enumerate(elements)}
    task = make_task("group_word", group=group, seq_len=30)
    assert task.vocab_size == len(elements) == {3: 6, 5: 120}[n]
    batch = task.batch("train", 1, 8)
    for word, labels in zip(batch.inputs.tolist(), batch.labels.tolist(), strict=True):
        product = Permutation(list(range(n)))
        for g, label in zip(word, labels, strict=True):
            product = Permutation(list(elements[g])) * product
            assert label == index[tuple(product.array_form)]


def test_s3_words_are_not_a_count_of_their_letters():
    """Non-abelian: two words with the same letters in another order differ in product."""
    task = make_task("group_word", group="S3", seq_len=2)
    a, b = 1, 2  # (0 2 1) and (1 0 2): two transpositions, which do not commute
    assert task.table[a, b] != task.table[b, a]


@pytest.mark.parametrize(
    ("name", "options"),
    [("parity", {}), ("modular_arithmetic", {"modulus": 3}), ("group_word", {"group": "S5"})],
)
def test_batches_are_deterministic_given_the_seed(name, options):
    task = make_task(name, seq_len=16, **options)
    for split in ("train", "valid", "test"):
        first, again = task.batch(split, 3, 8), task.batch(split, 3, 8)
        assert torch.equal(first.inputs, again.inputs) and torch.equal(first.labels, again.labels)
        other = make_task(name, seq_len=16, seed=1, **options).batch(split, 3, 8)
        assert not torch.equal(other.inputs, first.inputs)
        assert not torch.equal(task.batch(split, 4, 8).inputs, first.inputs)


@pytest.mark.parametrize("name", ["parity", "modular_arithmetic", "group_word"])
def test_test_slices_are_longer_and_scored_past_the_train_length(name):
    task = make_task(name, seq_len=12)
    assert task.batch("train", 0, 4).inputs.shape == task.batch("valid", 0, 4).inputs.shape
    assert task.batch("valid", 0, 4).inputs.shape[1] == 12
    slices = task.slices("test")
    assert list(slices) == ["t24", "t48"]  # the default: 2 and 4 x seq_len
    assert task.slices("train") == {"": task} and task.slices("valid") == {"": task}
    for label, part in slices.items():
        length = int(label[1:])
        batch = part.batch("test", 0, 4)
        assert batch.inputs.shape == (4, length)
        assert (batch.labels[:, :12] == IGNORE).all()
        assert (batch.labels[:, 12:] != IGNORE).any()
        assert part.slices("test") == {"": part}
    # A slice's test batches are the batches of its length the whole task draws.
    whole = task.batch("test", 1, 4)  # batch 1: the second length
    assert torch.equal(whole.inputs, slices["t48"].batch("test", 1, 4).inputs)


def test_explicit_test_lengths_and_cli_strings():
    task = make_task("parity", seq_len=16, test_lengths="20, 64", seed="2")
    assert task.lengths == (20, 64) and task.seed == 2
    assert list(task.slices("test")) == ["t20", "t64"]
    assert make_task("parity", **task.options()) == task


@pytest.mark.parametrize(
    ("name", "options", "message"),
    [
        ("parity", {"seq_len": 16, "test_lengths": [16]}, r"test_lengths\[0\]: .* exceed seq_len=16, got 16"),
        ("parity", {"test_lengths": [128, 128]}, r"test_lengths\[1\]: 128 is listed twice"),
        ("parity", {"test_lengths": []}, r"option 'test_lengths': expected at least one length"),
        ("group_word", {"group": "S6"}, r"option 'group': expected one of S3, S4, S5, got 'S6'"),
        ("modular_arithmetic", {"modulus": 1}, r"option 'modulus'"),
        ("modular_arithmetic", {"modulo": 5}, r"unknown option 'modulo'.*did you mean 'modulus'"),
        ("parity", {"seq_len": 0}, r"option 'seq_len'"),
    ],
)  # fmt: skip
def test_bad_options_name_the_field_and_the_allowed_values(name, options, message):
    with pytest.raises(ValueError, match=message):
        make_task(name, **options)
