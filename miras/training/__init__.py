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

from typing import TYPE_CHECKING

from miras import lazy_names

# public name -> the module that defines it (imported on first use)
LAZY: dict[str, str] = {
    "CHECKPOINT": "miras.training.checkpoint",
    "METRICS": "miras.training.checkpoint",
    "RankFailure": "miras.training.distributed",
    "TrainConfig": "miras.training.config",
    "TrainRecipe": "miras.training.recipe",
    "TrainResult": "miras.training.recipe",
    "TrainingInterrupted": "miras.training.interrupts",
    "evaluate": "miras.training.evaluation",
    "evaluate_model": "miras.training.evaluation",
    "load_checkpoint": "miras.training.checkpoint",
    "load_model": "miras.training.checkpoint",
    "recorded_task": "miras.training.checkpoint",
    "save_atomic": "miras.training.checkpoint",
    "train": "miras.training.recipe",
    "train_on_ranks": "miras.training.launcher",
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


__getattr__, __dir__ = lazy_names(__name__, LAZY, globals())


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
