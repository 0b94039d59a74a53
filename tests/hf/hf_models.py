"""Tiny transformers models of every shipped spec, and of each hybrid, for the bridge's tests.

Every memory rule runs at chunk size 4, so prefill pieces cut chunks anywhere: the exact chunk
form equals the recurrence, and the chunk-start and dual forms' cache keeps their chunk
boundaries (docs/hf.md)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from miras.spec import load_spec

ROOT = Path(__file__).resolve().parents[2]
SPECS = sorted([*ROOT.glob("specs/*.yaml"), *ROOT.glob("specs/examples/*.yaml")])
VOCAB = 64
CHUNK = 4
SMALL = {"d_model": 16, "n_heads": 2, "n_layers": 2, "swa_window": 3, "mac_segment": 4}

HYBRIDS = [
    ("gated_deltanet", {"variant": "mal"}),
    ("gated_deltanet", {"variant": "mag"}),
    ("gated_deltanet", {"variant": "mac", "persistent_tokens": 2}),
    ("titans", {"persistent_tokens": 2}),
    ("deltanet", {"variant": "attention", "persistent_tokens": 2}),
    ("deltanet", {"variant": "swa", "positions": "conv"}),
]


def cases():
    """pytest params (spec path, model overrides): every shipped spec, then the hybrids."""
    params = [pytest.param(p, {}, id=p.stem) for p in SPECS]
    for name, extra in HYBRIDS:
        label = "-".join(f"{k}={v}" for k, v in extra.items())
        params.append(pytest.param(ROOT / f"specs/{name}.yaml", extra, id=f"{name}-{label}"))
    return params


def build(path, extra: dict, dtype=torch.float64, seed: int = 0):
    """The model of spec `path` at SMALL sizes (plus `extra`), in eval mode, in `dtype`."""
    from miras.hf import MirasForCausalLM

    spec = load_spec(path)
    torch.manual_seed(seed)
    overrides = {**SMALL, "chunk_size": CHUNK, **extra}
    model = MirasForCausalLM.from_spec(spec, VOCAB, **overrides)
    return model.to(dtype).eval()


def tokens(batch: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))
