"""Byte-level language modelling on English prose that ships with Python: the help texts of
`pydoc_data.topics.topics` (the text of `help("assert")` and friends, ~465 kB in 3.11).

The corpus is every topic in sorted key order, joined by blank lines, as UTF-8 bytes; the last
`valid_fraction` of it is the validation split, the rest the training split. A batch is random
windows of seq_len + 1 bytes of its split: inputs the first seq_len, labels the last seq_len.
The corpus is the running interpreter's, so it can differ between Python versions;
`corpus_digest()` names the one in use.

`files` (plain text, JSONL, parquet) replace the corpus and `tokenizer` the bytes: a local
transformers tokenizer directory, or "bpe", a byte-level BPE of `bpe_vocab` tokens trained on
the training split (`miras.tasks.text_sources`; the `hf` extra). A training run saves that
tokenizer in its directory (`tokenizer/`).
"""

from __future__ import annotations

import functools
import hashlib
import math
from pathlib import Path
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
DEFAULT_BPE_VOCAB = 4096
DEFAULT_MAX_BYTES = 1 << 28  # of a file source: 256 MiB, read by streaming


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
    """Next-token prediction on pydoc's help texts (or `files`); loss in nats per token
    (per byte for the default byte tokens)."""

    name: ClassVar[str] = "text"
    primary_metric: ClassVar[str] = "perplexity"
    higher_is_better: ClassVar[bool] = False

    seq_len: int = Field(128, ge=1, le=1 << 20, description="T bytes per window")
    valid_fraction: float = Field(0.1, gt=0, lt=0.5, description="the corpus's tail kept apart")
    seed: int = Field(0, ge=0)
    files: list[str] | None = Field(
        None, max_length=4096, description="local .txt/.jsonl/.parquet files (default: pydoc)"
    )
    text_field: str | None = Field(None, description="the text of a JSONL or parquet row")
    tokenizer: str | None = Field(
        None, description="bytes (default), bpe, or a local transformers tokenizer directory"
    )
    bpe_vocab: int | None = Field(None, ge=260, le=1 << 18, description="tokens of the bpe")
    max_bytes: int | None = Field(None, ge=1, description="of the files read (streamed)")

    def source(self):
        """The files' or the tokenizer's corpus (`text_sources.TextSource`), None for the
        default pydoc bytes."""
        if self.files is None and self.tokenizer in (None, "bytes"):
            return None
        from miras.tasks.text_sources import text_source

        return text_source(
            tuple(self.files or ()),
            self.text_field or "text",
            self.tokenizer or "bytes",
            self.bpe_vocab or DEFAULT_BPE_VOCAB,
            self.max_bytes or DEFAULT_MAX_BYTES,
            self.valid_fraction,
            None if self.files else corpus().decode("utf-8"),
        )

    @property
    def vocab_size(self) -> int:
        source = self.source()
        return BYTES if source is None else source.vocab_size

    @model_validator(mode="after")
    def _fits(self) -> Text:
        source = self.source()
        if source is None:
            start, end = split_bounds("valid", self.valid_fraction)
            size, unit = end - start, "bytes"
        else:
            size, unit = min(len(source.train), len(source.valid)), "tokens"
        if self.seq_len + 1 > size:
            raise ValueError(
                f"seq_len={self.seq_len} does not fit the validation split ({size} "
                f"{unit} at valid_fraction={self.valid_fraction})"
            )
        return self

    def save_files(self, directory: str | Path) -> None:
        """A trained or loaded tokenizer, saved to `directory`/tokenizer (a training run's
        directory): transformers' AutoTokenizer.from_pretrained reads it back."""
        source = self.source()
        if source is not None and source.tokenizer is not None:
            source.tokenizer.save_pretrained(Path(directory) / "tokenizer")

    def window_starts(self, split: Split, index: int, batch_size: int) -> np.ndarray:
        """[B] corpus offsets of the batch's windows of seq_len + 1 bytes."""
        check_batch_args(split, index, batch_size)
        if self.source() is None:
            start, end = split_bounds(split, self.valid_fraction)
        else:
            start, end = 0, len(self._tokens(split))  # offsets into the split's own tokens
        rng = self.generator(split, index)
        return start + rng.integers(0, end - start - self.seq_len, size=batch_size)

    def _tokens(self, split: Split) -> np.ndarray:
        source = self.source()
        if source is None:
            return np.frombuffer(corpus(), dtype=np.uint8)
        return source.train if split == "train" else source.valid  # test: valid's text

    def batch(self, split: Split, index: int, batch_size: int) -> Batch:
        starts = self.window_starts(split, index, batch_size)
        data = self._tokens(split)
        windows = data[starts[:, None] + np.arange(self.seq_len + 1)[None, :]]
        return as_batch(windows[:, :-1], windows[:, 1:])

    def metrics(self, logits: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
        """{"loss" (nats/token), "perplexity" (per token), "bits_per_byte", "accuracy"}. With
        byte tokens bits per byte is the loss over ln 2; with a tokenizer, the loss over ln 2
        times the validation split's tokens per byte."""
        check_logits(logits, labels, self.vocab_size)
        loss = masked_loss(logits, labels)
        source = self.source()
        per_byte = 1.0 if source is None else source.tokens_per_byte
        return {
            "loss": loss,
            "perplexity": math.exp(loss) if loss < 700 else math.inf,  # exp overflows past 709
            "bits_per_byte": loss / math.log(2) * per_byte,
            "accuracy": masked_accuracy(logits, labels),
        }
