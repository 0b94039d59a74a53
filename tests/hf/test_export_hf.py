"""`miras export-hf RUN_DIR OUT_DIR`: a training run's checkpoint becomes a transformers
directory whose model gives the run's logits bit for bit; a run without a token embedding is
refused with a message."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

pytest.importorskip("transformers", reason="the hf extra: pip install -e '.[hf]'")

import miras.hf  # registers the Auto classes; miras.train, miras.load_model
from miras.cli import app
from miras.tasks import make_task

pytestmark = pytest.mark.usefixtures("one_thread")

SPEC = {"name": "tiny", "model": {"d_model": 16, "n_heads": 2, "n_layers": 1, "chunk_size": 4}}


def test_export_hf_writes_a_model_with_the_runs_logits(tmp_path):
    from transformers import AutoModelForCausalLM

    task = make_task("mqar", seq_len=16, num_pairs=2, vocab_size=32)
    run = tmp_path / "run"
    miras.train(SPEC, task, steps=2, batch_size=4, eval_batches=1, progress=False, out_dir=run)
    result = CliRunner().invoke(app, ["export-hf", str(run), str(tmp_path / "hf")])
    assert result.exit_code == 0, result.output
    assert "wrote" in result.output and "vocabulary 32" in result.output
    trained = miras.load_model(run)
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ids = task.batch("valid", 0, 2).inputs
    with torch.no_grad():
        assert torch.equal(exported(ids).logits, trained(ids))


def test_export_hf_of_a_missing_run_says_so(tmp_path):
    result = CliRunner().invoke(app, ["export-hf", str(tmp_path / "none"), str(tmp_path / "hf")])
    assert result.exit_code == 1
    assert "no such file" in result.output


def test_export_hf_refuses_a_run_whose_task_has_its_own_input_layer(tmp_path):
    task = make_task("continuous_mqar", vocab_size=16, embed_dim=8, num_pairs=4)
    run = tmp_path / "run"
    miras.train(SPEC, task, steps=1, batch_size=2, eval_batches=1, progress=False, out_dir=run)
    result = CliRunner().invoke(app, ["export-hf", str(run), str(tmp_path / "hf")])
    assert result.exit_code == 1
    assert "continuous_mqar" in result.output and "only token models convert" in result.output
    assert not (tmp_path / "hf").exists()
