"""A training run's checkpoint as a transformers directory (`miras export-hf RUN_DIR OUT_DIR`).

    export_run("runs/x", "hf/x")   # config.json (spec + model section), model.safetensors
    AutoModelForCausalLM.from_pretrained("hf/x")   # after import miras.hf

Only token models convert: a run whose task gave the model its own input and output layers
(continuous MQAR's vectors) has no token embedding to become transformers' input embedding.
"""

from __future__ import annotations

from pathlib import Path

from miras.checkpoint import load_checkpoint, load_model
from miras.hf.modeling_miras import MirasForCausalLM


def export_run(run_dir: str | Path, out_dir: str | Path) -> MirasForCausalLM:
    """Write the run's trained model to `out_dir` with save_pretrained; returns it."""
    data = load_checkpoint(run_dir)
    if data["task"].get("io") is not None:
        raise ValueError(
            f"export-hf: the run's task '{data['task'].get('name')}' gives the model its own "
            "input and output layers (not token ids); only token models convert"
        )
    model = MirasForCausalLM.from_language_model(load_model(run_dir))
    model.save_pretrained(out_dir)
    return model
