"""Train and evaluate a model built from a spec on a task (docs/training.md).

    result = miras.train("specs/deltanet.yaml", make_task("mqar"), steps=500, batch_size=32)
    result.metrics        # the final evaluation: {"loss": ..., "accuracy": ...}
    metrics = miras.evaluate("runs/x/checkpoint.pt")  # on the task (and options) it trained on

AdamW, linear warmup then cosine decay to 10% of the peak rate, gradient clipping. Seeded and
deterministic: the model is initialized after `torch.manual_seed(seed)` and batch i of a split
is a function of (task seed, i), so a run resumed from its checkpoint continues exactly.
The model stays in float32 (float64 if asked), so the memory state is never below fp32.
Ctrl-C saves a checkpoint at the step it stops at (`TrainingInterrupted`).
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from miras.errors import TrainingDiverged
from miras.models.model import LanguageModel, build_model
from miras.spec import Spec, load_spec

CHECKPOINT = "checkpoint.pt"
METRICS = "metrics.jsonl"
MIN_LR_RATIO = 0.1  # cosine decay ends at 10% of the peak learning rate
IGNORE = -100  # labels of unscored positions


class Task(Protocol):
    """What training needs from a task (miras.tasks): seeded batches by index and a metric."""

    vocab_size: int
    seq_len: int
    primary_metric: str
    higher_is_better: bool

    def batch(self, split: str, index: int, batch_size: int) -> Any: ...

    def metrics(self, logits: torch.Tensor, labels: torch.Tensor) -> dict[str, float]: ...


@dataclass(frozen=True)
class TrainConfig:
    """The settings that decide the trajectory; a resumed run must use the same ones."""

    steps: int = 1000
    batch_size: int = 32
    lr: float = 3e-3
    warmup: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        problems = []
        for name in ("steps", "batch_size"):
            if getattr(self, name) < 1:
                problems.append(f"{name}: expected an integer >= 1, got {getattr(self, name)}")
        if self.warmup < 0:
            problems.append(f"warmup: expected an integer >= 0, got {self.warmup}")
        if not self.lr > 0:
            problems.append(f"lr: expected a number > 0, got {self.lr}")
        if self.weight_decay < 0:
            problems.append(f"weight_decay: expected a number >= 0, got {self.weight_decay}")
        if not self.grad_clip > 0:
            problems.append(f"grad_clip: expected a number > 0, got {self.grad_clip}")
        if problems:
            raise ValueError("; ".join(problems))


@dataclass
class TrainResult:
    """`metrics`: the final evaluation; `history`: every evaluation record in order;
    `losses`: the training loss of every step (1..steps), resumed runs included."""

    metrics: dict[str, float]
    history: list[dict[str, Any]] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    steps: int = 0
    parameters: int = 0
    seconds: float = 0.0
    out_dir: Path | None = None


# The pieces ---------------------------------------------------------------------------------


def lr_factor(step: int, warmup: int, steps: int) -> float:
    """Linear warmup over `warmup` steps, then cosine from 1 to MIN_LR_RATIO at `steps`."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, steps - warmup))
    return MIN_LR_RATIO + (1 - MIN_LR_RATIO) * 0.5 * (1 + math.cos(math.pi * progress))


def make_optimizer(model: torch.nn.Module, config: TrainConfig) -> torch.optim.AdamW:
    """AdamW; weight decay on projection matrices only, not on norms, biases, gate biases,
    the memory's learned initial state or persistent tokens (decaying those has no reason)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        keep = p.dim() < 2 or "state0" in name or "persistent" in name
        (no_decay if keep else decay).append(p)
    groups = [
        {"params": decay, "weight_decay": config.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=config.lr, betas=(0.9, 0.95))


def loss_of(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the scored positions (labels != -100). logits [B, T, V]."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE)


def _inputs(batch, device) -> tuple[torch.Tensor, torch.Tensor]:
    return batch.inputs.to(device), batch.labels.to(device)


@torch.no_grad()
def evaluate_model(
    model: LanguageModel, task: Task, *, batches: int, batch_size: int, device="cpu"
) -> dict[str, float]:
    """The mean of `task.metrics` over validation batches 0..batches-1."""
    was_training = model.training
    model.eval()
    totals: dict[str, float] = {}
    for i in range(batches):
        inputs, labels = _inputs(task.batch("valid", i, batch_size), device)
        for name, value in task.metrics(model(inputs), labels).items():
            totals[name] = totals.get(name, 0.0) + float(value)
    model.train(was_training)
    return {name: value / batches for name, value in totals.items()}


def _task_info(task: Task) -> dict[str, Any]:
    """What a checkpoint records of its task. `options` (the tasks of miras.tasks have them:
    `make_task(name, **options)` rebuilds the task) is absent for other task objects."""
    info = {
        "name": str(getattr(task, "name", type(task).__name__)),
        "vocab_size": int(task.vocab_size),
        "seq_len": int(task.seq_len),
    }
    options = getattr(task, "options", None)
    if callable(options):
        info["options"] = dict(options())
    return info


# Checkpoints and metrics --------------------------------------------------------------------


def save_atomic(payload: dict[str, Any], path: Path) -> None:
    """torch.save to a temporary file beside `path`, flushed to disk, then os.replace: a
    reader (or a run killed mid-write) sees the old checkpoint or the new one, never half."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Read a checkpoint (tensors and plain data only: weights_only loading)."""
    path = Path(path)
    if path.is_dir():
        path = path / CHECKPOINT
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint: no such file {path}")
    return torch.load(path, map_location="cpu", weights_only=True)


