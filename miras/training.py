"""Train and evaluate a model built from a spec on a task (docs/training.md).

    result = miras.train("specs/deltanet.yaml", make_task("mqar"), steps=500, batch_size=32)
    result.metrics        # the final evaluation: {"loss": ..., "accuracy": ...}
    metrics = miras.evaluate("runs/x/checkpoint.pt")  # on the task (and options) it trained on

AdamW, linear warmup then cosine decay to 10% of the peak rate, gradient clipping. Seeded and
deterministic: the model is initialized after `torch.manual_seed(seed)` and batch i of a split
is a function of (task seed, i), so a run resumed from its checkpoint continues exactly.
The model stays in float32 (float64 if asked), so the memory state is never below fp32;
`precision="bf16"` runs the projections under bf16 autocast, the memory rule still in float32.
Ctrl-C saves a checkpoint at the step it stops at (`TrainingInterrupted`). Under torchrun the
ranks share each global batch and rank 0 writes the files (`miras.distributed`).

The module is the loop; the settings and their defaults are `miras.training_config.TrainConfig`,
the run's files (checkpoint, metrics log, resume checks) are `miras.checkpoint`.
"""

from __future__ import annotations

import math
import re
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable, Mapping
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from miras import distributed
from miras.checkpoint import (
    CHECKPOINT,
    METRICS,
    append_json,
    check_io,
    check_resumable,
    load_checkpoint,
    previous_checkpoint,
    recorded_setting,
    recorded_task,
    rng_state,
    save_atomic,
    set_rng_state,
    task_info,
    task_io,
    truncate_metrics,
)
from miras.errors import ForwardDiverged, TrainingDiverged
from miras.models.model import LanguageModel, build_model
from miras.resources import require, training_estimate
from miras.spec import Spec, load_spec
from miras.tasks.base import IGNORE, Task
from miras.training_config import RANK_TIMEOUT, TrainConfig

__all__ = [
    "CHECKPOINT",
    "METRICS",
    "TrainConfig",
    "TrainResult",
    "TrainingInterrupted",
    "evaluate",
    "load_checkpoint",
    "recorded_task",
    "save_atomic",
    "train",
]
MIN_LR_RATIO = 0.1  # cosine decay ends at 10% of the peak learning rate


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


