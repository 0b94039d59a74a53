"""Memory tasks: seeded generators and their metrics (docs/tasks.md).

    from miras.tasks import TASKS, make_task
    task = make_task("mqar", num_pairs=32, seq_len=256)
    batch = task.batch("train", index=0, batch_size=64)   # Batch(inputs, labels), [B, T]
    task.metrics(logits, batch.labels)                     # {"loss", "accuracy"}
    task.slices("test")                                    # {"n64": ..., "n128": ...}

The capacity probe is not a training task: `miras.tasks.capacity.capacity_curve`.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from miras.errors import did_you_mean
from miras.spec.validation import translate
from miras.tasks.base import IGNORE, SPLITS, Batch, Task
from miras.tasks.continuous_mqar import ContinuousMQAR
from miras.tasks.forgetting_mqar import ForgettingMQAR
from miras.tasks.mad import MAD
from miras.tasks.mqar import MQAR
from miras.tasks.niah import NIAH
from miras.tasks.state_tracking import GroupWord, ModularArithmetic, Parity
from miras.tasks.text import Text

TASKS: dict[str, type[Task]] = {
    "mqar": MQAR,
    "forgetting_mqar": ForgettingMQAR,
    "continuous_mqar": ContinuousMQAR,
    "mad": MAD,
    "niah": NIAH,
    "text": Text,
    "parity": Parity,
    "modular_arithmetic": ModularArithmetic,
    "group_word": GroupWord,
}

__all__ = ["IGNORE", "SPLITS", "TASKS", "Batch", "Task", "make_task"]


def make_task(name: str, **options: Any) -> Task:
    """The task `name` with `options`; a ValueError naming the task, the option and the
    allowed values on a bad name or value (every problem at once)."""
    if name not in TASKS:
        raise ValueError(
            f"unknown task '{name}'; allowed: {', '.join(TASKS)}{did_you_mean(name, TASKS)}"
        )
    cls = TASKS[name]
    try:
        return cls(**options)
    except ValidationError as error:
        problems = translate(error, cls, noun="option")
        text = "; ".join(
            f"option '{p.path}': {p.message}" if p.path else p.message for p in problems
        )
        raise ValueError(f"task '{name}': {text}") from None