def _rng_state() -> dict[str, Any]:
    """torch's generators (batches come from the task by index, not from these)."""
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _append_json(path: Path, record: dict[str, Any]) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


def _truncate_metrics(path: Path, step: int) -> None:
    """Drop records written after the checkpoint's step (a run killed after it), and a line
    cut short by a kill in the middle of an append, atomically."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and record.get("step", 0) <= step:
            kept.append(line)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
    os.replace(tmp, path)


# Training -----------------------------------------------------------------------------------


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C stopped a run. `checkpoint`: the run's checkpoint file (None when it has none),
    `step`: that checkpoint's step, `saved`: whether it was written at the interrupt (False:
    the checkpoint written before it stands). A KeyboardInterrupt, so callers that stop on
    Ctrl-C still do."""

    def __init__(self, step: int | None, checkpoint: Path | None, saved: bool):
        self.step, self.checkpoint, self.saved = step, checkpoint, saved
        if checkpoint is None:
            text = "interrupted before the run wrote a checkpoint: nothing was saved"
        else:
            what = "saved the checkpoint" if saved else "the last checkpoint is"
            text = f"interrupted: {what} {checkpoint} (step {step})"
        super().__init__(text)


def train(
    spec: Spec | str | dict,
    task: Task,
    *,
    steps: int = 1000,
    batch_size: int = 32,
    lr: float = 3e-3,
    warmup: int = 100,
    weight_decay: float = 0.1,
    grad_clip: float = 1.0,
    seed: int = 0,
    eval_every: int = 100,
    eval_batches: int = 4,
    out_dir: str | Path | None = None,
    resume: bool = False,
    extend: bool = False,
    callback: Callable[[int, dict[str, float]], None] | None = None,
    progress: bool = True,
    log_every: int = 10,
    time_limit: float | None = None,
    device: str | None = None,
) -> TrainResult:
    """Train the spec's model (its `model:` section) on `task`; returns the final evaluation.

    Every `eval_every` steps (and at the end) the model is scored on `eval_batches` validation
    batches; the record is appended to `out_dir/metrics.jsonl`, a checkpoint is written
    atomically to `out_dir/checkpoint.pt`, then `callback(step, metrics)` runs (it may raise,
    e.g. optuna.TrialPruned, to stop the run). `resume=True` continues from the checkpoint in
    `out_dir` exactly (same parameters and losses as an uninterrupted run); without one it
    starts fresh. `extend=True` (with `resume`) lets `steps` exceed the checkpoint's: the
    cosine schedule is re-planned over the new total, so the result is not bit-exact with a
    run planned that long. `time_limit` (seconds) ends training early, after a final
    evaluation. `out_dir` is created once the first step has succeeded.

    A NaN or infinite loss or gradient norm raises `TrainingDiverged` naming the step.
    Ctrl-C (in the main thread, with `out_dir`) stops at the end of the step in progress,
    saves a checkpoint there and raises `TrainingInterrupted`; a second Ctrl-C stops at once.
    """
    spec = load_spec(spec)
    config = TrainConfig(steps, batch_size, lr, warmup, weight_decay, grad_clip, seed)
    if eval_every < 1 or eval_batches < 1 or log_every < 1:
        raise ValueError(
            f"eval_every, eval_batches, log_every: expected integers >= 1, got "
            f"{eval_every}, {eval_batches}, {log_every}"
        )
    if extend and not resume:
        raise ValueError("extend: continues a checkpoint; pass it with resume=True (--resume)")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    out = Path(out_dir) if out_dir is not None else None
    checkpoint = _previous_checkpoint(out, resume)

    torch.manual_seed(seed)
    model = build_model(spec, task.vocab_size).to(device)
    optimizer = make_optimizer(model, config)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, config.warmup, config.steps)
    )
    start, losses, history, extensions, event = 0, [], [], [], "start"
    if checkpoint is not None:
        planned = _check_resumable(checkpoint, spec, config, task, extend)
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        scheduler.load_state_dict(checkpoint["scheduler"])
        _set_rng_state(checkpoint["rng"])
        start, losses = checkpoint["step"], list(checkpoint["losses"])
        history = [dict(h) for h in checkpoint["history"]]
        extensions = [dict(e) for e in checkpoint.get("extensions", [])]
        event = "resume"
        if planned != config.steps:
            # The loaded rate is the old schedule's at `start`; the next step takes the new
            # one's (the scheduler computes each later rate from base_lrs and the new total).
            factor = lr_factor(start, config.warmup, config.steps)
            for group, base in zip(optimizer.param_groups, scheduler.base_lrs, strict=True):
                group["lr"] = base * factor
            extensions.append({"step": start, "from_steps": planned, "to_steps": config.steps})
            event = "extend"

    def record(entry: dict[str, Any]) -> None:
        if out is not None:
            _append_json(out / METRICS, entry)

    saved_step = start if checkpoint is not None else None  # the checkpoint on disk

    def save(step: int, rng: dict[str, Any]) -> None:
        nonlocal saved_step
        if out is None:
            return
        payload = {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "step": step,
            "rng": rng,
            "losses": losses,
            "history": history,
            "spec": spec.normalized(),
            "config": asdict(config),
            "task": _task_info(task),
            "extensions": extensions,
        }
        save_atomic(payload, out / CHECKPOINT)
        saved_step = step

    def begin() -> None:
        """The first step of this call succeeded: only now the run directory is made, so a
        start that fails (a spec that cannot run, a bad option) leaves nothing behind."""
        if out is None:
            return
        out.mkdir(parents=True, exist_ok=True)
        if checkpoint is None:
            (out / METRICS).unlink(missing_ok=True)
        else:
            _truncate_metrics(out / METRICS, start)
        run = {"spec": spec.name, "task": _task_info(task), "config": asdict(config)}
        record({"step": start, "split": "run", "event": event, **run})

    parameters = sum(p.numel() for p in model.parameters())
    bar = _Progress(progress, config.steps, start, task.primary_metric, log_every)
    began = time.perf_counter()
    model.train()
    step = start
    clean: int | None = start  # the step whose state the model holds, None mid-update
    rng = _rng_state()

    def interrupted() -> TrainingInterrupted:
        """Save the state at `clean` when it is newer than the checkpoint on disk."""
        saved = clean is not None and clean > start and clean != saved_step
        if saved:
            save(clean, rng)
            record({"step": clean, "split": "run", "event": "interrupted"})
        where = out / CHECKPOINT if out is not None and saved_step is not None else None
        return TrainingInterrupted(saved_step, where, saved)

    try:
        with bar, _DeferredInterrupt(out is not None) as stop:
            while step < config.steps:
                clean, rng = step, _rng_state()
                if stop.requested:
                    raise interrupted()
                tick = time.perf_counter()
                inputs, labels = _inputs(task.batch("train", step, config.batch_size), device)
                logits = model(inputs)
                loss = loss_of(logits, labels)
                if not torch.isfinite(loss):
                    raise TrainingDiverged(step + 1, "training loss", loss.item())
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
                if not torch.isfinite(norm):
                    raise TrainingDiverged(step + 1, "gradient norm", norm.item())
                clean = None  # an interrupt from here to the step's end finds half an update
                optimizer.step()
                scheduler.step()
                losses.append(loss.item())
                step += 1
                if step == start + 1:
                    begin()
                out_of_time = time_limit is not None and time.perf_counter() - began > time_limit
                speed = inputs.numel() / max(time.perf_counter() - tick, 1e-9)
                if step % log_every == 0:
                    train_metrics = task.metrics(logits.detach(), labels)
                    bar.update(step, losses[-1], train_metrics.get(task.primary_metric), speed)
                    record(
                        {
                            "step": step,
                            "split": "train",
                            "loss": losses[-1],
                            "grad_norm": norm.item(),
                            "lr": scheduler.get_last_lr()[0],
                            "tokens_per_s": speed,
                        }
                    )
                else:
                    bar.update(step, losses[-1], None, speed)
                if step % eval_every == 0 or step == config.steps or out_of_time:
                    metrics = evaluate_model(
                        model,
                        task,
                        batches=eval_batches,
                        batch_size=config.batch_size,
                        device=device,
                    )
                    entry = {"step": step, "split": "valid", **metrics}
                    entry["seconds"] = time.perf_counter() - began
                    history.append(entry)
                    record(entry)
                    save(step, _rng_state())
                    bar.evaluated(step, metrics)
                    if callback is not None:
                        callback(step, metrics)
                if out_of_time:
                    break
    except KeyboardInterrupt as error:
        if isinstance(error, TrainingInterrupted) or out is None:
            raise
        raise interrupted() from None
    final = {k: v for k, v in history[-1].items() if k not in ("step", "split", "seconds")}
    return TrainResult(
        metrics=final,
        history=history,
        losses=losses,
        steps=step,
        parameters=parameters,
        seconds=time.perf_counter() - began,
        out_dir=out,
    )


