"""Training: a model built from a spec, trained on a task and scored (docs/training.md).

The layer above the models and tasks. Its modules:
- `config`: `TrainConfig`, the settings and their one set of defaults (imports no torch: the
  CLI and a study's `train:` section read it);
- `recipe`: `miras.train` and the `TrainRecipe` it runs (setup, step, evaluate, checkpoint,
  run);
- `evaluation`: scoring a model or a checkpoint on a task's batches;
- `checkpoint`: the run's files (the checkpoint, written atomically; the metrics log) and
  what resuming checks;
- `interrupts`: Ctrl-C (finish the step, save, `TrainingInterrupted`);
- `distributed`: the ranks under torchrun (process group, batch shards, a lost rank's
  message); `launcher`: a run on several ranks started from one process;
- `progress`: the progress bar or lines on stderr.

    result = miras.training.train(spec, task, steps=500)   # also miras.train
    data = miras.training.load_checkpoint("runs/x")

Each public name below is imported from its module on first use (PEP 562), so reading
`miras.training.config` loads no torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# public name -> the module of miras.training that defines it
LAZY: dict[str, str] = {
    "CHECKPOINT": "checkpoint",
    "METRICS": "checkpoint",
    "RankFailure": "distributed",
    "TrainConfig": "config",
    "TrainRecipe": "recipe",
    "TrainResult": "recipe",
    "TrainingInterrupted": "interrupts",
    "evaluate": "evaluation",
    "evaluate_model": "evaluation",
    "load_checkpoint": "checkpoint",
    "load_model": "checkpoint",
    "recorded_task": "checkpoint",
    "save_atomic": "checkpoint",
    "train": "recipe",
    "train_on_ranks": "launcher",
}

__all__ = [
    "CHECKPOINT",
    "METRICS",
    "RankFailure",
    "TrainConfig",
    "TrainRecipe",
    "TrainResult",
    "TrainingInterrupted",
    "evaluate",
    "evaluate_model",
    "load_checkpoint",
    "load_model",
    "recorded_task",
    "save_atomic",
    "train",
    "train_on_ranks",
]


def __getattr__(name: str) -> Any:
    # Unknown names raise AttributeError, so `from miras.training import recipe` imports the
    # submodule.
    if name not in LAZY:
        raise AttributeError(f"module 'miras.training' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{LAZY[name]}"), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *LAZY])


if TYPE_CHECKING:
    from miras.training.checkpoint import (
        CHECKPOINT,
        METRICS,
        load_checkpoint,
        load_model,
        recorded_task,
        save_atomic,
    )
    from miras.training.config import TrainConfig
    from miras.training.distributed import RankFailure
    from miras.training.evaluation import evaluate, evaluate_model
    from miras.training.interrupts import TrainingInterrupted
    from miras.training.launcher import train_on_ranks
    from miras.training.recipe import TrainRecipe, TrainResult, train
