"""An empty batch (B = 0) through the models: `MirasLayer` of every shipped spec on every
backend and chunk mode, and the language model of every variant (docs/models.md).

The contract is `helpers.assert_empty_batch`: B = 0 against the same call at B = 1, the
parameters among the leaves, so each parameter with a gradient at B = 1 has a zero one at
B = 0 (not None). Each call runs the parallel forward, a cached prefill and one decoding step
from `empty_cache(batch)`, and the padded forward (`attention_mask`).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from miras.models import MirasLayer, build_model
from miras.spec import load_spec
from tests.helpers import assert_empty_batch

ROOT = Path(__file__).resolve().parents[2]
SPECS = sorted([*ROOT.glob("specs/*.yaml"), *ROOT.glob("specs/examples/*.yaml")])
# The memory layers' specs (softmax attention is built as `Attention`: the variants below).
MEMORY_SPECS = [p for p in SPECS if load_spec(p).memory.closed_form() is None]
RUNS = [("recurrent", "auto"), ("chunk", "auto"), ("chunk", "start"), ("triton", "auto")]
T, D, HEADS, VOCAB = 5, 16, 2, 11
# The triton layers' B = 1 references run in Triton's interpreter (1 to 6 s each on 2 cores):
# the fast suite and `make test` keep the linear and exact-scan kernels (gated_deltanet), the
# general ones (logcosh_deltanet) and the dual form's (titans); the rest are slow and extended
# (`make test-extended`).
FAST_TRITON = {"gated_deltanet", "logcosh_deltanet", "titans"}
VARIANTS = [
    ("gated_deltanet", {"variant": "lmm"}),
    ("gated_deltanet", {"variant": "mal"}),
    ("gated_deltanet", {"variant": "mag"}),
    ("gated_deltanet", {"variant": "mac", "persistent_tokens": 2}),
    ("gated_deltanet", {"variant": "attention", "positions": "conv"}),
    ("gated_deltanet", {"variant": "swa"}),
    ("titans", {"variant": "lmm", "persistent_tokens": 2}),
    ("mesanet", {"variant": "lmm"}),
    ("attention", {"variant": "lmm"}),
    ("swa", {"variant": "lmm"}),
]

pytestmark = pytest.mark.usefixtures("one_thread")


def module_call(module, inputs, run):
    """call(batch) for `assert_empty_batch`: run(module, inputs(batch), batch) -> outputs, with
    the inputs (if floating) and every parameter as leaves."""

    def call(batch: int):
        x = inputs(batch)
        leaves = dict(module.named_parameters())
        if x.dtype.is_floating_point:
            leaves["x"] = x.requires_grad_(True)
        return run(module, x, batch), leaves

    return call


def layer_runs(layer: MirasLayer, x: torch.Tensor, batch: int) -> dict:
    y, _ = layer(x)
    prefill, cache = layer(x[:, :2], layer.empty_cache(batch))
    step, cache = layer(x[:, 2:3], cache)  # one token: the recurrent step
    mask = torch.ones(x.shape[:2], dtype=torch.long)
    padded, _ = layer(x, attention_mask=mask)
    return {"y": y, "prefill": prefill, "step": step, "cache": cache, "padded": padded}


def layer_cases():
    """pytest params (spec path, backend, chunk mode): every memory spec with every run."""
    params = []
    for path in MEMORY_SPECS:
        for backend, mode in RUNS:
            slow = backend == "triton" and path.stem not in FAST_TRITON
            marks = [pytest.mark.slow, pytest.mark.extended] if slow else []
            ids = f"{path.stem}-{backend}-{mode}"
            params.append(pytest.param(path, backend, mode, marks=marks, id=ids))
    return params


@pytest.mark.parametrize("path,backend,mode", layer_cases())
def test_layer_at_empty_batch(path, backend, mode):
    torch.manual_seed(0)
    layer = MirasLayer(path, D, HEADS, backend=backend, chunk_mode=mode, chunk_size=4)
    assert_empty_batch(module_call(layer, lambda b: torch.randn(b, T, D), layer_runs))


def model_runs(model, tokens: torch.Tensor, batch: int) -> dict:
    mask = torch.ones_like(tokens)
    prefill, cache = model.decode(tokens[:, :2], model.empty_cache(batch))
    step, cache = model.decode(tokens[:, 2:3], cache)
    return {
        "logits": model(tokens),
        "padded": model(tokens, attention_mask=mask),
        "prefill": prefill,
        "step": step,
        "cache": cache,
        "generated": model.generate(tokens, 2),
        "generated padded": model.generate(tokens, 2, attention_mask=mask),
    }


@pytest.mark.parametrize(
    "name,model", VARIANTS, ids=[f"{n}-{'-'.join(map(str, m.values()))}" for n, m in VARIANTS]
)
def test_model_at_empty_batch(name, model):
    spec = load_spec(ROOT / f"specs/{name}.yaml").normalized()
    sizes = {"d_model": D, "n_heads": HEADS, "n_layers": 1, "swa_window": 3, "mac_segment": 4}
    spec["model"] = {**spec.get("model", {}), **sizes, **model}
    torch.manual_seed(0)
    lm = build_model(spec, VOCAB)

    def tokens(batch: int) -> torch.Tensor:
        return torch.randint(0, VOCAB, (batch, T), generator=torch.Generator().manual_seed(0))

    _, zero = assert_empty_batch(module_call(lm, tokens, model_runs))
    assert zero[0]["generated"].shape == (0, 2)
