"""Byte-level language modelling on English prose that ships with Python: the help texts of
`pydoc_data.topics.topics` (the text of `help("assert")` and friends, ~465 kB in 3.11).

The corpus is every topic in sorted key order, joined by blank lines, as UTF-8 bytes; the last
`valid_fraction` of it is the validation split, the rest the training split. A batch is random
windows of seq_len + 1 bytes of its split: inputs the first seq_len, labels the last seq_len.
The corpus is the running interpreter's, so it can differ between Python versions;
`corpus_digest()` names the one in use.
"""

from __future__ import annotations

import functools
import hashlib
import math
from typing import ClassVar

import numpy as np
import torch
from pydantic import Field, model_validator

from miras.tasks.base import (
    Batch,
    Split,
    Task,
    as_batch,
    check_batch_args,
    check_logits,
    masked_accuracy,
    masked_loss,
)

BYTES = 256


@functools.cache
def corpus() -> bytes:
    """The whole corpus, as bytes (cached)."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics)).encode("utf-8")


def corpus_digest() -> str:
    """sha256 of the corpus, first 16 hex digits: which pydoc_data this run used."""
    return hashlib.sha256(corpus()).hexdigest()[:16]


def split_bounds(split: Split, valid_fraction: float) -> tuple[int, int]:
    """[start, end) byte offsets of a split in `corpus()`: train first, valid last."""
    n = len(corpus())
    cut = n - int(n * valid_fraction)
    return (0, cut) if split == "train" else (cut, n)


class Text(Task):
    """Next-byte prediction on pydoc's help texts; loss in nats per byte."""

    name: ClassVar[str] = "text"
    primary_metric: ClassVar[str] = "perplexity"
    higher_is_better: ClassVar[bool] = False

    seq_len: int = Field(128, ge=1, le=1 << 20, description="T bytes per window")
    valid_fraction: float = Field(0.1, gt=0, lt=0.5, description="the corpus's tail kept apart")
    seed: int = Field(0, ge=0)

    @property
    def vocab_size(self) -> int:
        return BYTES

    @model_validator(mode="after")
    def _fits(self) -> Text:
        start, end = split_bounds("valid", self.valid_fraction)
        if self.seq_len + 1 > end - start:
            raise ValueError(
                f"seq_len={self.seq_len} does not fit the validation split ({end - start} "
                f"bytes at valid_fraction={self.valid_fraction})"
            )
        return self

    def window_starts(self, split: Split, index: int, batch_size: int) -> np.ndarray:
        """[B] corpus offsets of the batch's windows of seq_len + 1 bytes."""
        check_batch_args(split, index, batch_size)
        start, end = split_bounds(split, self.valid_fraction)
        rng = self.generator(split, index)
        return start + rng.integers(0, end - start - self.seq_len, size=batch_size)

    def batch(self, split: Split, index: int, batch_size: int) -> Batch:
        starts = self.window_starts(split, index, batch_size)
        data = np.frombuffer(corpus(), dtype=np.uint8)
        windows = data[starts[:, None] + np.arange(self.seq_len + 1)[None, :]]
        return as_batch(windows[:, :-1], windows[:, 1:])

    def metrics(self, logits: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
        """{"loss" (nats/byte), "perplexity", "bits_per_byte", "accuracy"}; a token is a byte,
        so bits per byte is the loss over ln 2."""
        check_logits(logits, labels, self.vocab_size)
        loss = masked_loss(logits, labels)
        return {
            "loss": loss,
            "perplexity": math.exp(loss) if loss < 700 else math.inf,  # exp overflows past 709
            "bits_per_byte": loss / math.log(2),
            "accuracy": masked_accuracy(logits, labels),
        }
