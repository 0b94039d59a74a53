"""Scoring a model on a task's batches: during training (`evaluate_model`, rank 0's evaluation
every `eval_every` steps) and afterwards, from a checkpoint (`evaluate`, `miras eval`).

    metrics = evaluate("runs/x")                   # on the task (and options) it trained on
    metrics = evaluate_model(model, task, batches=8, batch_size=32)
"""

from __future__ import annotations

import warnings
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

from miras.models.model import LanguageModel, build_model
from miras.spec import load_spec
from miras.tasks.base import Task
from miras.training.checkpoint import (
    check_io,
    load_checkpoint,
    recorded_setting,
    recorded_task,
    task_io,
)


def batch_inputs(batch, device, rows: slice = slice(None)) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch's (inputs, labels) on `device`, `rows` of them (a rank's share)."""
    return batch.inputs[rows].to(device), batch.labels[rows].to(device)


def autocast(precision: str, device: torch.device | str):
    """bf16: torch.autocast for the model's projections (the memory rule leaves autocast and
    computes in float32, MemoryRule.__call__); fp32: nothing."""
    if precision == "fp32":
        return nullcontext()
    return torch.autocast(torch.device(device).type, dtype=torch.bfloat16)


@torch.no_grad()
def evaluate_model(
    model: LanguageModel,
    task: Task,
    *,
    batches: int,
    batch_size: int,
    device="cpu",
    precision: str = "fp32",
    split: str = "valid",
) -> dict[str, float]:
    """The mean of `task.metrics` over batches 0..batches-1 of `split` (logits in float32),
    for each of the split's slices (`task.slices(split)`: {"": task} unless the task has a
    grid). Several slices: the mean over slices under each metric's name, and every slice's
    own as f"{metric}_{label}" ("accuracy_n64")."""
    was_training = model.training
    model.eval()
    slices = task.slices(split)
    scores: dict[str, dict[str, float]] = {}
    for label, part in slices.items():
        totals: dict[str, float] = {}
        for i in range(batches):
            inputs, labels = batch_inputs(part.batch(split, i, batch_size), device)
            with autocast(precision, device):
                logits = model(inputs)
            for name, value in part.metrics(logits.float(), labels).items():
                totals[name] = totals.get(name, 0.0) + float(value)
        scores[label] = {name: value / batches for name, value in totals.items()}
    model.train(was_training)
    if len(scores) == 1:
        return next(iter(scores.values()))
    names = list(next(iter(scores.values())))
    overall = {name: sum(s[name] for s in scores.values()) / len(scores) for name in names}
    return overall | {f"{n}_{label}": v for label, s in scores.items() for n, v in s.items()}


def evaluate(
    checkpoint: str | Path | dict[str, Any],
    task: Task | None = None,
    *,
    batches: int = 8,
    batch_size: int | None = None,
    device: str | None = None,
    split: str = "valid",
) -> dict[str, float]:
    """Score the model of a checkpoint (a file, its directory or the loaded dict) on `batches`
    batches of `split` of `task` (the batch size it trained with by default), per slice as
    `evaluate_model`. Without `task`, the one it trained on, with the recorded options
    (`recorded_task`; its notes become warnings)."""
    data = checkpoint if isinstance(checkpoint, dict) else load_checkpoint(checkpoint)
    if task is None:
        task, notes = recorded_task(data)
        for note in notes:
            warnings.warn(note, stacklevel=2)
    vocab = data["task"]["vocab_size"]
    if task.vocab_size != vocab:
        raise ValueError(
            f"task: its vocabulary has {task.vocab_size} tokens, the checkpoint's model {vocab}"
        )
    check_io(data, task)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    spec = load_spec(data["spec"])
    model = build_model(spec, vocab, task_io(task, spec.model.d_model)).to(device)
    model.load_state_dict(data["model"])
    size = batch_size or data["config"]["batch_size"]
    precision = recorded_setting(data, "precision")
    return evaluate_model(
        model,
        task,
        batches=batches,
        batch_size=size,
        device=device,
        precision=precision,
        split=split,
    )
