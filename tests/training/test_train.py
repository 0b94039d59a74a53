"""Training and evaluation: the loss falls, resuming continues exactly, divergence and bad
settings get named errors, checkpoints are written atomically, and the CLI wraps it all."""

from __future__ import annotations

import importlib
import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pytest
import torch
import torch.nn.functional as F

import miras
from miras.errors import TrainingDiverged
from miras.models.model import build_model
from miras.tasks.base import Task

training = importlib.import_module("miras.training")
recipe = importlib.import_module("miras.training.recipe")

ROOT = Path(__file__).resolve().parents[2]
SPEC = {
    "name": "tiny-gdn",
    "retention": {"kind": "l2", "grad_at": "retained"},
    "model": {"d_model": 32, "n_heads": 2, "n_layers": 2, "chunk_size": 8},
}
FAST = {"batch_size": 16, "lr": 3e-3, "warmup": 5, "progress": False, "eval_batches": 2}


pytestmark = pytest.mark.usefixtures("one_thread")


@dataclass
class Batch:
    inputs: torch.Tensor
    labels: torch.Tensor


class Recall(Task):
    """A tiny associative recall, a task of its own (a Task, with its hooks' defaults): pairs
    `k v`, then every key again; the logits at a queried key are scored against its value
    (labels -100 elsewhere)."""

    name: ClassVar[str] = "recall"
    primary_metric: ClassVar[str] = "accuracy"
    higher_is_better: ClassVar[bool] = True
    vocab_size: int = 24
    pairs: int = 4
    seed: int = 0

    @property
    def seq_len(self) -> int:
        return 4 * self.pairs

    def batch(self, split: str, index: int, batch_size: int) -> Batch:
        offset = {"train": 0, "valid": 1 << 20}[split]
        gen = torch.Generator().manual_seed(self.seed * (1 << 24) + offset + index)
        half, n = self.vocab_size // 2, self.pairs
        keys = torch.stack([torch.randperm(half, generator=gen)[:n] for _ in range(batch_size)])
        values = torch.randint(half, self.vocab_size, (batch_size, n), generator=gen)
        order = torch.stack([torch.randperm(n, generator=gen) for _ in range(batch_size)])
        queried = values.gather(1, order)
        context = torch.stack([keys, values], -1).flatten(1)
        queries = torch.stack([keys.gather(1, order), queried], -1).flatten(1)
        inputs = torch.cat([context, queries], 1)
        labels = torch.full_like(inputs, -100)
        labels[:, 2 * n :: 2] = queried
        return Batch(inputs, labels)

    def metrics(self, logits: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
        scored = labels != -100
        loss = F.cross_entropy(logits[scored].float(), labels[scored]).item()
        accuracy = (logits.argmax(-1)[scored] == labels[scored]).float().mean().item()
        return {"loss": loss, "accuracy": accuracy}


class Crash(RuntimeError):
    """Stands for a run killed in the middle."""


class CrashingRecall(Recall):
    """Recall that dies when asked for training batch `at`."""

    at: int

    def options(self) -> dict:
        """Recall's: the crash is no option of the data (a resumed run uses Recall)."""
        return {k: v for k, v in super().options().items() if k != "at"}

    def batch(self, split, index, batch_size):
        if split == "train" and index == self.at:
            raise Crash(f"killed at batch {index}")
        return super().batch(split, index, batch_size)


def test_a_tiny_run_learns():
    result = miras.train(SPEC, Recall(), steps=60, eval_every=30, **FAST)
    first, last = sum(result.losses[:5]) / 5, sum(result.losses[-5:]) / 5
    assert last < first - 0.3, (first, last)
    assert set(result.metrics) == {"loss", "accuracy"}
    assert [h["step"] for h in result.history] == [30, 60]
    assert result.steps == 60 and len(result.losses) == 60
    model = build_model(miras.load_spec(SPEC), Recall().vocab_size)
    assert result.parameters == sum(p.numel() for p in model.parameters())


def test_runs_are_deterministic_and_seeded():
    a = miras.train(SPEC, Recall(), steps=4, eval_every=4, **FAST)
    b = miras.train(SPEC, Recall(), steps=4, eval_every=4, **FAST)
    c = miras.train(SPEC, Recall(), steps=4, eval_every=4, seed=1, **FAST)
    assert a.losses == b.losses and a.metrics == b.metrics
    assert a.losses[0] != c.losses[0]


def _state(directory: Path) -> dict:
    return training.load_checkpoint(directory)


def test_resume_equals_an_uninterrupted_run(tmp_path):
    whole = miras.train(SPEC, Recall(), steps=20, eval_every=5, out_dir=tmp_path / "a", **FAST)

    class Stop(Exception):
        pass

    def stop_at_10(step, metrics):
        if step == 10:
            raise Stop

    with pytest.raises(Stop):  # stopped by the callback, as a pruner would
        miras.train(
            SPEC,
            Recall(),
            steps=20,
            eval_every=5,
            out_dir=tmp_path / "b",
            callback=stop_at_10,
            **FAST,
        )
    assert _state(tmp_path / "b")["step"] == 10
    resumed = miras.train(
        SPEC, Recall(), steps=20, eval_every=5, out_dir=tmp_path / "b", resume=True, **FAST
    )
    assert resumed.losses == whole.losses
    assert resumed.history == [
        {**h, "seconds": r["seconds"]} for h, r in zip(whole.history, resumed.history, strict=True)
    ]
    a, b = _state(tmp_path / "a")["model"], _state(tmp_path / "b")["model"]
    assert all(torch.equal(a[name], b[name]) for name in a)


def test_a_killed_run_resumes_from_its_last_checkpoint(tmp_path):
    """Killed after the step-10 checkpoint (at step 13): resuming redoes 11..20 and the
    metrics file keeps no record from the lost steps."""
    whole = miras.train(
        SPEC, Recall(), steps=20, eval_every=10, out_dir=tmp_path / "a", log_every=1, **FAST
    )
    with pytest.raises(Crash):
        miras.train(
            SPEC,
            CrashingRecall(at=13),
            steps=20,
            eval_every=10,
            out_dir=tmp_path / "b",
            log_every=1,
            **FAST,
        )
    resumed = miras.train(
        SPEC,
        Recall(),
        steps=20,
        eval_every=10,
        out_dir=tmp_path / "b",
        resume=True,
        log_every=1,
        **FAST,
    )
    assert resumed.losses == whole.losses
    lines = [json.loads(x) for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    train_steps = [r["step"] for r in lines if r["split"] == "train"]
    assert train_steps == list(range(1, 21))
    assert [r["step"] for r in lines if r["split"] == "valid"] == [10, 20]


def test_metrics_are_json_lines(tmp_path):
    miras.train(SPEC, Recall(), steps=6, eval_every=3, log_every=2, out_dir=tmp_path, **FAST)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    valid = [r for r in records if r["split"] == "valid"]
    train = [r for r in records if r["split"] == "train"]
    assert [r["step"] for r in valid] == [3, 6] and [r["step"] for r in train] == [2, 4, 6]
    assert {"loss", "accuracy", "seconds"} <= set(valid[0])
    assert {"loss", "lr", "grad_norm", "tokens_per_s"} <= set(train[0])


def test_evaluate_scores_a_checkpoint_like_training_did(tmp_path):
    result = miras.train(SPEC, Recall(), steps=5, eval_every=5, out_dir=tmp_path, **FAST)
    scored = miras.evaluate(tmp_path / "checkpoint.pt", Recall(), batches=2)
    assert scored == pytest.approx(result.metrics, rel=1e-6)
    with pytest.raises(ValueError, match="vocabulary has 30 tokens, the checkpoint's model 24"):
        miras.evaluate(tmp_path, Recall(vocab_size=30))
    with pytest.raises(FileNotFoundError, match="no such file"):
        miras.evaluate(tmp_path / "missing.pt", Recall())


# Numerical safety ---------------------------------------------------------------------------


def test_a_nan_loss_stops_the_run_naming_the_step(monkeypatch):
    real = recipe.loss_of
    calls = []

    def poisoned(logits, labels):
        calls.append(1)
        loss = real(logits, labels)
        return loss * float("nan") if len(calls) == 3 else loss

    monkeypatch.setattr(recipe, "loss_of", poisoned)
    with pytest.raises(TrainingDiverged, match="diverged at step 3: the training loss is nan") as e:
        miras.train(SPEC, Recall(), steps=10, eval_every=5, **FAST)
    assert e.value.step == 3 and isinstance(e.value, ValueError)


def test_an_infinite_gradient_stops_the_run(monkeypatch):
    monkeypatch.setattr(
        torch.nn.utils, "clip_grad_norm_", lambda *a, **k: torch.tensor(float("inf"))
    )
    with pytest.raises(TrainingDiverged, match="step 1: the gradient norm is inf"):
        miras.train(SPEC, Recall(), steps=3, eval_every=3, **FAST)


# Checkpoints --------------------------------------------------------------------------------


def test_a_failure_while_writing_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    miras.train(SPEC, Recall(), steps=4, eval_every=2, out_dir=tmp_path, **FAST)
    before = (tmp_path / "checkpoint.pt").read_bytes()
    real_save = torch.save

    def dies_halfway(obj, f, *args, **kwargs):
        real_save({"partial": torch.zeros(1000)}, f)  # some bytes hit the file, then...
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", dies_halfway)
    with pytest.raises(OSError, match="disk full"):
        training.save_atomic({"model": {}}, tmp_path / "checkpoint.pt")
    assert (tmp_path / "checkpoint.pt").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pt", "metrics.jsonl"]
    assert training.load_checkpoint(tmp_path)["step"] == 4


# Bad settings get named errors --------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"steps": 0}, "steps: expected an integer >= 1, got 0"),
        ({"lr": -1.0}, "lr: expected a number > 0, got -1.0"),
        ({"grad_clip": 0.0}, "grad_clip: expected a number > 0"),
        ({"eval_every": 0}, "eval_every: expected an integer >= 1, got 0"),
        ({"resume": True}, "resume: needs out_dir"),
    ],
    ids=["steps", "lr", "grad_clip", "eval_every", "resume-without-dir"],
)
def test_bad_settings_are_named(options, message):
    settings = {**FAST, "steps": 2, **options}
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        miras.train(SPEC, Recall(), **settings)


