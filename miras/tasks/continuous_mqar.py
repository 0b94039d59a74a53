"""Stacked continuous MQAR: every token is [key embedding ; value embedding], frozen vectors.

One sequence of T = 2N tokens, each a vector of 2 d_e:

    [K k1 ; V v1] [K k2 ; V v2] ... [K kN ; V vN] | [K k7 ; 0] [K k2 ; 0] ... [K k5 ; 0]
    labels:  .          .                .        |     v7          v2     ...     v5

K [V, d_e] and V [V, d_e] are the key and value vocabularies: unit-norm random vectors drawn
from the task's seed alone, so train, valid and test share them (they are the vocabulary; the
sequences differ by split). A row stores N pairs of distinct keys and distinct values in its
first N tokens, then queries every key once, in random order, with a zero value half. The label
of a query is the index of its key's value. The model reads the vectors through a linear input
layer and scores its output y against every value embedding, logits = y V^T (`model_io`):
cross-entropy over the V values, with no token embedding and no shift to lean on. One layer
with no short convolution (`conv_size: 0`) isolates the memory rule.

With `query_marker` each token has one more channel, 0 on the stored pairs and 1 on the
queries, [K k ; V v ; 0] and [K k ; 0 ; 1]. Without it a query differs from a stored pair only
by its zero value half: what that half adds to a gate linear in the token, w . V v, averages to
zero over the values, so such a gate has no term that is larger on the pairs than on the
queries. A delta rule writes at every token, and a query's write replaces the pair it asks for
by the query's own value (fully at step 1); the marker gives a learned step size a channel to
switch that write off. The rows and labels are the same with and without it.
"""

from __future__ import annotations

import functools
from typing import ClassVar

import numpy as np
import torch
from pydantic import Field, model_validator
from torch import nn

from miras.tasks.base import IGNORE, Batch, Split, Task, check_batch_args
from miras.tasks.mqar import _distinct

EMBEDDING_STREAM = 7  # SeedSequence([seed, 7]): apart from every batch's [seed, split, index]


@functools.lru_cache(maxsize=8)
def embeddings(vocab_size: int, embed_dim: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """The key and value vocabularies, [V, d_e] float32 each, rows of unit norm."""
    rng = np.random.default_rng(np.random.SeedSequence([seed, EMBEDDING_STREAM]))
    both = rng.standard_normal((2, vocab_size, embed_dim))
    both /= np.linalg.norm(both, axis=-1, keepdims=True)
    both = both.astype(np.float32)
    both.setflags(write=False)
    return both[0], both[1]


class ValueReadout(nn.Module):
    """logits = P(y) V^T: y [B, T, D] -> [B, T, V], against the frozen value embeddings
    V [V, d_e]; P is a learned projection D -> d_e (none when D = d_e)."""

    def __init__(self, values: torch.Tensor, d_model: int):
        super().__init__()
        d_e = values.shape[1]
        self.proj = nn.Linear(d_model, d_e, bias=False) if d_model != d_e else nn.Identity()
        # Not in the state dict: the task rebuilds the vocabulary from its seed.
        self.register_buffer("values", values, persistent=False)

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        return self.proj(y) @ self.values.T


class ContinuousMQAR(Task):
    """Stacked continuous MQAR; metrics {"loss", "accuracy"} over the N query positions, the
    classes being the V value embeddings."""

    name: ClassVar[str] = "continuous_mqar"
    primary_metric: ClassVar[str] = "accuracy"
    higher_is_better: ClassVar[bool] = True

    vocab_size: int = Field(
        256, ge=2, le=1 << 16, description="V keys and V values (embeddings); the classes"
    )
    embed_dim: int = Field(32, ge=1, le=4096, description="d_e of each embedding; tokens 2 d_e")
    num_pairs: int = Field(16, ge=1, le=1 << 14, description="N pairs; T = 2N")
    seed: int = Field(0, ge=0, description="draws the embeddings and, with the split, the rows")
    query_marker: bool = Field(
        False,
        description="one more input channel, 1 on the query tokens and 0 on the stored pairs",
    )

    @model_validator(mode="after")
    def _fits(self) -> ContinuousMQAR:
        if self.num_pairs > self.vocab_size:
            raise ValueError(
                f"num_pairs={self.num_pairs} needs {self.num_pairs} distinct keys but "
                f"vocab_size={self.vocab_size} has {self.vocab_size}; use vocab_size >= "
                f"{self.num_pairs}"
            )
        return self

    @property
    def seq_len(self) -> int:
        return 2 * self.num_pairs

    @property
    def token_dim(self) -> int:
        """2 d_e: a token is [key ; value]; 2 d_e + 1 with `query_marker`."""
        return 2 * self.embed_dim + int(self.query_marker)

    def embeddings(self) -> tuple[np.ndarray, np.ndarray]:
        """(K, V): [V, d_e] float32 each, unit-norm rows, read-only."""
        return embeddings(self.vocab_size, self.embed_dim, self.seed)

    def batch(self, split: Split, index: int, batch_size: int) -> Batch:
        """inputs [B, 2N, 2 d_e] float32; labels [B, 2N] int64: value indices at the queries."""
        check_batch_args(split, index, batch_size)
        rng = self.generator(split, index)
        b, n, d = batch_size, self.num_pairs, self.embed_dim
        keys = _distinct(rng, b, 0, self.vocab_size, n)  # [B, N] key indices
        values = _distinct(rng, b, 0, self.vocab_size, n)  # [B, N] value indices
        order = rng.random((b, n)).argsort(axis=1)  # [B, N] which pair each query asks
        key_table, value_table = self.embeddings()
        rows = np.arange(b)[:, None]
        inputs = np.zeros((b, 2 * n, self.token_dim), dtype=np.float32)
        inputs[:, :n, :d] = key_table[keys]
        inputs[:, :n, d : 2 * d] = value_table[values]
        inputs[:, n:, :d] = key_table[keys[rows, order]]
        if self.query_marker:
            inputs[:, n:, 2 * d] = 1.0
        labels = np.full((b, 2 * n), IGNORE, dtype=np.int64)
        labels[:, n:] = values[rows, order]
        return Batch(torch.from_numpy(inputs), torch.from_numpy(labels))

    def model_io(self, d_model: int) -> tuple[nn.Module, nn.Module]:
        """Input: a linear map 2 d_e -> d_model (none when d_model = 2 d_e); output: the
        frozen readout against the value embeddings (`ValueReadout`)."""
        if d_model != self.token_dim:
            project: nn.Module = nn.Linear(self.token_dim, d_model, bias=False)
        else:
            project = nn.Identity()
        values = torch.from_numpy(self.embeddings()[1].copy())
        return project, ValueReadout(values, d_model)

    def io_options(self) -> dict:
        io = {"vocab_size": self.vocab_size, "embed_dim": self.embed_dim, "seed": self.seed}
        if self.query_marker:  # the input layer is one channel wider (left out when off)
            io["query_marker"] = True
        return io
