"""Training runs as a user drives them (issue 10, item 7): the checkpoint records the task and
its options and `miras eval` uses them; Ctrl-C saves a resumable checkpoint and says how to
resume; `--extend` trains a run longer; the default run directory is what --help says; a
failed start leaves no directory; off a terminal, progress comes as plain lines."""

from __future__ import annotations

import io
import json
import os
import shlex
import signal
from pathlib import Path

import pytest
import torch
from rich.console import Console
from typer.testing import CliRunner

import miras
from miras import training
from miras.cli import app
from miras.errors import TrainingDiverged
from miras.tasks import make_task
from miras.tasks.mqar import MQAR
from miras.training import interrupts, progress, recipe

ROOT = Path(__file__).resolve().parents[2]
SPEC = {
    "name": "tiny-dn",
    "model": {"d_model": 16, "n_heads": 1, "n_layers": 1, "chunk_size": 8},
}
TASK = {"vocab_size": 32, "seq_len": 16, "num_pairs": 2}
FAST = {"batch_size": 4, "lr": 3e-3, "warmup": 2, "progress": False, "eval_batches": 1}
# The same run from the command line (specs/deltanet.yaml made tiny).
CLI_TASK = [w for k, v in TASK.items() for w in ("--task-option", f"{k}={v}")]
CLI_MODEL = [w for m in ("d_model=16", "n_layers=1") for w in ("--model", m)]
CLI_FAST = ["--batch-size", "4", "--warmup", "2", "--eval-batches", "1", "--threads", "1"]


pytestmark = pytest.mark.usefixtures("one_thread")


def task():
    return make_task("mqar", **TASK)


def cli(*args, **kwargs):
    return CliRunner().invoke(app, [str(a) for a in args], **kwargs)


def cli_train(out: Path, *extra):
    spec = ROOT / "specs" / "deltanet.yaml"
    return cli(
        "train", spec, "--task", "mqar", *CLI_TASK, *CLI_MODEL, *CLI_FAST, *extra, "--out", out
    )