class _DeferredInterrupt:
    """While active (a run with a directory, in the main thread, under Python's default Ctrl-C
    handler), the first Ctrl-C only sets `requested`: the run stops at the next step boundary,
    where its state is consistent, and saves it there. A second Ctrl-C interrupts at once."""

    def __init__(self, enabled: bool):
        self.requested = False
        self.active = (
            enabled
            and threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGINT) is signal.default_int_handler
        )

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        print(
            "\nCtrl-C: stopping after this step to save a checkpoint (Ctrl-C again: stop now)",
            file=sys.stderr,
            flush=True,
        )

    def __enter__(self) -> _DeferredInterrupt:
        if self.active:
            signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.active:
            signal.signal(signal.SIGINT, signal.default_int_handler)


def _previous_checkpoint(out: Path | None, resume: bool) -> dict[str, Any] | None:
    if out is None:
        if resume:
            raise ValueError("resume: needs out_dir, the directory holding checkpoint.pt")
        return None
    path = out / CHECKPOINT
    if resume:
        return load_checkpoint(path) if path.is_file() else None
    if path.is_file():
        raise ValueError(
            f"out_dir: {out} already holds a checkpoint; pass resume=True (--resume) to "
            "continue it, or choose another directory"
        )
    return None


def _check_resumable(
    checkpoint: dict[str, Any], spec: Spec, config: TrainConfig, task: Task, extend: bool
) -> int:
    """A resumed run continues exactly only with the same spec, settings and task; `extend`
    lets `steps` grow. Returns the steps the checkpoint's schedule was planned for."""
    problems = []
    if checkpoint["spec"] != spec.normalized():
        problems.append("the spec (or its model section) differs from the checkpoint's")
    planned = checkpoint["config"]["steps"]
    for name, value in asdict(config).items():
        used = checkpoint["config"].get(name)
        if name == "steps" and extend:
            if value < planned:
                problems.append(
                    f"steps: extend trains past the checkpoint's {planned} steps, got {value}"
                )
        elif used != value:
            hint = ""
            if name == "steps" and value > used:
                hint = " (to train longer, add extend=True / --extend: not bit-exact)"
            problems.append(f"{name}: the checkpoint used {used}{hint}")
    recorded = checkpoint["task"]
    for name, value in _task_info(task).items():
        if name == "options" and name not in recorded:
            continue  # a checkpoint from before the options were recorded
        if recorded.get(name) != value:
            problems.append(f"task {name}: the checkpoint used {recorded.get(name)}")
    if problems:
        raise ValueError("resume: cannot continue exactly: " + "; ".join(problems))
    return planned


