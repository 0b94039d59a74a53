"""The MAD synthetic suite (Poli et al. 2024, "Mechanistic Design and Scaling of Hybrid
Architectures", Sec. 3 and App. B), at its baseline settings.

One task class; `subtask` picks the generator and its baseline (MAD's configs/tasks/*.yml):

| subtask            | vocab | seq_len | other                                   |
| ------------------ | ----- | ------- | --------------------------------------- |
| in_context_recall  | 16    | 128     | multi-query                             |
| noisy_recall       | 32    | 128     | noise_vocab_size 16, frac_noise 0.2     |
| fuzzy_recall       | 16    | 128     | k_motif_size 3, v_motif_size 3          |
| selective_copying  | 16    | 256     | num_tokens_to_copy 16                   |
| compression        | 16    | 62      | 31 tokens (MAD: 31 + marker = 32)       |
| memorization       | 256   | 32      | 16 pairs of a fixed key-value map       |

Any option may be overridden; an option that does not apply to the subtask is an error.
`train_examples` (every subtask) fixes the training set at that many sequences, as MAD's
`num_train_examples` does: the train split cycles over them in epochs, reshuffled each epoch;
valid and test stay new draws. docs/tasks.md states each generator and where it departs from
MAD's code.
"""

from __future__ import annotations

import random
from typing import Any, ClassVar, Literal

import numpy as np
from pydantic import Field, model_validator

from miras.tasks.base import IGNORE, Batch, Split, Task, as_batch, check_batch_args

Subtask = Literal[
    "in_context_recall",
    "noisy_recall",
    "fuzzy_recall",
    "selective_copying",
    "compression",
    "memorization",
]
SUBTASKS: tuple[str, ...] = Subtask.__args__

# MAD's baseline settings per subtask; the keys are also the options each subtask takes.
BASELINES: dict[str, dict[str, Any]] = {
    "in_context_recall": {"vocab_size": 16, "seq_len": 128, "train_labels": "next_token"},
    "noisy_recall": {
        "vocab_size": 32,
        "seq_len": 128,
        "noise_vocab_size": 16,
        "frac_noise": 0.2,
        "train_labels": "next_token",
    },
    "fuzzy_recall": {
        "vocab_size": 16,
        "seq_len": 128,
        "k_motif_size": 3,
        "v_motif_size": 3,
        "train_labels": "next_token",
    },
    "selective_copying": {"vocab_size": 16, "seq_len": 256, "num_tokens_to_copy": 16},
    "compression": {"vocab_size": 16, "seq_len": 62},
    "memorization": {"vocab_size": 256, "seq_len": 32},
}
COMMON = ("subtask", "seed", "train_examples")


