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

With `random_non_queries` the zeros after the context are random tokens instead (Zoology's
option): any token of the vocabulary but the row's own keys, so a filler is never a query.

Each split draws from a list of (T, N) settings: train from `train_mixture` (batch i from
setting i mod K: one T per batch, reproducible, every setting once in K batches), test from
`test_grid`, valid (and train and test without their lists) from (seq_len, num_pairs). A split
with several settings is scored per setting (`slices`: "n64", or "t256_n64" when T varies).
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar

import numpy as np
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

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
MAX_SETTINGS = 64


def _pair(value: Any) -> Any:
    """Accept [T, N] (as YAML or a command line writes it) as well as {seq_len, num_pairs}."""
    if isinstance(value, (list, tuple)):
        if len(value) != 2:
            raise ValueError(f"expected [seq_len, num_pairs], got {list(value)}")
        return {"seq_len": value[0], "num_pairs": value[1]}
    return value


class _Setting(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    seq_len: int = Field(ge=4, le=MAX_SEQ_LEN, description="T of this setting")
    num_pairs: int = Field(ge=1, le=MAX_SEQ_LEN // 4, description="N of this setting")


def _some(value: Any) -> Any:
    if isinstance(value, (list, tuple)) and not value:
        raise ValueError("expected at least one [seq_len, num_pairs] setting")
    return value


Setting = Annotated[_Setting, BeforeValidator(_pair)]
Settings = Annotated[tuple[Setting, ...], BeforeValidator(_some), Field(max_length=MAX_SETTINGS)]


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
    random_non_queries: bool = Field(
        False, description="fill the non-query positions after the context with random tokens"
    )
    train_mixture: Settings | None = Field(
        None, description="(T, N) settings of the train split; batch i uses setting i mod K"
    )
    test_grid: Settings | None = Field(
        None, description="(T, N) settings of the test split, each scored as its own slice"
    )

    def context_len(self, num_pairs: int) -> int:
        """Tokens before the first query slot: the N pairs."""
        return 2 * num_pairs

    def check_setting(self, seq_len: int, num_pairs: int) -> str | None:
        """What is wrong with a (T, N) setting, or None."""
        n, t, v = num_pairs, seq_len, self.vocab_size
        if self.context_len(n) + 2 * n > t:
            # Zoology's bound: 2N context tokens, and N queries each followed by a filler.
            need = self.context_len(n) + 2 * n
            return f"num_pairs={n} needs seq_len >= {self._bound()} = {need}, got seq_len={t}"
        if n > v // 2 - 1:
            return (
                f"num_pairs={n} needs {n} distinct keys but vocab_size={v} has {v // 2 - 1} "
                f"(1 .. V/2 - 1); use vocab_size >= {2 * n + 2}"
            )
        return None

    def _bound(self) -> str:
        return "4 * num_pairs"

    @model_validator(mode="after")
    def _fits(self) -> MQAR:
        problems = []
        base = self.check_setting(self.seq_len, self.num_pairs)
        if base is not None:
            problems.append(base)
        for option in ("train_mixture", "test_grid"):
            settings = getattr(self, option) or ()
            for i, s in enumerate(settings):
                problem = self.check_setting(s.seq_len, s.num_pairs)
                if problem is not None:
                    problems.append(f"{option}[{i}]: {problem}")
                if s in settings[:i]:
                    problems.append(
                        f"{option}[{i}]: (seq_len={s.seq_len}, num_pairs={s.num_pairs}) is "
                        "listed twice"
                    )
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def settings(self, split: Split) -> list[tuple[int, int]]:
        """The (T, N) settings `split` draws from, in order."""
        check_split(split)
        listed = {"train": self.train_mixture, "test": self.test_grid}.get(split)
        if listed is None:
            return [(self.seq_len, self.num_pairs)]
        return [(s.seq_len, s.num_pairs) for s in listed]

    def slices(self, split: Split) -> dict[str, Task]:
        """One sub-task per setting of `split` (itself when it has one), labelled "n64", or
        "t256_n64" when the settings' T differ. A sub-task's batches of `split` are the
        batches of that setting the whole task draws."""
        settings = self.settings(split)
        if len(settings) == 1:
            return {"": self}
        same_t = len({t for t, _ in settings}) == 1
        option = {"train": "train_mixture", "test": "test_grid"}[split]
        out: dict[str, Task] = {}
        for t, n in settings:
            label = f"n{n}" if same_t else f"t{t}_n{n}"
            one = {"seq_len": t, "num_pairs": n}
            out[label] = type(self)(**{**self.options(), **one, option: [one]})
        return out

    def batch(self, split: Split, index: int, batch_size: int) -> Batch:
        check_batch_args(split, index, batch_size)
        settings = self.settings(split)
        t, n = settings[index % len(settings)]
        rng = self.generator(split, index)
        if (split == "train" and self.train_mixture) or (split == "test" and self.test_grid):
            # A listed setting's own stream: the slices of one grid are independent draws.
            entropy = [self.seed, SPLITS[split], index, t, n]
            rng = np.random.default_rng(np.random.SeedSequence(entropy))
        inputs, labels, keys = self.draw(rng, batch_size, t, n)
        if self.random_non_queries:
            self._fill(rng, inputs, labels, keys, self.context_len(n))
        return as_batch(inputs, labels)

    def draw(
        self, rng: np.random.Generator, b: int, t: int, n: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """inputs, labels [B, T] of one setting (fillers 0) and the keys [B, N] of each row."""
        v = self.vocab_size
        half = v // 2
        keys = _distinct(rng, b, 1, half, n)  # [B, N] in 1 .. V/2 - 1
        values = _distinct(rng, b, half, v, n)  # [B, N] in V/2 .. V - 1
        inputs = np.zeros((b, t), dtype=np.int64)
        labels = np.full((b, t), IGNORE, dtype=np.int64)
        inputs[:, 0 : 2 * n : 2] = keys
        inputs[:, 1 : 2 * n : 2] = values
        self._queries(rng, inputs, labels, 2 * n, keys, values)
        return inputs, labels, keys

    def _queries(
        self,
        rng: np.random.Generator,
        inputs: np.ndarray,
        labels: np.ndarray,
        start: int,
        keys: np.ndarray,
        answers: np.ndarray,
    ) -> None:
        """Query every key [B, N] once after `start`, at power-law gaps; label: `answers`."""
        b, t = inputs.shape
        space = (t - start) // 2
        g = np.arange(1, space + 1, dtype=np.float64)
        log_p = np.log(self.power_a) + (self.power_a - 1) * np.log(g)
        gaps = _without_replacement(rng, log_p, b, keys.shape[1])  # [B, N], gap of key i
        rows = np.arange(b)[:, None]
        where = start + 2 * gaps
        inputs[rows, where] = keys
        labels[rows, where] = answers

    def _fill(
        self,
        rng: np.random.Generator,
        inputs: np.ndarray,
        labels: np.ndarray,
        keys: np.ndarray,
        start: int,
    ) -> None:
        """Random fillers at the non-query positions from `start` on: uniform over the V - N
        tokens that are not one of the row's keys [B, N]. (Zoology draws from all V, so its
        fillers can repeat a key, unlabelled.)"""
        b, t = inputs.shape
        v = self.vocab_size
        allowed = np.ones((b, v), dtype=bool)
        allowed[np.arange(b)[:, None], keys] = False
        tokens = np.argsort(~allowed, axis=1, kind="stable")[:, : v - keys.shape[1]]  # [B, V-N]
        pick = rng.integers(0, v - keys.shape[1], size=(b, t))
        fillers = np.take_along_axis(tokens, pick, axis=1)
        spot = labels == IGNORE
        spot[:, :start] = False
        inputs[spot] = fillers[spot]


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