def _inputs(batch, device, rows: slice = slice(None)) -> tuple[torch.Tensor, torch.Tensor]:
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
            inputs, labels = _inputs(part.batch(split, i, batch_size), device)
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
    config: TrainConfig | Mapping[str, Any] | None = None,
    *,
    out_dir: str | Path | None = None,
    resume: bool = False,
    extend: bool = False,
    callback: Callable[[int, dict[str, float]], None] | None = None,
    progress: bool = True,
    time_limit: float | None = None,
    device: str | None = None,
    rank_timeout: float = RANK_TIMEOUT,
    **settings: Any,
) -> TrainResult:
    """Train the spec's model (its `model:` section) on `task`; returns the final evaluation.

    The training settings are `config` (a TrainConfig or a mapping) with `settings` (keywords
    named like its fields: steps, batch_size, lr, warmup, weight_decay, grad_clip, seed,
    eval_every, eval_batches, log_every) replacing its values; TrainConfig holds the defaults.

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

    Under torchrun (WORLD_SIZE > 1) each of the R ranks trains on its batch_size / R rows of
    every global batch, DistributedDataParallel averages the gradients, and only rank 0
    evaluates, writes the files, shows progress and calls `callback` (when it raises, the
    other ranks stop at that step too and return). A rank that dies or stops answering for
    `rank_timeout` seconds makes the others raise `miras.distributed.RankFailure` naming the
    last checkpoint.
    """
    spec = load_spec(spec)
    config = TrainConfig.make(config, **settings)
    if extend and not resume:
        raise ValueError("extend: continues a checkpoint; pass it with resume=True (--resume)")
    out = Path(out_dir) if out_dir is not None else None
    checkpoint = previous_checkpoint(out, resume)
    if checkpoint is not None:
        # Warmup and precision left to their defaults keep the run's own when resumed, so
        # extending `steps` does not move the warmup and a bf16 run stays bf16.
        kept = {
            name: recorded_setting(checkpoint, name)
            for name in ("warmup", "precision")
            if getattr(config, name) is None
        }
        config = config.model_copy(update=kept)
    warmup, eval_every, log_every = config.warmup_steps, config.eval_interval, config.log_every
    precision = config.precision_name
    ranks, device = distributed.join(device, rank_timeout)
    rows = ranks.shard(config.batch_size)  # this rank's rows of every global batch
    # Refuse, with the sizes to lower, a run whose model, states and activations would not fit.
    need = training_estimate(
        spec,
        batch_size=len(range(config.batch_size)[rows]),
        seq_len=task.seq_len,
        vocab_size=task.vocab_size,
    )
    require(need, "training", device)
    torch.manual_seed(config.seed)
    model = build_model(spec, task.vocab_size, task_io(task, spec.model.d_model)).to(device)
    optimizer = make_optimizer(model, config)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, warmup, config.steps)
    )
    start, losses, history, extensions, event = 0, [], [], [], "start"
    if checkpoint is not None:
        planned = check_resumable(checkpoint, spec, config, task, extend)
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        scheduler.load_state_dict(checkpoint["scheduler"])
        set_rng_state(checkpoint["rng"])
        start, losses = checkpoint["step"], list(checkpoint["losses"])
        history = [dict(h) for h in checkpoint["history"]]
        extensions = [dict(e) for e in checkpoint.get("extensions", [])]
        event = "resume"
        if planned != config.steps:
            # The loaded rate is the old schedule's at `start`; the next step takes the new
            # one's (the scheduler computes each later rate from base_lrs and the new total).
            factor = lr_factor(start, warmup, config.steps)
            for group, base in zip(optimizer.param_groups, scheduler.base_lrs, strict=True):
                group["lr"] = base * factor
            extensions.append({"step": start, "from_steps": planned, "to_steps": config.steps})
            event = "extend"

    net = model  # what the training step runs: DDP's wrapper on several ranks
    if ranks.world > 1:
        net = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None
        )

    def record(entry: dict[str, Any]) -> None:
        if out is not None and ranks.main:
            append_json(out / METRICS, entry)

    saved_step = start if checkpoint is not None else None  # the checkpoint on disk

    def save(step: int, rng: dict[str, Any]) -> None:
        """Rank 0 writes; every rank knows the step on disk."""
        nonlocal saved_step
        if out is None:
            return
        if ranks.main:
            payload = {
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "step": step,
                "rng": rng,
                "losses": losses,
                "history": history,
                "spec": spec.normalized(),
                "config": config.trajectory(),
                "task": task_info(task),
                "extensions": extensions,
            }
            save_atomic(payload, out / CHECKPOINT)
        saved_step = step

    def begin() -> None:
        """The first step of this call succeeded: only now the run directory is made, so a
        start that fails (a spec that cannot run, a bad option) leaves nothing behind."""
        if out is None or not ranks.main:
            return
        out.mkdir(parents=True, exist_ok=True)
        task.save_files(out)  # a task's own files: the text task's tokenizer
        if checkpoint is None:
            (out / METRICS).unlink(missing_ok=True)
        else:
            truncate_metrics(out / METRICS, start)
        run = {"spec": spec.name, "task": task_info(task), "config": config.trajectory()}
        record({"step": start, "split": "run", "event": event, **run})

    parameters = sum(p.numel() for p in model.parameters())
    bar = _Progress(progress and ranks.main, config.steps, start, task.primary_metric, log_every)
    if ranks.world > 1 and progress and ranks.main:
        bar.console.print(ranks.describe(config.batch_size), highlight=False, markup=False)
    began = time.perf_counter()
    model.train()
    step = start
    clean: int | None = start  # the step whose state the model holds, None mid-update
    rng = rng_state()
    requested = False  # a Ctrl-C on any rank, as of the last step's all-reduce
    stopped: int | None = None  # the evaluation step at which early_stop ended the run

    def interrupted() -> TrainingInterrupted:
        """Save the state at `clean` when it is newer than the checkpoint on disk."""
        saved = clean is not None and clean > start and clean != saved_step
        if saved:
            save(clean, rng)
            record({"step": clean, "split": "run", "event": "interrupted"})
        where = out / CHECKPOINT if out is not None and saved_step is not None else None
        return TrainingInterrupted(saved_step, where, saved)

    try:
        with (
            bar,
            _DeferredInterrupt(out is not None) as stop,
            distributed.TerminateRaises(ranks.world > 1),
        ):
            while step < config.steps:
                clean, rng = step, rng_state()
                # One process stops at its own Ctrl-C; several stop together, at the step
                # after any of them saw one (the flag travels with the loss's all-reduce).
                if stop.requested if ranks.world == 1 else requested:
                    raise interrupted()
                tick = time.perf_counter()
                batch = task.batch("train", step, config.batch_size)
                inputs, labels = _inputs(batch, device, rows)
                try:
                    with autocast(precision, device):
                        logits = net(inputs)
                except ForwardDiverged as err:  # a memory layer's output (or input) went non-finite
                    raise TrainingDiverged(step + 1, "forward pass", math.nan, str(err)) from None
                # This rank's mean, weighted by its share of the global batch's scored
                # positions: the ranks' parts add up to the global batch's mean loss.
                part = loss_of(logits, labels)
                if ranks.world > 1:
                    scored = max(1, int((batch.labels != IGNORE).sum()))
                    mine = int((labels != IGNORE).sum())
                    # Rows with nothing scored: a zero that keeps the graph (DDP waits for
                    # every rank's gradients), not the 0/0 of an empty mean.
                    part = part * (mine / scored) if mine else logits.sum() * 0.0
                late = time_limit is not None and time.perf_counter() - began > time_limit
                flags = [part.item(), stop.requested, late]  # on the device: nccl needs it
                flags = torch.tensor(flags, dtype=torch.float64, device=device)
                loss, requested, out_of_time = ranks.sum(flags).tolist()
                requested, out_of_time = requested > 0, out_of_time > 0
                if not math.isfinite(loss):
                    raise TrainingDiverged(step + 1, "training loss", loss)
                optimizer.zero_grad(set_to_none=True)
                # DDP averages the ranks' gradients: R x part makes it the global mean's.
                (part * ranks.world if ranks.world > 1 else part).backward()
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
                if not torch.isfinite(norm):
                    raise TrainingDiverged(step + 1, "gradient norm", norm.item())
                clean = None  # an interrupt from here to the step's end finds half an update
                optimizer.step()
                scheduler.step()
                losses.append(loss)
                step += 1
                if step == start + 1:
                    begin()
                speed = batch.labels.numel() / max(time.perf_counter() - tick, 1e-9)  # B T
                if step % log_every == 0:
                    # The metric of rank 0's rows of the training batch.
                    train_metrics = task.metrics(logits.detach().float(), labels)
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
                    entry = None
                    if ranks.main:  # the others wait for its record (within rank_timeout)
                        metrics = evaluate_model(
                            model,
                            task,
                            batches=config.eval_batches,
                            batch_size=config.batch_size,
                            device=device,
                            precision=precision,
                        )
                        entry = {"step": step, "split": "valid", **metrics}
                        entry["seconds"] = time.perf_counter() - began
                    entry = ranks.share(entry)
                    history.append(entry)
                    record(entry)
                    save(step, rng_state())
                    metrics = {
                        k: v for k, v in entry.items() if k not in ("step", "split", "seconds")
                    }
                    bar.evaluated(step, metrics)
                    if callback is not None and _callback_stopped(ranks, callback, step, metrics):
                        break  # rank 0's callback raised: the other ranks end here
                    if reached(config.early_stop, task, metrics):
                        # Every rank holds the shared record, so all stop at this step.
                        stopped = step
                        record({"step": step, "split": "run", "event": "early_stop"})
                        break
                if out_of_time:
                    break
    except KeyboardInterrupt as error:
        if isinstance(error, TrainingInterrupted) or out is None:
            raise
        raise interrupted() from None
    except (RuntimeError, distributed.Terminated) as error:
        if ranks.world == 1 or not distributed.is_rank_failure(error, ranks):
            raise
        raise _rank_failure(ranks, error, out) from error
    finally:
        ranks.close()
    final = {k: v for k, v in history[-1].items() if k not in ("step", "split", "seconds")}
    if stopped is not None:
        final["stopped_at"] = float(stopped)  # early_stop: the step whose evaluation reached it
    return TrainResult(
        metrics=final,
        history=history,
        losses=losses,
        steps=step,
        parameters=parameters,
        seconds=time.perf_counter() - began,
        out_dir=out,
    )


