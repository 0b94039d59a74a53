"""Memory tasks: seeded generators and their metrics (docs/tasks.md).

    from miras.tasks import TASKS, make_task
    task = make_task("mqar", num_pairs=32, seq_len=256)
    batch = task.batch("train", index=0, batch_size=64)   # Batch(inputs, labels), [B, T]
    task.metrics(logits, batch.labels)                     # {"loss", "accuracy"}

The capacity probe is not a training task: `miras.tasks.capacity.capacity_curve`.
"""

from __future__ import annotations

from typing import Any, Literal, get_args, get_origin

from pydantic import ValidationError

from miras.formula import did_you_mean
from miras.tasks.base import IGNORE, Batch, Task
from miras.tasks.mad import MAD
from miras.tasks.mqar import MQAR
from miras.tasks.niah import NIAH
from miras.tasks.text import Text

TASKS: dict[str, type[Task]] = {
    "mqar": MQAR,
    "mad": MAD,
    "niah": NIAH,
    "text": Text,
}

__all__ = ["IGNORE", "TASKS", "Batch", "Task", "make_task"]


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
        problems = [_problem(cls, e) for e in error.errors()]
        raise ValueError(f"task '{name}': " + "; ".join(problems)) from None


def _problem(cls: type[Task], error: dict) -> str:
    """One pydantic error as `option 'x': what is wrong (got y)`."""
    loc = [str(part) for part in error["loc"]]
    message = error["msg"].removeprefix("Value error, ")
    if not loc:  # a check across options: its message names them
        return message
    option = loc[0]
    fields = list(cls.model_fields)
    if error["type"] == "extra_forbidden":
        return (
            f"unknown option '{option}'{did_you_mean(option, fields)}; options: {', '.join(fields)}"
        )
    where = option + "".join(f"[{part}]" for part in loc[1:])
    allowed = _allowed(cls, option)
    if allowed and error["type"] == "literal_error":
        got = error["input"]
        return (
            f"option '{where}': expected one of {', '.join(allowed)}, got {got!r}"
            f"{did_you_mean(got, allowed)}"
        )
    return f"option '{where}': {message} (got {error['input']!r})"


def _allowed(cls: type[Task], option: str) -> list[str]:
    """The values of a Literal option (also inside `X | None`), else []."""
    field = cls.model_fields.get(option)
    if field is None:
        return []
    annotation = field.annotation
    candidates = [annotation, *get_args(annotation)]
    for candidate in candidates:
        if get_origin(candidate) is Literal:
            return [str(a) for a in get_args(candidate)]
    return []
