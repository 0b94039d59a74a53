"""What every task shares: the batch, the abstract task, seeding and the masked metrics.

A task is a typed options model (pydantic, frozen, unknown options rejected) with a seeded
generator and a metric:

    task = make_task("mqar", num_pairs=32)
    batch = task.batch("train", index=0, batch_size=64)   # inputs, labels [B, T] int64
    task.metrics(logits, batch.labels)                     # logits [B, T, V]
    task.slices("test")                                    # {"n64": sub-task, ...}: scored apart

Labels are already aligned with the logits: the model's prediction at position t is scored
against `labels[:, t]`, and positions that are not scored hold `IGNORE` (-100, the
`ignore_index` of `torch.nn.functional.cross_entropy`).

Three splits, each its own generator stream: train, valid (scored during training) and test
(scored once at the end; by default the distribution of valid). A task whose model does not
read token ids (continuous MQAR) gives the model's input and output layers (`model_io`).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Literal

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict
from torch import nn

IGNORE = -100  # labels of unscored positions (cross_entropy's ignore_index)
Split = Literal["train", "valid", "test"]
SPLITS: dict[str, int] = {"train": 0, "valid": 1, "test": 2}


@dataclass(frozen=True)
class Batch:
    """inputs [B, T] int64 token ids (or [B, T, E] float32 embeddings, for a task with its own
    `model_io`); labels [B, T] int64, IGNORE where not scored."""

    inputs: torch.Tensor
    labels: torch.Tensor


class Task(BaseModel, ABC):
    """A data generator and its metric. Subclasses are pydantic models whose fields are the
    task's options, and provide `vocab_size` and `seq_len` (ints: a field or a property).

    Training (miras.training.recipe, miras.training.checkpoint) reads `name`, `vocab_size`, `seq_len`,
    `primary_metric`, `higher_is_better`, `batch` and `metrics`, and calls the hooks below
    (`slices`, `model_io`, `io_options`, `options`, `save_files`), whose defaults fit a task
    of token ids scored whole; a task of its own (a benchmark's curriculum, a test's task)
    subclasses Task."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: ClassVar[str]
    primary_metric: ClassVar[str]  # "accuracy" | "exact_match" | "perplexity"
    higher_is_better: ClassVar[bool]

    @abstractmethod
    def batch(self, split: Split, index: int, batch_size: int) -> Batch:
        """Batch number `index` of `split`: [B, T] inputs and labels. The same arguments give
        the same batch; train, valid and test draw from different generator streams."""

    def slices(self, split: Split) -> dict[str, Task]:
        """The sub-tasks `split` is scored on, by a short label ("n64"); each is scored on its
        own batches of `split` and the split's score is their mean. One, labelled "", unless
        the task has a grid (MQAR's `test_grid`)."""
        check_split(split)
        return {"": self}

    def model_io(self, d_model: int) -> tuple[nn.Module, nn.Module] | None:
        """The model's input layer (inputs [B, T, ...] -> [B, T, d_model]) and output layer
        ([B, T, d_model] -> logits [B, T, V]) when the task's inputs are not token ids; None:
        the model's token embedding and its tied head."""
        return None

    def io_options(self) -> dict | None:
        """The options `model_io` depends on (a checkpoint records them: its model scores only
        a task with the same); None when the task has no io of its own."""
        return None

    def metrics(self, logits: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
        """logits [B, T, V], labels [B, T] -> {"loss", "accuracy"} over labelled positions."""
        check_logits(logits, labels, self.vocab_size)
        return {"loss": masked_loss(logits, labels), "accuracy": masked_accuracy(logits, labels)}

    def options(self) -> dict:
        """The options, defaults filled in: `make_task(task.name, **task.options())` rebuilds
        an equal task (for checkpoints and study records)."""
        return self.model_dump(mode="json", exclude_none=True)

    def save_files(self, directory: str | Path) -> None:
        """Write the task's own files into a training run's `directory` (the text task's
        tokenizer); none by default."""

    def generator(self, split: Split, index: int) -> np.random.Generator:
        """The generator of batch `index` of `split`, seeded from (seed, split, index) through
        numpy's SeedSequence, so neighbouring seeds and indices give independent streams."""
        return np.random.default_rng(np.random.SeedSequence([self.seed, SPLITS[split], index]))


def check_split(split: str) -> None:
    if split not in SPLITS:
        allowed = ", ".join(repr(s) for s in SPLITS)
        raise ValueError(f"split: expected one of {allowed}, got {split!r}")


def check_batch_args(split: str, index: int, batch_size: int) -> None:
    check_split(split)
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise ValueError(f"index: expected an integer >= 0, got {index!r}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size: expected a positive integer, got {batch_size!r}")


def as_batch(inputs: np.ndarray, labels: np.ndarray) -> Batch:
    """[B, T] integer arrays -> a Batch of int64 tensors."""
    return Batch(
        torch.from_numpy(np.ascontiguousarray(inputs, dtype=np.int64)),
        torch.from_numpy(np.ascontiguousarray(labels, dtype=np.int64)),
    )


# Metrics ------------------------------------------------------------------------------------


def check_logits(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int) -> None:
    if not isinstance(logits, torch.Tensor) or logits.dim() != 3:
        shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise ValueError(f"logits: expected a tensor [B, T, V], got {shape}")
    if not isinstance(labels, torch.Tensor) or labels.shape != logits.shape[:2]:
        shape = tuple(labels.shape) if isinstance(labels, torch.Tensor) else type(labels).__name__
        raise ValueError(f"labels: expected [B, T] = {tuple(logits.shape[:2])}, got {shape}")
    if logits.shape[-1] < vocab_size:
        raise ValueError(
            f"logits: expected at least V = {vocab_size} classes (the task's vocab_size), "
            f"got {logits.shape[-1]}"
        )


def masked_loss(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """Mean cross-entropy (nats) over labelled positions; nan when none is labelled."""
    if not bool((labels != IGNORE).any()):
        return math.nan
    flat = logits.detach().reshape(-1, logits.shape[-1]).float()
    return F.cross_entropy(flat, labels.reshape(-1), ignore_index=IGNORE).item()


def masked_accuracy(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """Fraction of labelled positions whose argmax is the label; nan when none is labelled."""
    mask = labels != IGNORE
    if not bool(mask.any()):
        return math.nan
    return (logits.detach().argmax(-1) == labels)[mask].float().mean().item()


def exact_match(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """Fraction of rows whose every labelled position is predicted right (rows with labels)."""
    mask = labels != IGNORE
    rows = mask.any(-1)
    if not bool(rows.any()):
        return math.nan
    wrong = (logits.detach().argmax(-1) != labels) & mask
    return (~wrong.any(-1))[rows].float().mean().item()
