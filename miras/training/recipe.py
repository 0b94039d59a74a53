"""Train a model built from a spec on a task (docs/training.md): `miras.train`, and the recipe
it runs.

    result = miras.train("specs/deltanet.yaml", make_task("mqar"), steps=500, batch_size=32)
    result.metrics        # the final evaluation: {"loss": ..., "accuracy": ...}

    recipe = TrainRecipe(spec, task, steps=500)   # the same run, a phase at a time
    recipe.setup()                                # model, optimizer, schedule, resume, ranks
    result = recipe.run()                         # steps, evaluations, checkpoints

AdamW, linear warmup then cosine decay to 10% of the peak rate, gradient clipping. Seeded and
deterministic: the model is initialized after `torch.manual_seed(seed)` and batch i of a split
is a function of (task seed, i), so a run resumed from its checkpoint continues exactly.
The model stays in float32 (float64 if asked), so the memory state is never below fp32;
`precision="bf16"` runs the projections under bf16 autocast, the memory rule still in float32.

The recipe's phases are methods (`setup`, `step`, `evaluate`, `checkpoint`, `run`); what is
not training proper is a collaborator: Ctrl-C (`miras.training.interrupts.Interrupts`), the
ranks under torchrun (`miras.training.distributed.Ranks`: the batch shard, the all-reduce,
rank 0's callback, a lost rank's message), the run's files (`miras.training.checkpoint.
RunFiles`), the progress display (`miras.training.progress.TrainProgress`). The settings and
their defaults are `miras.training.config.TrainConfig`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from miras.errors import ForwardDiverged, TrainingDiverged
from miras.models.model import build_model
from miras.resources import require, training_estimate
from miras.spec import Spec, load_spec
from miras.tasks.base import IGNORE, Task
from miras.training import distributed
from miras.training.checkpoint import (
    RunFiles,
    check_resumable,
    previous_checkpoint,
    recorded_setting,
    rng_state,
    set_rng_state,
    task_info,
    task_io,
)
from miras.training.config import RANK_TIMEOUT, TrainConfig
from miras.training.evaluation import autocast, batch_inputs, evaluate_model
from miras.training.interrupts import Interrupts, TrainingInterrupted
from miras.training.progress import TrainProgress

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


def reached(threshold: float | None, task: Task, metrics: dict[str, float]) -> bool:
    """Whether an evaluation's primary metric reached the early-stopping `threshold` in the
    task's direction (None: never; a missing or NaN metric: not reached)."""
    value = metrics.get(task.primary_metric, math.nan)
    if threshold is None or not math.isfinite(value):
        return False
    return value >= threshold if task.higher_is_better else value <= threshold


def _metrics(entry: dict[str, Any]) -> dict[str, float]:
    """An evaluation record's metrics: without its step, split and seconds."""
    return {k: v for k, v in entry.items() if k not in ("step", "split", "seconds")}


# The recipe ---------------------------------------------------------------------------------


@dataclass
class StepOutcome:
    """What `TrainRecipe.step` tells the loop: whether an evaluation is due after it and
    whether the time limit has passed (on any rank: the flag is all-reduced)."""

    evaluate: bool
    out_of_time: bool


@dataclass(frozen=True)
class RunOptions:
    """What a call of `miras.train` asks besides the training settings: its keywords
    (`train`'s docstring)."""

    out_dir: str | Path | None = None
    resume: bool = False
    extend: bool = False
    callback: Callable[[int, dict[str, float]], None] | None = None
    progress: bool = True
    time_limit: float | None = None
    device: str | None = None
    rank_timeout: float = RANK_TIMEOUT


