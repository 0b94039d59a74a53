"""Forgetting MQAR: MQAR whose context re-assigns some keys; the label is the latest value.

One sequence of T tokens, N pairs, U = num_updates re-assignments:

    k1 v1 k2 v2 ... kN vN | k2 w2 k7 w7 ... | 0 0 k7 0 k2 0 0 0 k5 ...
    labels:                                   .  . w7 . w2 .  .  . v5 ...   (IGNORE at .)

The first 2N tokens are MQAR's context. The next 2U re-assign U distinct keys of the row, in
random order, each to a new value: all N + U values of a row are distinct tokens of V/2 .. V - 1,
so a re-assigned key's old value is wrong. Then every key is queried once, at MQAR's power-law
gaps after the 2(N + U) context tokens; the label is the key's most recent value (w for a
re-assigned key, v otherwise). A memory that only adds (linear attention) holds v + w for a
re-assigned key and cannot tell them apart; one that overwrites (the delta rule) can.
Fillers, mixtures, grids and slices are MQAR's.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
from pydantic import Field

from miras.tasks.base import IGNORE
from miras.tasks.mqar import MQAR, _distinct


class ForgettingMQAR(MQAR):
    """MQAR with U keys re-assigned before the queries; metrics {"loss", "accuracy"} over the
    N query positions."""

    name: ClassVar[str] = "forgetting_mqar"

    num_updates: int = Field(
        8, ge=1, le=1 << 14, description="U keys re-assigned a new value (at most N)"
    )

    def context_len(self, num_pairs: int) -> int:
        """The N pairs and the U re-assignments."""
        return 2 * (num_pairs + self.num_updates)

    def _bound(self) -> str:
        return "4 * num_pairs + 2 * num_updates"

    def check_setting(self, seq_len: int, num_pairs: int) -> str | None:
        n, u, v = num_pairs, self.num_updates, self.vocab_size
        if u > n:
            return f"num_updates={u} re-assigns distinct keys: needs num_pairs >= {u}, got {n}"
        problem = super().check_setting(seq_len, num_pairs)
        if problem is None and n + u > v - v // 2:
            return (
                f"num_pairs={n} with num_updates={u} needs {n + u} distinct values but "
                f"vocab_size={v} has {v - v // 2} (V/2 .. V - 1); use vocab_size >= "
                f"{2 * (n + u)}"
            )
        return problem

    def draw(
        self, rng: np.random.Generator, b: int, t: int, n: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        v, u = self.vocab_size, self.num_updates
        half = v // 2
        keys = _distinct(rng, b, 1, half, n)  # [B, N]
        values = _distinct(rng, b, half, v, n + u)  # [B, N + U], all distinct
        first, new = values[:, :n], values[:, n:]
        which = _distinct(rng, b, 0, n, u)  # [B, U] indices of the re-assigned keys
        rows = np.arange(b)[:, None]
        latest = first.copy()
        latest[rows, which] = new
        inputs = np.zeros((b, t), dtype=np.int64)
        labels = np.full((b, t), IGNORE, dtype=np.int64)
        inputs[:, 0 : 2 * n : 2] = keys
        inputs[:, 1 : 2 * n : 2] = first
        inputs[:, 2 * n : 2 * (n + u) : 2] = keys[rows, which]
        inputs[:, 2 * n + 1 : 2 * (n + u) : 2] = new
        self._queries(rng, inputs, labels, 2 * (n + u), keys, latest)
        return inputs, labels, keys