class MAD(Task):
    """One MAD subtask. Accuracy over labelled positions (MAD's metric)."""

    name: ClassVar[str] = "mad"
    primary_metric: ClassVar[str] = "accuracy"
    higher_is_better: ClassVar[bool] = True

    subtask: Subtask = "in_context_recall"
    vocab_size: int = Field(ge=4, le=1 << 20)
    seq_len: int = Field(ge=4, le=1 << 20)
    seed: int = Field(0, ge=0)
    # MAD's num_train_examples: the train split cycles over this many fixed sequences (None:
    # every training batch is new data).
    train_examples: int | None = Field(None, ge=1, le=1 << 20)
    # Options of some subtasks only (None elsewhere).
    noise_vocab_size: int | None = Field(None, ge=1, le=1 << 20)
    frac_noise: float | None = Field(None, ge=0, lt=1)
    k_motif_size: int | None = Field(None, ge=1, le=1 << 20)
    v_motif_size: int | None = Field(None, ge=1, le=1 << 20)
    num_tokens_to_copy: int | None = Field(None, ge=1, le=1 << 20)
    # MAD trains the recall tasks on every next token and scores only the recalled values;
    # "answers" labels only the values in both splits.
    train_labels: Literal["next_token", "answers"] | None = None

    @model_validator(mode="before")
    @classmethod
    def _baseline(cls, data: Any) -> Any:
        """Fill the subtask's baseline; reject options of other subtasks, by name."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        subtask = str(data.get("subtask", "in_context_recall")).replace("-", "_")
        if subtask not in BASELINES:  # the Literal reports it, with the allowed values
            return {**BASELINES["in_context_recall"], **data}
        data["subtask"] = subtask
        baseline = BASELINES[subtask]
        for option, value in data.items():
            known = option in cls.model_fields
            if known and value is not None and option not in baseline and option not in COMMON:
                takes = ", ".join([*COMMON, *baseline])
                raise ValueError(
                    f"option '{option}' does not apply to subtask '{subtask}'; it takes {takes}"
                )
        return {**baseline, **data}

    @model_validator(mode="after")
    def _fits(self) -> MAD:
        if self.subtask in ("in_context_recall", "noisy_recall"):
            self._check_recall()
        elif self.subtask == "fuzzy_recall":
            self._check_fuzzy_recall()
        elif self.subtask == "selective_copying":
            self._check_selective_copying()
        elif self.seq_len % 2:  # compression and memorization
            raise ValueError(
                f"seq_len: {self.subtask} builds its stream from pairs of positions, so it "
                f"must be even, got {self.seq_len}"
            )
        return self

    def _check_recall(self) -> None:
        if self.seq_len % 2:
            raise ValueError(f"seq_len: key-value pairs need an even length, got {self.seq_len}")
        if self._content_vocab() < 2:
            raise ValueError(
                f"vocab_size={self.vocab_size} leaves no keys and values after "
                f"{self.noise_vocab_size or 0} noise tokens"
            )

    def _check_fuzzy_recall(self) -> None:
        keys = (self.vocab_size - 1) // 2
        if keys < self.k_motif_size or (self.vocab_size - 1) - keys < self.v_motif_size:
            raise ValueError(
                f"vocab_size={self.vocab_size} has {keys} key tokens, too few for motifs of "
                f"k_motif_size={self.k_motif_size} distinct tokens (and v_motif_size="
                f"{self.v_motif_size})"
            )
        need = 4 * (self.k_motif_size + self.v_motif_size)
        if self.seq_len < need:
            raise ValueError(
                f"seq_len={self.seq_len}: fuzzy recall with these motifs needs at least {need}"
            )

    def _check_selective_copying(self) -> None:
        n = self.num_tokens_to_copy
        if self.seq_len <= 2 * n + 1:
            raise ValueError(
                f"seq_len must exceed 2 * num_tokens_to_copy + 1 = {2 * n + 1}, "
                f"got seq_len={self.seq_len}"
            )

    # Batches --------------------------------------------------------------------------------

    def batch(self, split: Split, index: int, batch_size: int) -> Batch:
        check_batch_args(split, index, batch_size)
        if split == "train" and self.train_examples is not None:
            return as_batch(*self._fixed_train_rows(index, batch_size))
        return as_batch(*self._generate(self.generator(split, index), batch_size, split))

    def _generate(self, rng: np.random.Generator, b: int, split: Split):
        generate = {
            "in_context_recall": self._recall,
            "noisy_recall": self._recall,
            "fuzzy_recall": self._fuzzy_recall,
            "selective_copying": self._selective_copying,
            "compression": self._compression,
            "memorization": self._memorization,
        }[self.subtask]
        return generate(rng, b, split)

    def train_set(self) -> tuple[np.ndarray, np.ndarray]:
        """The fixed training set of `train_examples` sequences (inputs, labels [N, T]), drawn
        once from the train stream's batch 0 at batch size N; built once per task's options."""
        if self.train_examples is None:
            raise ValueError("train_set: this task has no train_examples (every batch is new)")
        return _train_set(self)

    def _fixed_train_rows(self, index: int, b: int) -> tuple[np.ndarray, np.ndarray]:
        """Batch `index` of the fixed training set: positions index*b .. index*b + b - 1 of
        the stream of epochs, epoch e a permutation of the N sequences seeded by (seed, e)."""
        inputs, labels = self.train_set()
        n = len(inputs)
        at = index * b + np.arange(b)
        epochs, within = at // n, at % n
        rows = np.empty(b, dtype=np.int64)
        for e in np.unique(epochs):
            order = np.random.default_rng(np.random.SeedSequence([self.seed, 3, int(e)]))
            here = epochs == e
            rows[here] = order.permutation(n)[within[here]]
        return inputs[rows], labels[rows]

    def _content_vocab(self) -> int:
        return self.vocab_size - (self.noise_vocab_size or 0)

    def _next_token(self, split: Split) -> bool:
        return split == "train" and self.train_labels == "next_token"

    def _recall(self, rng: np.random.Generator, b: int, split: Split):
        """seq_len / 2 pairs `k v` (or, with probability frac_noise, two noise tokens); a key
        keeps its value within a sequence. The last pair repeats a key seen before. The label
        at a key's position is its value when the key was seen before (multi-query)."""
        c = self._content_vocab()
        n_keys, pairs, t = c // 2, self.seq_len // 2, self.seq_len
        frac = self.frac_noise or 0.0
        keys = rng.integers(0, n_keys, size=(b, pairs))
        value_of = rng.integers(n_keys, c, size=(b, n_keys))  # each row's key -> value map
        noise = rng.random((b, pairs)) < frac
        rows = np.arange(b)
        noise[rows, rng.integers(0, pairs - 1, size=b)] = False  # MAD keeps one pair clean
        noise[:, -1] = False
        # The probe (last pair) repeats a key presented before, uniform over distinct keys.
        seen = np.zeros((b, n_keys), dtype=bool)
        for i in range(pairs - 1):
            clean = ~noise[:, i]
            seen[rows[clean], keys[clean, i]] = True
        keys[:, -1] = np.argmax(np.where(seen, rng.random((b, n_keys)), -1.0), axis=1)
        values = np.take_along_axis(value_of, keys, 1)
        inputs = np.empty((b, t), dtype=np.int64)
        inputs[:, 0::2], inputs[:, 1::2] = keys, values
        if frac > 0:  # noise pairs: two tokens of the noise vocabulary c .. V - 1
            noisy = np.repeat(noise, 2, axis=1)
            inputs[noisy] = rng.integers(c, self.vocab_size, size=int(noisy.sum()))
        if self._next_token(split):
            return inputs, _shifted(inputs)
        # Was the key of pair i presented in an earlier noise-free pair?
        onehot = np.zeros((b, pairs, n_keys), dtype=bool)
        onehot[rows[:, None], np.arange(pairs)[None, :], keys] = ~noise
        before = np.cumsum(onehot, axis=1) - onehot
        asked = np.take_along_axis(before, keys[..., None], 2)[..., 0] > 0
        labels = np.full((b, t), IGNORE, dtype=np.int64)
        labels[:, 0::2] = np.where(asked & ~noise, values, IGNORE)
        return inputs, labels

    def _fuzzy_recall(self, rng: np.random.Generator, b: int, split: Split):
        rows = [self._fuzzy_row(rng, split) for _ in range(b)]
        return np.stack([r[0] for r in rows]), np.stack([r[1] for r in rows])

    def _fuzzy_row(self, rng: np.random.Generator, split: Split):
        """Keys and values are motifs of 1..k (1..v) distinct tokens, so a short key can be a
        prefix of a longer one. Valid sequences query at the longest key size (as MAD's test
        set). Sequences are left-padded to seq_len + 1 and shifted by one."""
        km, vm, t = self.k_motif_size, self.v_motif_size, self.seq_len
        pad = c = self.vocab_size - 1  # the last token pads; c content tokens below it
        key_vocab, value_vocab = range(c // 2), range(c // 2, c)
        train = split == "train"
        # Python's generator for the many scalar draws of this loop (10x faster than numpy's
        # per call), seeded from the batch's generator so batches stay deterministic.
        r = random.Random(int(rng.integers(2**63)))

        def motif(vocab, size):  # `size` distinct tokens in random order
            return tuple(r.sample(vocab, size))

        def key_size():
            return r.randint(1, km) if train else km

        k_probe = motif(key_vocab, key_size())
        v_probe = motif(value_vocab, r.randint(1, vm))
        probe = len(k_probe) + len(v_probe)
        stop = t - probe - (km + vm)
        # MAD draws the probe's place below t - 2 * probe, which the loop may never reach;
        # below stop - (km + vm) it is always placed.
        probe_at = r.randrange(max(1, stop - (km + vm) + 1))
        value_of: dict[tuple, tuple] = {}
        inputs: list[int] = []
        labels: list[int] = []
        placed = False
        while len(inputs) < stop:
            if len(inputs) >= probe_at and not placed:
                k, v = k_probe, v_probe
                placed = True
                asked = k in value_of
            else:
                k = motif(key_vocab, key_size())
                v_size = r.randint(1, vm)
                if k == k_probe:
                    v, placed = v_probe, True
                else:
                    v = value_of.get(k) or motif(value_vocab, v_size)
                asked = k in value_of
            value_of[k] = v
            inputs += [*k, *v]
            labels += [IGNORE] * len(k) + (list(v) if asked else [IGNORE] * len(v))
        inputs += [*k_probe, *v_probe]
        labels += [IGNORE] * len(k_probe) + list(v_probe)
        n_pad = t + 1 - len(inputs)
        inputs = np.array([pad] * n_pad + inputs, dtype=np.int64)
        labels = np.array([IGNORE] * n_pad + labels, dtype=np.int64)
        if self._next_token(split):
            return inputs[:-1], inputs[1:]
        return inputs[:-1], labels[1:]

    def _selective_copying(self, rng: np.random.Generator, b: int, split: Split):
        """n content tokens scattered among blanks, a copy token, then n blanks at whose
        positions the content is reproduced in order (MAD's targets: no shift)."""
        n, t, v = self.num_tokens_to_copy, self.seq_len, self.vocab_size
        blank, copy = v - 2, v - 1
        head = t - n - 1  # content and blanks before the copy token
        content = rng.integers(0, v - 2, size=(b, n))
        where = np.sort(rng.random((b, head)).argsort(axis=1)[:, :n], axis=1)
        inputs = np.full((b, t), blank, dtype=np.int64)
        np.put_along_axis(inputs, where, content, 1)
        inputs[:, head] = copy
        labels = np.full((b, t), IGNORE, dtype=np.int64)
        labels[:, head + 1 :] = content
        return inputs, labels

    def _compression(self, rng: np.random.Generator, b: int, split: Split):
        """MAD compresses 31 tokens and a marker into one embedding for an MLP decoder. In one
        causal stream: n tokens, the marker, then n - 1 more markers; from the first marker
        on, the model reproduces the n tokens in order with no teacher forcing, so it must
        carry them in its state."""
        n, v = self.seq_len // 2, self.vocab_size
        marker = v - 1
        content = rng.integers(0, v - 1, size=(b, n))
        inputs = np.concatenate([content, np.full((b, n), marker)], axis=1)
        labels = np.concatenate([np.full((b, n), IGNORE), content], axis=1)
        return inputs, labels

    def memorization_map(self) -> dict[int, int]:
        """The fixed key -> value map (seeded by `seed` alone): keys 0 .. c/2 - 1 onto distinct
        values c/2 .. c - 1, with c = vocab_size - 1 (the last token marks an insert)."""
        c = self.vocab_size - 1
        rng = np.random.default_rng(np.random.SeedSequence([self.seed, 2]))
        keys = rng.permutation(c // 2)
        values = rng.permutation(np.arange(c // 2, c))
        return {int(k): int(v) for k, v in zip(keys, values[: c // 2], strict=True)}

    def _memorization(self, rng: np.random.Generator, b: int, split: Split):
        """seq_len / 2 pairs `key insert`; the label at the insert token is the key's value in
        the fixed map, which the model must store in its weights, not its context."""
        mapping = self.memorization_map()
        table = np.zeros(max(mapping) + 1, dtype=np.int64)
        table[list(mapping)] = list(mapping.values())
        keys = rng.integers(0, len(mapping), size=(b, self.seq_len // 2))
        inputs = np.full((b, self.seq_len), self.vocab_size - 1, dtype=np.int64)
        inputs[:, 0::2] = keys
        labels = np.full((b, self.seq_len), IGNORE, dtype=np.int64)
        labels[:, 1::2] = table[keys]
        return inputs, labels


_TRAIN_SETS: dict[str, tuple[np.ndarray, np.ndarray]] = {}


def _train_set(task: MAD) -> tuple[np.ndarray, np.ndarray]:
    """A task's fixed training set, kept per options (the task is frozen, so its options name
    it); at most a few sets are kept, the oldest dropped first."""
    key = task.model_dump_json()
    if key not in _TRAIN_SETS:
        while len(_TRAIN_SETS) >= 4:
            _TRAIN_SETS.pop(next(iter(_TRAIN_SETS)))
        n = task.train_examples
        inputs, labels = task._generate(task.generator("train", 0), n, "train")
        inputs.setflags(write=False)
        labels.setflags(write=False)
        _TRAIN_SETS[key] = (inputs, labels)
    return _TRAIN_SETS[key]


def _shifted(inputs: np.ndarray) -> np.ndarray:
    """Next-token labels: labels[:, t] = inputs[:, t + 1]; the last position is unscored."""
    labels = np.full_like(inputs, IGNORE)
    labels[:, :-1] = inputs[:, 1:]
    return labels
