"""A training run's checkpoint as a transformers directory (`miras export-hf RUN_DIR OUT_DIR`).

    export_run("runs/x", "hf/x")   # config.json (spec + model section), model.safetensors,
                                   # and the run's tokenizer files when it has one
    AutoModelForCausalLM.from_pretrained("hf/x")   # after import miras.hf

Only token models convert: a run whose task gave the model its own input and output layers
(continuous MQAR's vectors) has no token embedding to become transformers' input embedding.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from miras.hf.modeling_miras import MirasForCausalLM
from miras.training.checkpoint import load_checkpoint, load_model


def export_run(run_dir: str | Path, out_dir: str | Path) -> MirasForCausalLM:
    """Write the run's trained model to `out_dir` with save_pretrained, and the run's
    tokenizer (`tokenizer/` in the run directory: the text task's) next to it; returns it."""
    data = load_checkpoint(run_dir)
    if data["task"].get("io") is not None:
        raise ValueError(
            f"export-hf: the run's task '{data['task'].get('name')}' gives the model its own "
            "input and output layers (not token ids); only token models convert"
        )
    model = MirasForCausalLM.from_language_model(load_model(run_dir))
    model.save_pretrained(out_dir)
    run = Path(run_dir) if Path(run_dir).is_dir() else Path(run_dir).parent
    if (run / "tokenizer").is_dir():
        shutil.copytree(run / "tokenizer", out_dir, dirs_exist_ok=True)
    return model
