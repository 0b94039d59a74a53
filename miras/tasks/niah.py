"""Single needle in a haystack (S-NIAH), byte-level, over a grid of lengths x depths.

One row of a batch, L bytes long:

    haystack[:at] + needle + haystack[at:] + question + answer      (answer teacher-forced)

`at` is `depth` x the haystack's length, moved back to the start of a word (at most MAX_SNAP
bytes). The labels are the
answer's bytes (the model predicts byte t + 1 at position t), IGNORE elsewhere; the metric is
exact match of the whole answer, as in RULER's S-NIAH (Hsieh et al. 2024).

Needle kinds:
- passkey: the pass-key retrieval of Mohtashami & Jaggi (2023, "Landmark Attention"): a
  5-digit key in a haystack of one repeated filler paragraph.
- number (7 digits), word (from the corpus's vocabulary), uuid: RULER's S-NIAH value types,
  in a haystack of natural prose (the `text` corpus, from the batch's own split).

A batch is one cell of the grid: batch `index` uses cell `index % len(cells())`, so batches
0 .. len(cells()) - 1 of a split cover the grid once. Batches of different cells have
different lengths T; `seq_len` is the longest.
"""

from __future__ import annotations

import functools
import re
import uuid
from typing import Annotated, Any, ClassVar, Literal

import numpy as np
import torch
from pydantic import BeforeValidator, Field, model_validator

from miras.tasks.base import (
    IGNORE,
    Batch,
    Split,
    Task,
    as_batch,
    check_batch_args,
    check_logits,
    exact_match,
    masked_accuracy,
    masked_loss,
)
from miras.tasks.text import BYTES, corpus, split_bounds

FILLER = (
    b"The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
)
VALID_FRACTION = 0.1  # the text task's default split

# kind -> (needle, question); the answer follows the question.
TEMPLATES: dict[str, tuple[str, str]] = {
    "passkey": (
        "The pass key is {}. Remember it. {} is the pass key. ",
        "\nWhat is the pass key? The pass key is ",
    ),
    "number": (
        "The special magic number is {}. ",
        "\nWhat is the special magic number? The special magic number is ",
    ),
    "word": (
        "The special magic word is {}. ",
        "\nWhat is the special magic word? The special magic word is ",
    ),
    "uuid": (
        "The special magic uuid is {}. ",
        "\nWhat is the special magic uuid? The special magic uuid is ",
    ),
}
LONGEST_VALUE = {"passkey": 5, "number": 7, "word": 10, "uuid": 36}
MIN_HAYSTACK = 16
MAX_SNAP = 32  # bytes the needle may move back to start at a word


@functools.cache
def words() -> tuple[str, ...]:
    """The word needles: lowercase words of 6 to 10 letters in the corpus, sorted."""
    return tuple(sorted({w.decode() for w in re.findall(rb"\b[a-z]{6,10}\b", corpus())}))


def _tuple(value: Any) -> Any:
    """Accept "256,512" (as a command line gives it) as well as a list; not empty."""
    if isinstance(value, str):
        value = tuple(part.strip() for part in value.split(",") if part.strip())
    if isinstance(value, (list, tuple)) and not value:
        raise ValueError("expected at least one value")
    return value


Lengths = Annotated[tuple[Annotated[int, Field(ge=1, le=1 << 20)], ...], BeforeValidator(_tuple)]
Depths = Annotated[tuple[Annotated[float, Field(ge=0, le=1)], ...], BeforeValidator(_tuple)]