def recorded_task(
    checkpoint: str | Path | dict[str, Any],
    name: str | None = None,
    options: dict[str, Any] | None = None,
) -> tuple[Task, list[str]]:
    """The task a checkpoint trained on (a miras.tasks task), rebuilt from its record, with
    `options` replacing recorded ones. A `name` other than the recorded task's builds that
    task from its defaults and `options`. Returns the task and notes saying what was assumed
    (a checkpoint from before task options were recorded falls back to the defaults)."""
    from miras.tasks import TASKS, make_task

    data = checkpoint if isinstance(checkpoint, dict) else load_checkpoint(checkpoint)
    recorded = data["task"]
    trained_on = recorded["name"]
    options = dict(options or {})
    if name is not None and name != trained_on:
        note = (
            f"the run trained on task '{trained_on}'; scoring it on '{name}' with that task's "
            "defaults" + (" and the given options" if options else "")
        )
        return make_task(name, **options), [note]
    if trained_on not in TASKS:
        raise ValueError(
            f"task: the checkpoint's task '{trained_on}' is not a built-in task "
            f"({', '.join(TASKS)}); name the task to score on (--task)"
        )
    if "options" not in recorded:
        note = (
            "the checkpoint does not record its task's options (it was written before they "
            "were); using the task's defaults" + (" and the given options" if options else "")
        )
        return make_task(trained_on, **options), [note]
    notes = [
        f"option {key}: {value!r} instead of the run's {recorded['options'][key]!r}"
        for key, value in options.items()
        if key in recorded["options"] and recorded["options"][key] != value
    ]
    return make_task(trained_on, **{**recorded["options"], **options}), notes


