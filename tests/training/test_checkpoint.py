"""Checkpoints (miras/checkpoint.py): a run written before a spec field existed resumes, the
field taking its default, which that run used."""

from __future__ import annotations

import pytest
import torch

import miras
from miras.tasks import make_task
from miras.training.checkpoint import CHECKPOINT

pytestmark = pytest.mark.usefixtures("one_thread")

SPEC = {
    "name": "tiny-dn",
    "bias": "l2",
    "retention": "none",
    "optimizer": {"kind": "gd", "lr": "gate"},
    "model": {"d_model": 16, "n_heads": 2, "n_layers": 1},
}
SETTINGS = {"batch_size": 4, "eval_batches": 1, "progress": False, "warmup": 1}


def test_a_checkpoint_without_a_newer_default_field_resumes(tmp_path):
    task = make_task("mqar", seq_len=16, num_pairs=2, vocab_size=16)
    miras.train(SPEC, task, steps=2, eval_every=2, out_dir=tmp_path, **SETTINGS)
    path = tmp_path / CHECKPOINT
    data = torch.load(path, weights_only=True)
    del data["spec"]["feature_map"]["normalize"]  # as written before the field existed
    torch.save(data, path)
    result = miras.train(
        SPEC, task, steps=4, eval_every=2, out_dir=tmp_path, resume=True, extend=True, **SETTINGS
    )
    assert result.steps == 4
    # A real difference is still refused.
    other = {**SPEC, "feature_map": {"kind": "identity", "normalize": True}}
    with pytest.raises(ValueError, match="the spec"):
        miras.train(other, task, steps=6, out_dir=tmp_path, resume=True, extend=True, **SETTINGS)
