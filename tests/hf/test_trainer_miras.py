"""transformers' Trainer trains a MirasForCausalLM on the text task (the shipped pydoc corpus,
bytes): the loss on a fixed validation batch falls; the trained model saves and reloads to
identical logits."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", reason="the hf extra: pip install -e '.[hf]'")

from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

from miras.hf import MirasForCausalLM
from miras.tasks import make_task

pytestmark = pytest.mark.usefixtures("one_thread")


class TaskWindows(torch.utils.data.Dataset):
    """Training windows of a token task as Trainer examples: input_ids = labels (the model
    shifts the labels itself)."""

    def __init__(self, task, count: int):
        self.task, self.count = task, count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.task.batch("train", i, 1).inputs[0]
        return {"input_ids": ids, "labels": ids.clone()}


def test_trainer_lowers_the_loss_and_the_model_reloads(tmp_path):
    task = make_task("text", seq_len=32)
    torch.manual_seed(0)
    model = MirasForCausalLM.from_spec(
        "specs/gated_deltanet.yaml", task.vocab_size, d_model=32, n_heads=2, n_layers=1
    )
    held_out = task.batch("valid", 0, 8).inputs

    def valid_loss() -> float:
        model.eval()
        with torch.no_grad():
            return float(model(held_out, labels=held_out, use_cache=False).loss)

    before = valid_loss()
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=40,
        per_device_train_batch_size=8,
        learning_rate=3e-3,
        warmup_steps=0,
        logging_steps=10,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        dataloader_num_workers=0,
        seed=0,
    )
    Trainer(model=model, args=args, train_dataset=TaskWindows(task, 320)).train()
    after = valid_loss()
    print(f"valid loss {before:.3f} -> {after:.3f}")
    assert after < before - 0.5, (before, after)  # from ~ln 256 = 5.5 nats per byte
    model.save_pretrained(tmp_path / "saved")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "saved").eval()
    with torch.no_grad():
        assert torch.equal(loaded(held_out).logits, model(held_out).logits)
