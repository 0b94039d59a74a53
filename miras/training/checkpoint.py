"""A run's files: the checkpoint (written atomically), the metrics log, and what resuming
checks (docs/training.md).

    data = load_checkpoint("runs/x")          # a run directory or its checkpoint.pt
    model = load_model("runs/x")              # the trained model, in eval mode
    task, notes = recorded_task(data)         # the task it trained on, rebuilt
    files = RunFiles(out_dir, main=True)      # what a run writes there, as one rank sees it
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from miras.spec import Spec, load_spec
from miras.training.config import TrainConfig

if TYPE_CHECKING:
    from miras.models.model import LanguageModel
    from miras.tasks.base import Task

CHECKPOINT = "checkpoint.pt"
METRICS = "metrics.jsonl"
# Settings that checkpoints written before them lack, with the value those runs used.
UNRECORDED = {"precision": "fp32"}


def recorded_setting(checkpoint: dict[str, Any], name: str) -> Any:
    """A training setting of the checkpoint's run (`UNRECORDED`'s value for older ones)."""
    return checkpoint["config"].get(name, UNRECORDED.get(name))


def task_info(task: Task) -> dict[str, Any]:
    """What a checkpoint records of its task: its name, sizes and `options` (for a task of
    miras.tasks, `make_task(name, **options)` rebuilds it), and its `io_options` where it has
    an io of its own."""
    info = {
        "name": str(task.name),
        "vocab_size": int(task.vocab_size),
        "seq_len": int(task.seq_len),
        "options": dict(task.options()),
    }
    io = task.io_options()
    if io is not None:
        info["io"] = dict(io)
    return info


def task_io(task: Task, d_model: int) -> Any:
    """The task's (input layer, output layer) for a model of width `d_model` (`model_io`), or
    None: token ids through the model's embedding and tied head. The layers are rebuilt from
    the task, never read from a checkpoint: their frozen tables are not in its state dict."""
    return task.model_io(d_model)


def check_io(checkpoint: dict[str, Any], task: Task) -> None:
    """A model trained with a task's own io (frozen embeddings) scores only a task with the
    same io options; one trained on token ids only token-id tasks."""
    trained, scored = checkpoint["task"].get("io"), task.io_options()
    if trained == scored:
        return

    def said(io: dict[str, Any] | None) -> str:
        if io is None:
            return "token ids"
        return "the embeddings of " + ", ".join(f"{k}={v}" for k, v in io.items())

    raise ValueError(
        f"task: the checkpoint's model was trained on {said(trained)} (task "
        f"'{checkpoint['task']['name']}'); task '{task.name}' gives {said(scored)}: score it on a "
        "task with the same inputs"
    )


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


def load_model(run_dir: str | Path, device: str | torch.device = "cpu") -> LanguageModel:
    """The trained model of a run (its directory or its checkpoint.pt), in eval mode on
    `device`: the spec's model rebuilt for the recorded vocabulary, with the checkpoint's
    weights. A run whose task gave the model its own input and output layers rebuilds them
    from the recorded task."""
    from miras.models.model import build_model

    data = load_checkpoint(run_dir)
    spec = load_spec(data["spec"])
    io = None
    if data["task"].get("io") is not None:  # the layers are rebuilt, not stored
        task, _ = recorded_task(data)
        io = task.model_io(spec.model.d_model)
    model = build_model(spec, data["task"]["vocab_size"], io)
    model.load_state_dict(data["model"])
    return model.to(device).eval()


def rng_state() -> dict[str, Any]:
    """torch's generators (batches come from the task by index, not from these)."""
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def append_json(path: Path, record: dict[str, Any]) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


class RunFiles:
    """A run's directory (`out`, None: a run without files) as one rank sees it: rank 0
    (`main`) writes the metrics log and the checkpoint, the others write nothing. The
    directory is made only once the first step has succeeded (`begin`), so a start that fails
    (a spec that cannot run, a bad option) leaves nothing behind."""

    def __init__(self, out: Path | None, main: bool):
        self.out, self.main = out, main

    @property
    def checkpoint(self) -> Path | None:
        """Where the checkpoint is (or would be) written; None without a directory."""
        return self.out / CHECKPOINT if self.out is not None else None

    def record(self, entry: dict[str, Any]) -> None:
        """Append a record to metrics.jsonl (rank 0, with a directory)."""
        if self.out is not None and self.main:
            append_json(self.out / METRICS, entry)

    def begin(self, task: Task, resumed_at: int | None, header: dict[str, Any]) -> None:
        """The first step of this call succeeded: make the directory, write the task's own
        files (the text task's tokenizer), start a fresh log or cut a resumed one back to its
        checkpoint's step (`resumed_at`), and record `header` (the run event)."""
        if self.out is None or not self.main:
            return
        self.out.mkdir(parents=True, exist_ok=True)
        task.save_files(self.out)
        if resumed_at is None:
            (self.out / METRICS).unlink(missing_ok=True)
        else:
            truncate_metrics(self.out / METRICS, resumed_at)
        self.record(header)

    def save(self, payload: dict[str, Any]) -> None:
        """Write the checkpoint atomically (rank 0, with a directory)."""
        if self.out is not None and self.main:
            save_atomic(payload, self.out / CHECKPOINT)


def truncate_metrics(path: Path, step: int) -> None:
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


def previous_checkpoint(out: Path | None, resume: bool) -> dict[str, Any] | None:
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


def check_resumable(
    checkpoint: dict[str, Any], spec: Spec, config: TrainConfig, task: Task, extend: bool
) -> int:
    """A resumed run continues exactly only with the same spec, settings and task; `extend`
    lets `steps` grow. Returns the steps the checkpoint's schedule was planned for."""
    problems = []
    # Through load_spec: a field added since the checkpoint was written (feature_map.normalize)
    # takes its default, which the run used.
    if load_spec(checkpoint["spec"]).normalized() != spec.normalized():
        problems.append("the spec (or its model section) differs from the checkpoint's")
    planned = checkpoint["config"]["steps"]
    for name, value in config.trajectory().items():
        used = recorded_setting(checkpoint, name)
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
    for name, value in task_info(task).items():
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