def test_resuming_with_other_settings_is_refused(tmp_path):
    miras.train(SPEC, Recall(), steps=2, eval_every=2, out_dir=tmp_path, **FAST)
    with pytest.raises(ValueError, match="already holds a checkpoint; pass resume=True"):
        miras.train(SPEC, Recall(), steps=2, eval_every=2, out_dir=tmp_path, **FAST)
    with pytest.raises(ValueError, match="cannot continue exactly: lr: the checkpoint used"):
        settings = {**FAST, "lr": 1e-3}
        miras.train(SPEC, Recall(), steps=2, out_dir=tmp_path, resume=True, **settings)


def test_the_schedule_warms_up_then_decays():
    factors = [recipe.lr_factor(s, 10, 100) for s in range(100)]
    assert factors[0] == pytest.approx(0.1) and factors[9] == pytest.approx(1.0)
    assert factors[10] == pytest.approx(1.0) and factors[-1] == pytest.approx(0.1, abs=1e-3)
    assert all(a >= b for a, b in itertools.pairwise(factors[10:]))


# The command line ---------------------------------------------------------------------------


def test_cli_train_and_eval(tmp_path):
    from typer.testing import CliRunner

    from miras.cli import app

    runner = CliRunner()
    spec = ROOT / "specs" / "deltanet.yaml"
    args = [
        "train",
        str(spec),
        "--task",
        "mqar",
        "--steps",
        "3",
        "--eval-every",
        "3",
        "--batch-size",
        "4",
        "--eval-batches",
        "1",
        "--out",
        str(tmp_path),
        "--no-progress",
        "--model",
        "d_model=16",
        "--model",
        "n_layers=1",
        "--task-option",
        "seq_len=32",
        "--task-option",
        "num_pairs=4",
    ]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "run directory" in result.stdout and (tmp_path / "checkpoint.pt").is_file()
    scored = runner.invoke(
        app,
        [
            "eval",
            str(tmp_path),
            "--task",
            "mqar",
            "--task-option",
            "seq_len=32",
            "--task-option",
            "num_pairs=4",
            "--batches",
            "1",
        ],
    )
    assert scored.exit_code == 0, scored.output
    assert "loss" in scored.stdout


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--task", "nope"], "unknown task 'nope'"),
        (["--task", "mqar", "--task-option", "no_such_option=3"], "no_such_option"),
        (["--task", "mqar", "--task-option", "novalue"], "expected key=value"),
        (["--task", "mqar", "--model", "variant=mca"], "model.variant"),
    ],
    ids=["task", "task-option", "key-value", "model-option"],
)
def test_cli_bad_options_get_one_named_error(tmp_path, extra, message):
    from typer.testing import CliRunner

    from miras.cli import app

    spec = ROOT / "specs" / "deltanet.yaml"
    args = ["train", str(spec), "--steps", "1", "--out", str(tmp_path), "--no-progress", *extra]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 1
    assert message in result.stderr and "Traceback" not in result.output
