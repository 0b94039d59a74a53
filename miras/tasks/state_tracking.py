"""State tracking: the running state of a word, labelled at every position (docs/tasks.md).

    parity              1 0 1 1 0 ...    labels: 1 1 0 1 1 ...    (XOR of the bits so far)
    modular_arithmetic  3 + 4 * 2 - 1    labels: 3 . 2 . 4 . 3    (mod 5, left to right)
    group_word          g1 g2 g3 ...     labels: g1, g1 g2, g1 g2 g3, ...   (S3, S4, S5)

A word problem asks for the product of a sequence of group (or monoid) elements; labelling every
prefix makes it the running state of a finite automaton. A linear RNN whose transitions have
eigenvalues in [0, 1] only cannot count modulo 2 at any length (Grazzi et al. 2025, "Unlocking
State-Tracking in Linear RNNs Through Negative Eigenvalues"); a product of 2 or more Householder
steps per token with eigenvalues down to -1 can track S3 (Siems et al. 2025, DeltaProduct).

Train and valid draw words of `seq_len` tokens, scored at every labelled position. The test
split is length extrapolation: words of each of `test_lengths` (default 2 and 4 x seq_len, each
longer than seq_len), each its own slice ("t64"), scored only at the positions t >= seq_len,
which the model never saw in training.
"""

from __future__ import annotations

import functools
import itertools
from abc import abstractmethod
from typing import Annotated, Any, ClassVar, Literal

import numpy as np
from pydantic import BeforeValidator, Field, model_validator

from miras.tasks.base import (
    IGNORE,
    SPLITS,
    Batch,
    Split,
    Task,
    as_batch,
    check_batch_args,
    check_split,
)

MAX_SEQ_LEN = 1 << 16
MAX_TEST_LENGTHS = 16


def _lengths(value: Any) -> Any:
    """Accept "64,128" (as a command line gives it) as well as a list; not empty."""
    if isinstance(value, str):
        value = tuple(part.strip() for part in value.split(",") if part.strip())
    if isinstance(value, (list, tuple)) and not value:
        raise ValueError("expected at least one length")
    return value


Lengths = Annotated[
    tuple[Annotated[int, Field(ge=2, le=MAX_SEQ_LEN)], ...],
    BeforeValidator(_lengths),
    Field(max_length=MAX_TEST_LENGTHS),
]


class StateTracking(Task):
    """A word problem labelled at every prefix; metrics {"loss", "accuracy"} over the labelled
    positions (in the test split, those past `seq_len`). A subclass gives `vocab_size` and
    `draw`."""

    primary_metric: ClassVar[str] = "accuracy"
    higher_is_better: ClassVar[bool] = True

    seq_len: int = Field(32, ge=1, le=MAX_SEQ_LEN, description="T of the train and valid words")
    test_lengths: Lengths | None = Field(
        None,
        description="lengths of the test words, each longer than seq_len and scored as its own "
        "slice past seq_len; default (2 seq_len, 4 seq_len)",
    )
    seed: int = Field(0, ge=0)

    @model_validator(mode="after")
    def _longer(self) -> StateTracking:
        problems = []
        lengths = self.test_lengths or ()
        for i, length in enumerate(lengths):
            if length <= self.seq_len:
                problems.append(
                    f"test_lengths[{i}]: the test split scores length extrapolation, so each "
                    f"length must exceed seq_len={self.seq_len}, got {length}"
                )
            if length in lengths[:i]:
                problems.append(f"test_lengths[{i}]: {length} is listed twice")
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @property
    def lengths(self) -> tuple[int, ...]:
        """The test words' lengths: `test_lengths`, or 2 and 4 x seq_len."""
        if self.test_lengths is not None:
            return self.test_lengths
        return (2 * self.seq_len, 4 * self.seq_len)

    def slices(self, split: Split) -> dict[str, Task]:
        """Test: one sub-task per test length, labelled "t64" (itself with one length). Train
        and valid: the task itself."""
        check_split(split)
        if split != "test" or len(self.lengths) == 1:
            return {"": self}
        return {
            f"t{n}": type(self)(**{**self.options(), "test_lengths": [n]}) for n in self.lengths
        }

    def batch(self, split: Split, index: int, batch_size: int) -> Batch:
        check_batch_args(split, index, batch_size)
        if split != "test":
            inputs, labels = self.draw(self.generator(split, index), batch_size, self.seq_len)
            return as_batch(inputs, labels)
        # Test batch i has length lengths[i mod K], from a stream of its own length, so that a
        # slice's batches are the batches of that length the whole task draws.
        length = self.lengths[index % len(self.lengths)]
        entropy = [self.seed, SPLITS[split], index, length]
        inputs, labels = self.draw(np.random.default_rng(np.random.SeedSequence(entropy)),
                                   batch_size, length)  # fmt: skip
        labels[:, : self.seq_len] = IGNORE  # only the positions past the train length count
        return as_batch(inputs, labels)

    @abstractmethod
    def draw(self, rng: np.random.Generator, b: int, t: int) -> tuple[np.ndarray, np.ndarray]:
        """inputs, labels [B, T] int64 of B random words of T tokens (IGNORE where unlabelled)."""