class TrainRecipe:
    """One call of `miras.train`, phase by phase: `setup` (the model, optimizer and schedule,
    a checkpoint resumed, the ranks joined), `step` (one optimizer step), `evaluate` (score,
    share, record), `checkpoint` (save the state at a step) and `run` (the loop: steps,
    evaluations every `eval_every` steps and at the end, early stopping, the time limit,
    Ctrl-C, a lost rank). The arguments are `miras.train`'s, its keywords other than the
    settings gathered in `RunOptions`; they are checked here, before anything is loaded."""

    def __init__(
        self,
        spec: Spec | str | dict,
        task: Task,
        config: TrainConfig | Mapping[str, Any] | None = None,
        options: RunOptions | None = None,
        /,
        **settings: Any,
    ):
        self.spec = load_spec(spec)
        self.config = TrainConfig.make(config, **settings)
        self.options = options = options or RunOptions()
        if options.extend and not options.resume:
            raise ValueError("extend: continues a checkpoint; pass it with resume=True (--resume)")
        self.task = task
        self.out = Path(options.out_dir) if options.out_dir is not None else None
        self.ready = False  # setup done

    # setup --------------------------------------------------------------------------------

    def setup(self) -> None:
        """Resolve the settings against a resumed checkpoint, join the ranks, refuse a run that
        would not fit, build the model, optimizer and schedule (loading the checkpoint's
        states), and make the collaborators: the run's files, progress and Ctrl-C handling."""
        self.previous = previous_checkpoint(self.out, self.options.resume)
        if self.previous is not None:
            # Warmup and precision left to their defaults keep the run's own when resumed, so
            # extending `steps` does not move the warmup and a bf16 run stays bf16.
            kept = {
                name: recorded_setting(self.previous, name)
                for name in ("warmup", "precision")
                if getattr(self.config, name) is None
            }
            self.config = self.config.model_copy(update=kept)
        config, task = self.config, self.task
        self.precision = config.precision_name
        self.ranks, self.device = distributed.join(self.options.device, self.options.rank_timeout)
        self.rows = self.ranks.shard(config.batch_size)  # this rank's rows of a global batch
        # Refuse, with the sizes to lower, a run whose model, states and activations would
        # not fit.
        need = training_estimate(
            self.spec,
            batch_size=len(range(config.batch_size)[self.rows]),
            seq_len=task.seq_len,
            vocab_size=task.vocab_size,
        )
        require(need, "training", self.device)
        torch.manual_seed(config.seed)
        io = task_io(task, self.spec.model.d_model)
        self.model = build_model(self.spec, task.vocab_size, io).to(self.device)
        self.optimizer = make_optimizer(self.model, config)
        warmup = config.warmup_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_factor(s, warmup, config.steps)
        )
        self.start, self.losses, self.history, self.extensions = 0, [], [], []
        self.event = "start"
        if self.previous is not None:
            self._load(self.previous)
        self.net = self.model  # what the training step runs: DDP's wrapper on several ranks
        if self.ranks.world > 1:
            index = [self.device.index] if self.device.type == "cuda" else None
            self.net = torch.nn.parallel.DistributedDataParallel(self.model, device_ids=index)
        self.files = RunFiles(self.out, self.ranks.main)
        self.saved_step = self.start if self.previous is not None else None  # on disk
        self.parameters = sum(p.numel() for p in self.model.parameters())
        show = self.options.progress and self.ranks.main
        self.bar = TrainProgress(
            show, config.steps, self.start, task.primary_metric, config.log_every
        )
        if self.ranks.world > 1 and show:
            text = self.ranks.describe(config.batch_size)
            self.bar.console.print(text, highlight=False, markup=False)
        self.began = time.perf_counter()
        self.model.train()
        self.at = self.start  # the steps done
        self.interrupts = Interrupts(self.out is not None, self.ranks.world, self.start)
        self.stopped: int | None = None  # the evaluation step at which early_stop ended the run
        self.ready = True

    def _load(self, checkpoint: dict[str, Any]) -> None:
        """Continue `checkpoint`: its states, losses, history and extensions; a larger `steps`
        with `extend` re-plans the schedule from its step on."""
        config = self.config
        planned = check_resumable(checkpoint, self.spec, config, self.task, self.options.extend)
        self.model.load_state_dict(checkpoint["model"])
        self.optimizer.load_state_dict(checkpoint["optimizer"])
        self.scheduler.load_state_dict(checkpoint["scheduler"])
        set_rng_state(checkpoint["rng"])
        self.start, self.losses = checkpoint["step"], list(checkpoint["losses"])
        self.history = [dict(h) for h in checkpoint["history"]]
        self.extensions = [dict(e) for e in checkpoint.get("extensions", [])]
        self.event = "resume"
        if planned != config.steps:
            # The loaded rate is the old schedule's at `start`; the next step takes the new
            # one's (the scheduler computes each later rate from base_lrs and the new total).
            factor = lr_factor(self.start, config.warmup_steps, config.steps)
            groups = zip(self.optimizer.param_groups, self.scheduler.base_lrs, strict=True)
            for group, base in groups:
                group["lr"] = base * factor
            self.extensions.append(
                {"step": self.start, "from_steps": planned, "to_steps": config.steps}
            )
            self.event = "extend"

    # one step -----------------------------------------------------------------------------

    def step(self) -> StepOutcome:
        """One optimizer step on this rank's rows of global batch `at`, from a whole state:
        the loss and gradient norm checked finite, the loss all-reduced with the Ctrl-C and
        time-limit flags, a training record every `log_every` steps. A pending Ctrl-C stops
        before the step (`TrainingInterrupted`, with the state saved)."""
        config, task, ranks, device = self.config, self.task, self.ranks, self.device
        self.interrupts.between_steps(self.at)
        if self.interrupts.pending:
            raise self._interrupted()
        tick = time.perf_counter()
        batch = task.batch("train", self.at, config.batch_size)
        inputs, labels = batch_inputs(batch, device, self.rows)
        try:
            with autocast(self.precision, device):
                logits = self.net(inputs)
        except ForwardDiverged as err:  # a memory layer's output (or input) went non-finite
            raise TrainingDiverged(self.at + 1, "forward pass", math.nan, str(err)) from None
        # This rank's mean, weighted by its share of the global batch's scored positions:
        # the ranks' parts add up to the global batch's mean loss.
        part = loss_of(logits, labels)
        if ranks.world > 1:
            scored = max(1, int((batch.labels != IGNORE).sum()))
            mine = int((labels != IGNORE).sum())
            # Rows with nothing scored: a zero that keeps the graph (DDP waits for every
            # rank's gradients), not the 0/0 of an empty mean.
            part = part * (mine / scored) if mine else logits.sum() * 0.0
        limit = self.options.time_limit
        late = limit is not None and time.perf_counter() - self.began > limit
        flags = [part.item(), self.interrupts.local, late]  # on the device: nccl needs it
        flags = torch.tensor(flags, dtype=torch.float64, device=device)
        loss, requested, out_of_time = ranks.sum(flags).tolist()
        self.interrupts.shared, out_of_time = requested > 0, out_of_time > 0
        if not math.isfinite(loss):
            raise TrainingDiverged(self.at + 1, "training loss", loss)
        self.optimizer.zero_grad(set_to_none=True)
        # DDP averages the ranks' gradients: R x part makes it the global mean's.
        (part * ranks.world if ranks.world > 1 else part).backward()
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), config.grad_clip)
        if not torch.isfinite(norm):
            raise TrainingDiverged(self.at + 1, "gradient norm", norm.item())
        self.interrupts.mid_update()  # an interrupt from here to the step's end: half an update
        self.optimizer.step()
        self.scheduler.step()
        self.losses.append(loss)
        self.at += 1
        if self.at == self.start + 1:
            self._begin()
        speed = batch.labels.numel() / max(time.perf_counter() - tick, 1e-9)  # B T
        self._log(logits, labels, norm, speed)
        due = self.at % config.eval_interval == 0 or self.at == config.steps or out_of_time
        return StepOutcome(evaluate=due, out_of_time=out_of_time)

    def _begin(self) -> None:
        """The first step of this call succeeded: the run directory and its first record."""
        task, config = self.task, self.config
        header = {"spec": self.spec.name, "task": task_info(task), "config": config.trajectory()}
        resumed_at = self.start if self.previous is not None else None
        record = {"step": self.start, "split": "run", "event": self.event, **header}
        self.files.begin(task, resumed_at, record)

    def _log(self, logits, labels, norm: torch.Tensor, speed: float) -> None:
        """Progress after a step; every `log_every` steps the training record, with the
        metric of rank 0's rows of the training batch."""
        step, loss = self.at, self.losses[-1]
        if step % self.config.log_every:
            self.bar.update(step, loss, None, speed)
            return
        train_metrics = self.task.metrics(logits.detach().float(), labels)
        self.bar.update(step, loss, train_metrics.get(self.task.primary_metric), speed)
        self.files.record(
            {
                "step": step,
                "split": "train",
                "loss": loss,
                "grad_norm": norm.item(),
                "lr": self.scheduler.get_last_lr()[0],
                "tokens_per_s": speed,
            }
        )

    # evaluation and checkpoints -------------------------------------------------------------

    def evaluate(self) -> dict[str, Any]:
        """Score the model at step `at` (rank 0, on the full validation batches; the other
        ranks wait for its record, within rank_timeout), share the record with every rank,
        add it to the history and the metrics log. Returns the record."""
        entry = None
        if self.ranks.main:
            metrics = evaluate_model(
                self.model,
                self.task,
                batches=self.config.eval_batches,
                batch_size=self.config.batch_size,
                device=self.device,
                precision=self.precision,
            )
            entry = {"step": self.at, "split": "valid", **metrics}
            entry["seconds"] = time.perf_counter() - self.began
        entry = self.ranks.share(entry)
        self.history.append(entry)
        self.files.record(entry)
        return entry

    def checkpoint(self, step: int, rng: dict[str, Any]) -> None:
        """Save the run's state as of `step` (torch's RNG state `rng` there): rank 0 writes,
        every rank knows the step on disk. Nothing without a directory."""
        if self.out is None:
            return
        if self.files.main:
            self.files.save(
                {
                    "model": self.model.state_dict(),
                    "optimizer": self.optimizer.state_dict(),
                    "scheduler": self.scheduler.state_dict(),
                    "step": step,
                    "rng": rng,
                    "losses": self.losses,
                    "history": self.history,
                    "spec": self.spec.normalized(),
                    "config": self.config.trajectory(),
                    "task": task_info(self.task),
                    "extensions": self.extensions,
                }
            )
        self.saved_step = step

    def _after_evaluation(self, entry: dict[str, Any]) -> bool:
        """The checkpoint, then the callback and early stopping: whether the run ends here."""
        self.checkpoint(self.at, rng_state())
        metrics = _metrics(entry)
        self.bar.evaluated(self.at, metrics)
        callback = self.options.callback
        if callback is not None and self.ranks.callback_stopped(callback, self.at, metrics):
            return True  # rank 0's callback raised: the other ranks end here
        if reached(self.config.early_stop, self.task, metrics):
            # Every rank holds the shared record, so all stop at this step.
            self.stopped = self.at
            self.files.record({"step": self.at, "split": "run", "event": "early_stop"})
            return True
        return False

    def _interrupted(self) -> TrainingInterrupted:
        """Save the state of the last whole step when it is newer than the checkpoint on
        disk; the error that says where the run stands."""
        clean = self.interrupts.clean
        saved = clean is not None and clean > self.start and clean != self.saved_step
        if saved:
            self.checkpoint(clean, self.interrupts.rng)
            self.files.record({"step": clean, "split": "run", "event": "interrupted"})
        where = self.files.checkpoint if self.saved_step is not None else None
        return TrainingInterrupted(self.saved_step, where, saved)

    # the loop -----------------------------------------------------------------------------

    def run(self) -> TrainResult:
        """`setup` (unless done), then steps to `steps`, evaluating every `eval_every` steps
        and at the end; returns the final evaluation."""
        if not self.ready:
            self.setup()
        ranks = self.ranks
        try:
            with self.bar, self.interrupts, distributed.TerminateRaises(ranks.world > 1):
                while self.at < self.config.steps:
                    outcome = self.step()
                    if outcome.evaluate and self._after_evaluation(self.evaluate()):
                        break
                    if outcome.out_of_time:
                        break
        except KeyboardInterrupt as error:
            if isinstance(error, TrainingInterrupted) or self.out is None:
                raise
            raise self._interrupted() from None
        except (RuntimeError, distributed.Terminated) as error:
            failure = ranks.failure(error, self.files.checkpoint)
            if failure is None:
                raise
            raise failure from error
        finally:
            ranks.close()
        final = _metrics(self.history[-1])
        if self.stopped is not None:
            final["stopped_at"] = float(self.stopped)  # early_stop: the step that reached it
        return TrainResult(
            metrics=final,
            history=self.history,
            losses=self.losses,
            steps=self.at,
            parameters=self.parameters,
            seconds=time.perf_counter() - self.began,
            out_dir=self.out,
        )


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
    `rank_timeout` seconds makes the others raise `miras.training.RankFailure` naming the
    last checkpoint.
    """
    options = RunOptions(
        out_dir=out_dir,
        resume=resume,
        extend=extend,
        callback=callback,
        progress=progress,
        time_limit=time_limit,
        device=device,
        rank_timeout=rank_timeout,
    )
    recipe = TrainRecipe(spec, task, config, options, **settings)
    recipe.setup()
    return recipe.run()