def evaluate(
    checkpoint: str | Path | dict[str, Any],
    task: Task | None = None,
    *,
    batches: int = 8,
    batch_size: int | None = None,
    device: str | None = None,
) -> dict[str, float]:
    """Score the model of a checkpoint (a file, its directory or the loaded dict) on `batches`
    validation batches of `task` (the batch size it trained with by default). Without `task`,
    the one it trained on, with the recorded options (`recorded_task`; its notes become
    warnings)."""
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
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = build_model(load_spec(data["spec"]), vocab).to(device)
    model.load_state_dict(data["model"])
    size = batch_size or data["config"]["batch_size"]
    return evaluate_model(model, task, batches=batches, batch_size=size, device=device)


class _Progress:
    """Training progress on stderr. On a terminal, a rich bar with the loss, the task's metric
    (on the training batch) and tokens per second. Elsewhere (a log file, a pipe, a batch job)
    plain lines, flushed: one every `every` steps (about a tenth of the run, a multiple of
    `log_every`, where the metric is computed) and one per evaluation. Silent when disabled."""

    def __init__(
        self,
        enabled: bool,
        total: int,
        start: int,
        metric: str,
        log_every: int,
        console: Console | None = None,
    ):
        self.total, self.metric, self.shown = total, metric, "-"
        self.console = console or Console(stderr=True)
        live = self.console.is_terminal or self.console.is_jupyter
        self.mode = "off" if not enabled else "bar" if live else "lines"
        self.every = log_every * max(1, round(total / 10 / log_every))
        self.began = time.perf_counter()
        if self.mode != "bar":
            return
        self.progress = Progress(
            TextColumn("train"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}"),
            TextColumn(f"{metric} {{task.fields[metric]}}"),
            TextColumn("{task.fields[speed]} tok/s"),
            TimeRemainingColumn(),
            console=self.console,
        )
        self.task = self.progress.add_task(
            "train", total=total, completed=start, loss="-", metric="-", speed="-"
        )

    def __enter__(self) -> _Progress:
        if self.mode == "bar":
            self.progress.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.mode == "bar":
            self.progress.__exit__(*exc)

    def update(self, step: int, loss: float, metric: float | None, speed: float) -> None:
        if metric is not None:
            self.shown = f"{metric:.3f}"
        if self.mode == "bar":
            self.progress.update(
                self.task,
                completed=step,
                loss=f"{loss:.4f}",
                metric=self.shown,
                speed=f"{speed:,.0f}",
            )
        elif self.mode == "lines" and step % self.every == 0:
            self._line(step, f"loss {loss:.4f}  {self.metric} {self.shown}  {speed:,.0f} tok/s")

    def evaluated(self, step: int, metrics: dict[str, float]) -> None:
        if self.mode == "lines":
            self._line(step, "valid  " + "  ".join(f"{k} {v:.4f}" for k, v in metrics.items()))

    def _line(self, step: int, text: str) -> None:
        seconds = int(time.perf_counter() - self.began)
        clock = f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"
        self.console.print(
            f"train step {step}/{self.total}  {text}  elapsed {clock}",
            highlight=False,
            markup=False,
            soft_wrap=True,
        )
        self.console.file.flush()