class NIAH(Task):
    """Single-needle retrieval; exact match of the needle's value."""

    name: ClassVar[str] = "niah"
    primary_metric: ClassVar[str] = "exact_match"
    higher_is_better: ClassVar[bool] = True

    kind: Literal["passkey", "number", "word", "uuid"] = "passkey"
    lengths: Lengths = Field((256, 512), description="row lengths T, in bytes")
    depths: Depths = Field((0.0, 0.25, 0.5, 0.75, 1.0), description="needle depths in [0, 1]")
    seed: int = Field(0, ge=0)

    @property
    def vocab_size(self) -> int:
        return BYTES

    @property
    def seq_len(self) -> int:
        return max(self.lengths)

    def min_length(self) -> int:
        """The shortest row: the longest needle, question and answer, and MIN_HAYSTACK bytes."""
        needle, question = TEMPLATES[self.kind]
        value = "x" * LONGEST_VALUE[self.kind]
        return len(needle.format(value, value)) + len(question) + len(value) - 1 + MIN_HAYSTACK

    @model_validator(mode="after")
    def _fits(self) -> NIAH:
        if min(self.lengths) < self.min_length():
            raise ValueError(
                f"lengths: a '{self.kind}' needle with its question and answer needs every "
                f"length >= {self.min_length()}, got {min(self.lengths)}"
            )
        if self.kind != "passkey":
            start, end = split_bounds("valid", VALID_FRACTION)
            if max(self.lengths) > end - start:
                raise ValueError(
                    f"lengths: a prose haystack is cut from the validation split of "
                    f"{end - start} bytes; got a length of {max(self.lengths)}"
                )
        return self

    def cells(self) -> list[tuple[int, float]]:
        """The grid, lengths-major: [(length, depth), ...]."""
        return [(length, depth) for length in self.lengths for depth in self.depths]

    def batch(self, split: Split, index: int, batch_size: int) -> Batch:
        check_batch_args(split, index, batch_size)
        cells = self.cells()
        length, depth = cells[index % len(cells)]
        return self.cell_batch(split, length, depth, index, batch_size)

    def cell_batch(
        self, split: Split, length: int, depth: float, index: int, batch_size: int
    ) -> Batch:
        """A batch [B, length] of one grid cell (any length and depth the options allow)."""
        check_batch_args(split, index, batch_size)
        if not self.min_length() <= length <= self.seq_len or not 0 <= depth <= 1:
            raise ValueError(
                f"length, depth: expected {self.min_length()} <= length <= {self.seq_len} and "
                f"0 <= depth <= 1, got {length}, {depth}"
            )
        rng = self.generator(split, index)
        rows = [self._row(rng, split, length, depth) for _ in range(batch_size)]
        data = np.frombuffer(b"".join(r for r, _ in rows), dtype=np.uint8)
        data = data.reshape(batch_size, length + 1)
        inputs, following = data[:, :-1], data[:, 1:].astype(np.int64)
        labels = np.full((batch_size, length), IGNORE, dtype=np.int64)
        for i, (_, answer) in enumerate(rows):  # position t predicts byte t + 1
            labels[i, length - answer :] = following[i, length - answer :]
        return as_batch(inputs, labels)

    def _value(self, rng: np.random.Generator) -> str:
        if self.kind == "passkey":
            return str(rng.integers(10_000, 100_000))
        if self.kind == "number":
            return str(rng.integers(1_000_000, 10_000_000))
        if self.kind == "word":
            return str(rng.choice(words()))
        return str(uuid.UUID(bytes=rng.bytes(16), version=4))

    def _row(
        self, rng: np.random.Generator, split: Split, length: int, depth: float
    ) -> tuple[bytes, int]:
        """length + 1 bytes (haystack with the needle at `depth`, question, answer) and the
        answer's length."""
        value = self._value(rng)
        needle, question = TEMPLATES[self.kind]
        needle_b, question_b = needle.format(value, value).encode(), question.encode()
        size = length + 1 - len(needle_b) - len(question_b) - len(value)
        haystack = self._haystack(rng, split, size)
        at = target = round(depth * size)
        while at > 0 and target - at < MAX_SNAP and haystack[at - 1 : at] not in (b" ", b"\n"):
            at -= 1  # back to the start of the word
        if at > 0 and haystack[at - 1 : at] not in (b" ", b"\n"):
            at = target  # no word start near (a rule of asterisks): keep the exact depth
        row = haystack[:at] + needle_b + haystack[at:] + question_b + value.encode()
        return row, len(value)

    def _haystack(self, rng: np.random.Generator, split: Split, size: int) -> bytes:
        if self.kind == "passkey":
            return (FILLER * (size // len(FILLER) + 1))[:size]
        start, end = split_bounds(split, VALID_FRACTION)
        at = start + int(rng.integers(0, end - start - size + 1))
        return corpus()[at : at + size]

    def metrics(self, logits: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
        """{"exact_match" (whole answer right), "accuracy" (per byte), "loss"}."""
        check_logits(logits, labels, self.vocab_size)
        return {
            "loss": masked_loss(logits, labels),
            "exact_match": exact_match(logits, labels),
            "accuracy": masked_accuracy(logits, labels),
        }
