"""bf16 training (issue 15): autocast runs the projections in bfloat16 while the memory rule
keeps its state and products in float32; the loss curve follows float32's; the precision is
recorded in the checkpoint, kept on resume and used by evaluation; a bad value is named.

Tolerance of the loss curves (seed 0, 60 steps of a tiny DeltaNet on MQAR, lr 1e-2, in which
the loss falls by about 0.58). Each projection's output is rounded to bfloat16 (8 significant
bits), so the first losses differ by about 1e-3 and the two runs then drift apart the way two
runs with slightly different batches do. Measured here over seeds 0-5: at most 0.005 in the
first 10 steps, and 0.010 to 0.050 over all 60 (0.030 for seed 0; with the gates in float32,
before that 0.015 to 0.075). The bounds, 0.01 over the first 10 steps and 0.1 over all (a
sixth of the fall), hold the curves to the same curve, and a float32 memory state rounded to
bf16 or a broken autocast would show in the next test first.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import miras
from miras import ops, training
from miras.cli import app
from miras.tasks import make_task
from tests.helpers import random_inputs

ROOT = Path(__file__).resolve().parents[2]
SPEC = {
    "name": "tiny-dn",
    "model": {"d_model": 16, "n_heads": 1, "n_layers": 1, "chunk_size": 8},
}
TASK = {"vocab_size": 32, "seq_len": 16, "num_pairs": 2}
CURVE = {"steps": 60, "batch_size": 16, "lr": 1e-2, "warmup": 5, "weight_decay": 0.0}
QUIET = {"eval_batches": 1, "progress": False}
EARLY_TOL, CURVE_TOL = 0.01, 0.1

pytestmark = pytest.mark.usefixtures("one_thread")


def task():
    return make_task("mqar", **TASK)


@pytest.mark.parametrize("name", ["deltanet", "gated_deltanet"])
def test_the_memory_rule_computes_in_float32_under_autocast(name):
    """bf16 inputs under autocast give exactly what they give outside it: the rule leaves
    autocast, so its state and every product stay float32 (autocast would run them in bf16)."""
    rule = miras.compile(ROOT / "specs" / f"{name}.yaml")
    q, k, v, gates = random_inputs(rule, t=20, dk=8, dv=8, dtype=torch.bfloat16)
    plain, plain_state = rule(q, k, v, gates, chunk_size=4, output_final_state=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast, state = rule(q, k, v, gates, chunk_size=4, output_final_state=True)
    assert state.dtype == torch.float32 and autocast.dtype == torch.bfloat16
    assert torch.equal(autocast, plain) and torch.equal(state, plain_state)


def test_the_fla_style_ops_compute_in_float32_under_autocast():
    """An op of miras.ops calls the rule, autocast guard included: under autocast it gives
    exactly what it gives outside it, as `rule(...)` does (above)."""
    rule = miras.compile(ROOT / "specs" / "gated_deltanet.yaml")
    q, k, v, gates = random_inputs(rule, t=20, dk=8, dv=8, dtype=torch.bfloat16)
    args = dict(g=gates["decay"].log(), beta=gates["lr"], scale=1.0, output_final_state=True)
    plain, plain_state = ops.chunk_gated_delta_rule(q, k, v, **args)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast, state = ops.chunk_gated_delta_rule(q, k, v, **args)
    assert state.dtype == torch.float32 and autocast.dtype == torch.bfloat16
    assert torch.equal(autocast, plain) and torch.equal(state, plain_state)


def test_the_bf16_loss_curve_follows_float32():
    fp32 = miras.train(SPEC, task(), **CURVE, **QUIET, precision="fp32").losses
    bf16 = miras.train(SPEC, task(), **CURVE, **QUIET, precision="bf16").losses
    gaps = [abs(a - b) for a, b in zip(fp32, bf16, strict=True)]
    assert fp32[0] - fp32[-1] > 0.4  # a curve that falls, not a plateau
    assert 0 < max(gaps[:10]) <= EARLY_TOL  # bf16 is in effect, and close
    assert max(gaps) <= CURVE_TOL


def test_the_checkpoint_records_bf16_and_resume_and_evaluation_keep_it(tmp_path):
    short = {"steps": 4, "batch_size": 8, "lr": 3e-3, "warmup": 1, **QUIET}
    whole = miras.train(SPEC, task(), **short, eval_every=2, precision="bf16")

    def stop(step, metrics):
        if step == 2:
            raise StopIteration

    with pytest.raises(StopIteration):
        miras.train(SPEC, task(), **short, eval_every=2, precision="bf16", out_dir=tmp_path,
                    callback=stop)  # fmt: skip
    assert training.load_checkpoint(tmp_path)["config"]["precision"] == "bf16"
    with pytest.raises(ValueError, match="precision: the checkpoint used bf16"):
        miras.train(SPEC, task(), **short, eval_every=2, precision="fp32", out_dir=tmp_path,
                    resume=True)  # fmt: skip
    # Resumed without naming the precision: bf16 again, so the losses are the bf16 run's.
    resumed = miras.train(SPEC, task(), **short, eval_every=2, out_dir=tmp_path, resume=True)
    assert resumed.losses == whole.losses
    # Evaluation scores under the recorded precision: the run's own last evaluation, which
    # float32 does not reproduce.
    scored = miras.evaluate(tmp_path, batches=1)
    assert scored == resumed.metrics
    data = training.load_checkpoint(tmp_path)
    model = miras.models.model.build_model(miras.load_spec(data["spec"]), TASK["vocab_size"])
    model.load_state_dict(data["model"])
    in_fp32 = training.evaluate_model(model, task(), batches=1, batch_size=8)
    assert in_fp32["loss"] != scored["loss"]


def test_a_bad_precision_is_named_with_the_allowed_values(tmp_path):
    options = [w for k, v in TASK.items() for w in ("--task-option", f"{k}={v}")]
    spec = ROOT / "specs" / "deltanet.yaml"
    words = ["train", str(spec), "--task", "mqar", *options, "--precision", "fp16"]
    result = CliRunner().invoke(app, [*words, "--steps", "1", "--out", str(tmp_path / "run")])
    assert result.exit_code == 1
    assert "precision: expected one of fp32, bf16, got 'fp16'" in result.output
    assert not (tmp_path / "run").exists()