def reached(threshold: float | None, task: Task, metrics: dict[str, float]) -> bool:
    """Whether an evaluation's primary metric reached the early-stopping `threshold` in the
    task's direction (None: never; a missing or NaN metric: not reached)."""
    value = metrics.get(task.primary_metric, math.nan)
    if threshold is None or not math.isfinite(value):
        return False
    return value >= threshold if task.higher_is_better else value <= threshold


def _callback_stopped(ranks, callback, step: int, metrics: dict[str, float]) -> bool:
    """Call `callback` on rank 0 and tell every rank whether it raised; rank 0 then re-raises
    its error (optuna's TrialPruned), the other ranks get True and stop."""
    error: BaseException | None = None
    if ranks.main:
        try:
            callback(step, metrics)
        except BaseException as raised:  # whatever it is, the other ranks must hear of it
            error = raised
    stopped = ranks.share(error is not None)
    if error is not None:
        raise error
    return stopped


def _rank_failure(
    ranks: distributed.Ranks, error: BaseException, out: Path | None
) -> distributed.RankFailure:
    """What a surviving rank says: who is gone and the checkpoint on disk (read back, since
    rank 0 may have died after writing one this rank has not heard of)."""
    path = out / CHECKPOINT if out is not None else None
    step = None
    if path is not None and path.is_file():
        step = load_checkpoint(path)["step"]
    # gloo's first line, without its source location and advice: "Read error [127.0.0.1]:
    # 46805: Connection reset by peer".
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    reason = re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", text).split(". ")[0]
    return distributed.RankFailure(
        ranks.rank, ranks.world, ranks.lost(), reason, path if step is not None else None, step
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
