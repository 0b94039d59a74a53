"""Multi-query associative recall (MQAR; Arora et al. 2023, "Zoology", Sec. 3.1 and App. E).

One sequence of T tokens:

    k1 v1 k2 v2 ... kN vN | 0 0 k7 0 k2 0 0 0 k5 ...      (context of 2N tokens, then queries)
    labels:                  .  . v7 . v2 .  .  . v5 ...   (IGNORE where shown as .)

Keys are N distinct tokens of the lower half of the vocabulary (1 .. V/2 - 1; 0 is the filler),
values N distinct tokens of the upper half (V/2 .. V - 1). Every key is queried exactly once, in
random order; the label at a query key's position is its value, so the model predicts the value
right after it sees the key again. Query i sits at 2N + 2 g_i, where the gaps g_i are distinct,
drawn without replacement from p(g) ~ power_a * (g + 1) ** (power_a - 1) on 0 .. (T - 2N)/2 - 1:
Zoology's power law, which puts most queries close to the context (power_a = 0.01) and becomes
uniform at power_a = 1.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
from pydantic import Field, model_validator

from miras.tasks.base import IGNORE, Batch, Split, Task, as_batch, check_batch_args


class MQAR(Task):
    """Zoology's MQAR; metrics {"loss", "accuracy"} over the query positions. Defaults are
    sized for a 2-core CPU; Zoology's figures use V = 8192, T = 64..512, N = 4..64."""

    name: ClassVar[str] = "mqar"
    primary_metric: ClassVar[str] = "accuracy"
    higher_is_better: ClassVar[bool] = True

    vocab_size: int = Field(256, ge=4, le=1 << 20, description="V: keys 1..V/2-1, values V/2..V-1")
    seq_len: int = Field(128, ge=4, le=1 << 16, description="T, context and queries")
    num_pairs: int = Field(16, ge=1, le=1 << 14, description="N key-value pairs, each queried once")
    power_a: float = Field(0.01, gt=0, le=1, description="power law of the query gaps")
    seed: int = Field(0, ge=0)

    @model_validator(mode="after")
    def _fits(self) -> MQAR:
        n, t, v = self.num_pairs, self.seq_len, self.vocab_size
        if 4 * n > t:
            # Zoology's bound: 2N context tokens, and N queries each followed by a filler.
            raise ValueError(
                f"num_pairs={n} needs seq_len >= 4 * num_pairs = {4 * n}, got seq_len={t}"
            )
        if n > v // 2 - 1:
            raise ValueError(
                f"num_pairs={n} needs {n} distinct keys but vocab_size={v} has {v // 2 - 1} "
                f"(1 .. V/2 - 1); use vocab_size >= {2 * n + 2}"
            )
        return self

    def batch(self, split: Split, index: int, batch_size: int) -> Batch:
        check_batch_args(split, index, batch_size)
        rng = self.generator(split, index)
        b, n, t, v = batch_size, self.num_pairs, self.seq_len, self.vocab_size
        half = v // 2
        keys = _distinct(rng, b, 1, half, n)  # [B, N] in 1 .. V/2 - 1
        values = _distinct(rng, b, half, v, n)  # [B, N] in V/2 .. V - 1
        space = (t - 2 * n) // 2
        g = np.arange(1, space + 1, dtype=np.float64)
        log_p = np.log(self.power_a) + (self.power_a - 1) * np.log(g)
        gaps = _without_replacement(rng, log_p, b, n)  # [B, N], gap of key i's query
        inputs = np.zeros((b, t), dtype=np.int64)
        labels = np.full((b, t), IGNORE, dtype=np.int64)
        inputs[:, 0 : 2 * n : 2] = keys
        inputs[:, 1 : 2 * n : 2] = values
        rows = np.arange(b)[:, None]
        where = 2 * n + 2 * gaps
        inputs[rows, where] = keys
        labels[rows, where] = values
        return as_batch(inputs, labels)


def _distinct(rng: np.random.Generator, rows: int, low: int, high: int, n: int) -> np.ndarray:
    """[rows, n] distinct integers per row from low .. high - 1, uniformly."""
    return low + rng.random((rows, high - low)).argsort(axis=1)[:, :n]


def _without_replacement(
    rng: np.random.Generator, log_p: np.ndarray, rows: int, n: int
) -> np.ndarray:
    """[rows, n] draws without replacement from p (Gumbel-top-k: the same law as successive
    sampling, numpy's `choice(replace=False, p=p)`, which Zoology calls per row)."""
    scores = log_p[None, :] + rng.gumbel(size=(rows, log_p.shape[0]))
    return np.argsort(-scores, axis=1)[:, :n]