def running_products(table: np.ndarray, words: np.ndarray) -> np.ndarray:
    """[B, T] element indices -> [B, T] indices of the prefix products x_1 x_2 ... x_t, with
    table[a, b] the index of the product a b; one pass over T, vectorized over B."""
    out = np.empty_like(words)
    state = words[:, 0]
    out[:, 0] = state
    for t in range(1, words.shape[1]):
        state = table[state, words[:, t]]
        out[:, t] = state
    return out


class Parity(StateTracking):
    """Bits 0/1; the label at t is the parity (XOR) of bits 0..t: the word problem of Z2, whose
    generator 1 is the eigenvalue -1 a diagonal linear RNN lacks."""

    name: ClassVar[str] = "parity"

    @property
    def vocab_size(self) -> int:
        return 2

    def draw(self, rng: np.random.Generator, b: int, t: int) -> tuple[np.ndarray, np.ndarray]:
        bits = rng.integers(0, 2, size=(b, t), dtype=np.int64)
        return bits, np.cumsum(bits, axis=1) % 2


OPERATIONS = ("+", "-", "*")


class ModularArithmetic(StateTracking):
    """Numbers 0..m-1 and operations + - *, alternating (a0 op1 a1 op2 a2 ...), evaluated left to
    right modulo m: the label at number a_i is ((a0 op1 a1) op2 a2 ...) op_i a_i mod m, and the
    operations are unlabelled. Tokens: the numbers 0..m-1, then +, -, * as m, m+1, m+2. (Left to
    right, without precedence: the running state is one number, a monoid word problem; not
    checked against Deletang et al. 2023's task of the same name.)"""

    name: ClassVar[str] = "modular_arithmetic"

    modulus: int = Field(5, ge=2, le=1024, description="m: numbers and results are 0..m-1")

    @property
    def vocab_size(self) -> int:
        return self.modulus + len(OPERATIONS)

    def draw(self, rng: np.random.Generator, b: int, t: int) -> tuple[np.ndarray, np.ndarray]:
        m = self.modulus
        numbers = rng.integers(0, m, size=(b, (t + 1) // 2), dtype=np.int64)  # at 0, 2, 4, ...
        ops = rng.integers(0, len(OPERATIONS), size=(b, t // 2), dtype=np.int64)  # 1, 3, ...
        inputs = np.empty((b, t), dtype=np.int64)
        inputs[:, 0::2] = numbers
        inputs[:, 1::2] = m + ops
        labels = np.full((b, t), IGNORE, dtype=np.int64)
        value = numbers[:, 0]
        labels[:, 0] = value
        for i in range(1, numbers.shape[1]):
            a, op = numbers[:, i], ops[:, i - 1]
            value = np.select([op == 0, op == 1], [value + a, value - a], value * a) % m
            labels[:, 2 * i] = value
        return inputs, labels


GROUPS = {"S3": 3, "S4": 4, "S5": 5}


@functools.cache
def symmetric_group(n: int) -> tuple[tuple[tuple[int, ...], ...], np.ndarray]:
    """S_n's elements (the permutations of 0..n-1 in lexicographic order, a tuple p mapping j
    to p[j]) and its table [G, G] int64: table[a, b] is the index of a b, (a b)[j] = a[b[j]]."""
    elements = tuple(itertools.permutations(range(n)))
    index = {p: i for i, p in enumerate(elements)}
    table = np.array(
        [[index[tuple(a[j] for j in b)] for b in elements] for a in elements], dtype=np.int64
    )
    table.setflags(write=False)  # shared by every task of this group
    return elements, table


class GroupWord(StateTracking):
    """Elements of the symmetric group S_n (n = 3, 4, 5; 6, 24, 120 tokens); the label at t is
    the index of the product g_1 g_2 ... g_t. Element i is the i-th permutation of 0..n-1 in
    lexicographic order (0 the identity), a tuple p mapping j to p[j], and the product is
    composition: (a b)[j] = a[b[j]]. S3 is the smallest non-abelian group, S5 the smallest
    non-solvable one (no constant-depth circuit of AND/OR/MOD gates solves its word problem
    unless TC0 = NC1; Barrington 1989)."""

    name: ClassVar[str] = "group_word"

    group: Literal["S3", "S4", "S5"] = Field("S3", description="the symmetric group S_n")

    @property
    def elements(self) -> tuple[tuple[int, ...], ...]:
        """The permutations of 0..n-1 in lexicographic order; element 0 is the identity."""
        return symmetric_group(GROUPS[self.group])[0]

    @property
    def table(self) -> np.ndarray:
        """[G, G] int64: table[a, b] is the index of a b, (a b)[j] = a[b[j]]."""
        return symmetric_group(GROUPS[self.group])[1]

    @property
    def vocab_size(self) -> int:
        return len(self.elements)

    def draw(self, rng: np.random.Generator, b: int, t: int) -> tuple[np.ndarray, np.ndarray]:
        words = rng.integers(0, self.vocab_size, size=(b, t), dtype=np.int64)
        return words, running_products(self.table, words)