def metrics_lines(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def same_model(a: Path, b: Path) -> bool:
    ma, mb = training.load_checkpoint(a)["model"], training.load_checkpoint(b)["model"]
    return ma.keys() == mb.keys() and all(torch.equal(ma[k], mb[k]) for k in ma)


# The task a run trained on ------------------------------------------------------------------


def test_the_checkpoint_and_metrics_record_the_task_and_its_options(tmp_path):
    miras.train(SPEC, task(), steps=2, eval_every=2, out_dir=tmp_path, **FAST)
    recorded = training.load_checkpoint(tmp_path)["task"]
    assert recorded["name"] == "mqar"
    assert recorded["options"] == {**TASK, "power_a": 0.01, "seed": 0, "random_non_queries": False}
    assert make_task("mqar", **recorded["options"]) == task()
    first = metrics_lines(tmp_path)[0]
    assert first["split"] == "run" and first["event"] == "start" and first["step"] == 0
    assert first["task"] == recorded and first["config"]["steps"] == 2


def test_eval_scores_on_the_task_options_the_run_trained_with(tmp_path):
    miras.train(SPEC, task(), steps=2, eval_every=2, out_dir=tmp_path, **FAST)
    expected = miras.evaluate(tmp_path, task(), batches=1)
    assert miras.evaluate(tmp_path, batches=1) == expected  # the Python API reads the record too
    for args in ([], ["--task", "mqar"]):  # --task mqar once meant mqar's defaults (vocab 256)
        scored = cli("eval", tmp_path, *args, "--batches", "1")
        assert scored.exit_code == 0, scored.output
        assert "on mqar (vocab_size=32, seq_len=16, num_pairs=2, power_a=0.01" in scored.stdout
        assert f"│ loss     │ {expected['loss']:.4f} │" in scored.stdout


def test_eval_options_on_the_command_line_replace_the_recorded_ones(tmp_path):
    miras.train(SPEC, task(), steps=2, eval_every=2, out_dir=tmp_path, **FAST)
    longer = make_task("mqar", **{**TASK, "seq_len": 24})
    expected = miras.evaluate(tmp_path, longer, batches=1)
    scored = cli("eval", tmp_path, "--task-option", "seq_len=24", "--batches", "1")
    assert scored.exit_code == 0, scored.output
    assert "note: option seq_len: 24 instead of the run's 16" in scored.stderr
    assert f"│ loss     │ {expected['loss']:.4f} │" in scored.stdout


def test_eval_on_another_task_says_so(tmp_path):
    miras.train(SPEC, task(), steps=2, eval_every=2, out_dir=tmp_path, **FAST)
    scored = cli("eval", tmp_path, "--task", "niah", "--batches", "1")
    assert "note: the run trained on task 'mqar'; scoring it on 'niah'" in scored.stderr
    # niah's vocabulary is not the model's: refused by name, not scored
    assert scored.exit_code == 1 and "vocabulary has 256 tokens" in scored.stderr


class Stop(Exception):
    pass


def stop_at(at: int):
    def callback(step, metrics):
        if step == at:
            raise Stop

    return callback


def test_a_checkpoint_from_before_the_options_were_recorded_still_loads(tmp_path):
    with pytest.raises(Stop):
        settings = {"steps": 4, "eval_every": 2, "callback": stop_at(2)}
        miras.train(SPEC, task(), out_dir=tmp_path, **settings, **FAST)
    data = training.load_checkpoint(tmp_path)
    del data["task"]["options"]
    del data["extensions"]
    training.save_atomic(data, tmp_path / "checkpoint.pt")
    scored = cli("eval", tmp_path, *CLI_TASK, "--batches", "1")
    assert scored.exit_code == 0, scored.output
    assert "does not record its task's options" in scored.stderr
    assert "using the task's defaults and the given options" in scored.stderr
    # and it resumes (the options cannot be compared, the rest is)
    resumed = miras.train(
        SPEC, task(), steps=4, eval_every=2, out_dir=tmp_path, resume=True, **FAST
    )
    assert resumed.steps == 4
    with pytest.raises(ValueError, match="task vocab_size: the checkpoint used 32"):
        other = make_task("mqar", **{**TASK, "vocab_size": 40})
        miras.train(SPEC, other, steps=4, eval_every=2, out_dir=tmp_path, resume=True, **FAST)


def test_resuming_with_other_task_options_is_refused(tmp_path):
    miras.train(SPEC, task(), steps=2, eval_every=2, out_dir=tmp_path, **FAST)
    other = make_task("mqar", **{**TASK, "power_a": 0.5})
    with pytest.raises(ValueError, match=r"task options: the checkpoint used .*'power_a': 0.01"):
        miras.train(SPEC, other, steps=2, eval_every=2, out_dir=tmp_path, resume=True, **FAST)


# Ctrl-C -------------------------------------------------------------------------------------


def interrupting(monkeypatch, at: int, how):
    """MQAR whose training batch `at` (the batch of step at + 1) first runs `how`."""
    real = MQAR.batch

    def batch(self, split, index, batch_size):
        if split == "train" and index == at:
            how()
        return real(self, split, index, batch_size)

    monkeypatch.setattr(MQAR, "batch", batch)


def sigint():
    os.kill(os.getpid(), signal.SIGINT)


def raise_keyboard_interrupt():
    raise KeyboardInterrupt


def test_ctrl_c_finishes_the_step_saves_and_resumes_exactly(tmp_path, monkeypatch):
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    whole = miras.train(SPEC, task(), steps=12, eval_every=5, out_dir=tmp_path / "a", **FAST)
    interrupting(monkeypatch, 7, sigint)  # Ctrl-C while step 8 runs
    with pytest.raises(training.TrainingInterrupted) as stop:
        miras.train(SPEC, task(), steps=12, eval_every=5, out_dir=tmp_path / "b", **FAST)
    assert isinstance(stop.value, KeyboardInterrupt)
    assert stop.value.saved and stop.value.step == 8
    assert stop.value.checkpoint == tmp_path / "b" / "checkpoint.pt"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # handler restored
    saved = training.load_checkpoint(tmp_path / "b")
    assert saved["step"] == 8 and saved["losses"] == whole.losses[:8]
    assert metrics_lines(tmp_path / "b")[-1] == {"step": 8, "split": "run", "event": "interrupted"}
    monkeypatch.undo()
    resumed = miras.train(
        SPEC, task(), steps=12, eval_every=5, out_dir=tmp_path / "b", resume=True, **FAST
    )
    assert resumed.losses == whole.losses
    assert [h["step"] for h in resumed.history] == [5, 10, 12]
    assert same_model(tmp_path / "a", tmp_path / "b")


def test_a_keyboard_interrupt_between_updates_saves_the_step_before(tmp_path, monkeypatch):
    """Raised directly (a second Ctrl-C, or outside the main thread) while step 7 computes:
    the state is still step 6's, and that is what is saved."""
    whole = miras.train(SPEC, task(), steps=10, eval_every=5, out_dir=tmp_path / "a", **FAST)
    interrupting(monkeypatch, 6, raise_keyboard_interrupt)
    with pytest.raises(training.TrainingInterrupted) as stop:
        miras.train(SPEC, task(), steps=10, eval_every=5, out_dir=tmp_path / "b", **FAST)
    assert stop.value.saved and stop.value.step == 6
    monkeypatch.undo()
    resumed = miras.train(
        SPEC, task(), steps=10, eval_every=5, out_dir=tmp_path / "b", resume=True, **FAST
    )
    assert resumed.losses == whole.losses
    assert same_model(tmp_path / "a", tmp_path / "b")


def test_a_keyboard_interrupt_mid_update_keeps_the_last_checkpoint(tmp_path, monkeypatch):
    """Inside an optimizer update the state is half old, half new: nothing is saved, and the
    exception names the checkpoint written before (step 5)."""
    real = torch.optim.lr_scheduler.LambdaLR.step
    calls = []

    def step(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 8:  # after optimizer step 7 (call 1 is the scheduler's own, at init)
            raise KeyboardInterrupt
        return real(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.lr_scheduler.LambdaLR, "step", step)
    with pytest.raises(training.TrainingInterrupted) as stop:
        miras.train(SPEC, task(), steps=10, eval_every=5, out_dir=tmp_path, **FAST)
    assert not stop.value.saved and stop.value.step == 5
    assert training.load_checkpoint(tmp_path)["step"] == 5


def test_a_second_ctrl_c_interrupts_at_once():
    with interrupts.DeferredInterrupt(True) as stop:
        assert stop.active
        sigint()
        assert stop.requested
        with pytest.raises(KeyboardInterrupt):
            sigint()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_cli_ctrl_c_prints_the_checkpoint_and_a_resume_command_that_works(tmp_path, monkeypatch):
    whole = cli_train(tmp_path / "a", "--steps", "8", "--eval-every", "4", "--no-progress")
    assert whole.exit_code == 0, whole.output
    interrupting(monkeypatch, 5, raise_keyboard_interrupt)
    stopped = cli_train(tmp_path / "b", "--steps", "8", "--eval-every", "4", "--no-progress")
    assert stopped.exit_code == 130, stopped.output
    path = tmp_path / "b" / "checkpoint.pt"
    assert f"interrupted: saved the checkpoint {path} (step 5)" in stopped.stderr
    command = stopped.stderr.split("resume with: ", 1)[1].strip()
    words = shlex.split(command)
    assert words[:2] == ["miras", "train"] and words[-3:] == [
        "--out",
        str(tmp_path / "b"),
        "--resume",
    ]
    monkeypatch.undo()
    resumed = cli(*words[1:])
    assert resumed.exit_code == 0, resumed.output
    a, b = (training.load_checkpoint(tmp_path / x) for x in "ab")
    assert b["step"] == 8 and b["losses"] == a["losses"]
    assert same_model(tmp_path / "a", tmp_path / "b")


def test_cli_ctrl_c_before_any_step_says_nothing_was_saved(tmp_path, monkeypatch):
    interrupting(monkeypatch, 0, raise_keyboard_interrupt)
    stopped = cli_train(tmp_path / "run", "--steps", "4", "--no-progress")
    assert stopped.exit_code == 130
    assert "nothing was saved" in stopped.stderr and "Traceback" not in stopped.output
    assert not (tmp_path / "run").exists()


# Training longer ----------------------------------------------------------------------------


def test_extend_trains_a_finished_run_longer_on_a_replanned_schedule(tmp_path, monkeypatch):
    miras.train(SPEC, task(), steps=6, eval_every=3, out_dir=tmp_path, log_every=1, **FAST)
    with pytest.raises(ValueError, match=r"steps: the checkpoint used 6 \(to train longer, add"):
        miras.train(SPEC, task(), steps=10, eval_every=3, out_dir=tmp_path, resume=True, **FAST)
    with pytest.raises(ValueError, match="extend trains past the checkpoint's 6 steps, got 5"):
        settings = {"steps": 5, "eval_every": 3, "resume": True, "extend": True}
        miras.train(SPEC, task(), out_dir=tmp_path, **settings, **FAST)
    with pytest.raises(ValueError, match="extend: continues a checkpoint; pass it with resume"):
        miras.train(SPEC, task(), steps=10, out_dir=tmp_path / "x", extend=True, **FAST)

    used = []  # the learning rate each optimizer step is taken with
    real = recipe.make_optimizer

    def spied(model, config):
        optimizer = real(model, config)
        optimizer.register_step_pre_hook(lambda opt, *_: used.append(opt.param_groups[0]["lr"]))
        return optimizer

    monkeypatch.setattr(recipe, "make_optimizer", spied)
    before = training.load_checkpoint(tmp_path)["losses"]
    longer = miras.train(
        SPEC, task(), steps=10, eval_every=3, out_dir=tmp_path, resume=True, extend=True,
        log_every=1, **FAST,
    )  # fmt: skip
    lr, warmup = FAST["lr"], FAST["warmup"]
    assert used == pytest.approx([lr * recipe.lr_factor(s, warmup, 10) for s in range(6, 10)])
    assert longer.steps == 10 and longer.losses[:6] == before and len(longer.losses) == 10
    assert [h["step"] for h in longer.history] == [3, 6, 9, 10]
    saved = training.load_checkpoint(tmp_path)
    assert saved["config"]["steps"] == 10
    assert saved["extensions"] == [{"step": 6, "from_steps": 6, "to_steps": 10}]
    runs = [r for r in metrics_lines(tmp_path) if r["split"] == "run"]
    assert [(r["step"], r["event"]) for r in runs] == [(0, "start"), (6, "extend")]
    # the extended run now resumes like any other
    again = miras.train(SPEC, task(), steps=10, eval_every=3, out_dir=tmp_path, resume=True, **FAST)
    assert again.losses == longer.losses


def test_cli_extend(tmp_path):
    first = cli_train(tmp_path, "--steps", "4", "--eval-every", "4", "--no-progress")
    assert first.exit_code == 0, first.output
    refused = cli_train(tmp_path, "--steps", "6", "--eval-every", "4", "--no-progress", "--resume")
    assert refused.exit_code == 1 and "--extend" in refused.stderr
    longer = cli_train(
        tmp_path, "--steps", "6", "--eval-every", "4", "--no-progress", "--resume", "--extend"
    )
    assert longer.exit_code == 0, longer.output
    assert "deltanet on mqar: step 6" in longer.stdout
    assert training.load_checkpoint(tmp_path)["step"] == 6


# The run directory --------------------------------------------------------------------------


def test_the_default_run_directory_is_the_one_help_names(tmp_path, monkeypatch):
    help_text = " ".join(cli("train", "--help").stdout.replace("│", " ").split())
    assert "default runs/SPEC-TASK-seedSEED" in help_text
    assert "runs/NAME." not in help_text
    monkeypatch.chdir(tmp_path)
    spec = ROOT / "specs" / "deltanet.yaml"
    ran = cli(
        "train", spec, "--task", "mqar", *CLI_TASK, *CLI_MODEL, *CLI_FAST, "--steps", "2",
        "--seed", "3", "--no-progress",
    )  # fmt: skip
    assert ran.exit_code == 0, ran.output
    assert (tmp_path / "runs" / "deltanet-mqar-seed3" / "checkpoint.pt").is_file()
    assert "run directory: runs/deltanet-mqar-seed3" in ran.stdout


def test_a_start_that_fails_leaves_no_run_directory(tmp_path, monkeypatch):
    bad_option = cli_train(tmp_path / "a", "--task-option", "num_pairs=99", "--steps", "2")
    assert bad_option.exit_code == 1 and "num_pairs" in bad_option.stderr
    assert not (tmp_path / "a").exists()

    real = recipe.loss_of
    monkeypatch.setattr(recipe, "loss_of", lambda logits, labels: real(logits, labels) * torch.nan)
    with pytest.raises(TrainingDiverged, match="step 1"):
        miras.train(SPEC, task(), steps=4, out_dir=tmp_path / "b" / "run", **FAST)
    assert not (tmp_path / "b").exists()  # neither the run directory nor its parent
    diverged = cli_train(tmp_path / "c", "--steps", "2", "--no-progress")
    assert diverged.exit_code == 1 and "diverged at step 1" in diverged.stderr
    assert not (tmp_path / "c").exists()


def test_a_line_cut_short_by_a_kill_is_dropped_on_resume(tmp_path):
    whole = miras.train(SPEC, task(), steps=4, eval_every=2, out_dir=tmp_path / "a", **FAST)
    with pytest.raises(Stop):
        settings = {"steps": 4, "eval_every": 2, "callback": stop_at(2)}
        miras.train(SPEC, task(), out_dir=tmp_path / "b", **settings, **FAST)
    with open(tmp_path / "b" / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "split": "tra')  # killed mid-append
    resumed = miras.train(
        SPEC, task(), steps=4, eval_every=2, out_dir=tmp_path / "b", resume=True, **FAST
    )
    assert resumed.losses == whole.losses
    records = metrics_lines(tmp_path / "b")  # every line parses
    assert [r["step"] for r in records if r["split"] == "valid"] == [2, 4]


# Progress off a terminal --------------------------------------------------------------------


def test_progress_off_a_terminal_is_plain_lines_about_every_tenth_of_the_run():
    stream = io.StringIO()
    console = Console(file=stream)  # not a terminal
    bar = progress.TrainProgress(True, 1000, 0, "accuracy", 10, console=console)
    assert bar.mode == "lines" and bar.every == 100
    with bar:
        for step in range(1, 201):
            metric = 0.5 if step % 10 == 0 else None
            bar.update(step, 2.0, metric, 1234.0)
        bar.evaluated(200, {"loss": 1.5, "accuracy": 0.25})
    lines = stream.getvalue().splitlines()
    assert len(lines) == 3
    assert lines[0].startswith("train step 100/1000  loss 2.0000  accuracy 0.500  1,234 tok/s")
    assert lines[1].startswith("train step 200/1000")
    assert lines[2].startswith("train step 200/1000  valid  loss 1.5000  accuracy 0.2500")
    assert all(" elapsed 0:00:0" in line for line in lines)
    assert progress.TrainProgress(True, 30, 0, "accuracy", 10, console=console).every == 10
    assert progress.TrainProgress(True, 1000, 0, "accuracy", 7, console=console).every == 98
    assert progress.TrainProgress(False, 1000, 0, "accuracy", 10, console=console).mode == "off"


def test_cli_train_with_redirected_output_logs_lines(tmp_path):
    ran = cli_train(tmp_path, "--steps", "20", "--eval-every", "10", "--log-every", "1")
    assert ran.exit_code == 0, ran.output
    lines = [line for line in ran.stderr.splitlines() if line.startswith("train step")]
    steps = [int(line.split()[2].split("/")[0]) for line in lines]
    assert steps == [2, 4, 6, 8, 10, 10, 12, 14, 16, 18, 20, 20]
    assert "valid  loss" in lines[5] and "tok/s" in lines[0] and "elapsed" in lines[0]
