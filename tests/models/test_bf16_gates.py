"""bf16 training keeps the gates and norms in float32 (issue 15): under autocast a decay near 1
keeps its float32 value (in bfloat16, 8 significant bits, 0.999 rounds to 1.0 and the memory
would never forget), while the q, k, v projections stay bf16 products; and no norm sees a bf16
input against its float32 weight (torch's "Mismatch dtype between input and weight").
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

import miras
from miras.models.layer import unsquash
from miras.models.model import build_model

ROOT = Path(__file__).resolve().parents[2]
DECAY = 0.999  # bf16 rounds it to 1.0: its neighbours below 1 are 0.99609375 and 0.998046875

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny(name: str, **model) -> miras.Spec:
    spec = miras.load_spec(ROOT / "specs" / f"{name}.yaml").normalized()
    spec["model"] = {**spec["model"], "d_model": 16, "n_heads": 2, "n_layers": 1, **model}
    return miras.load_spec(spec)


def test_a_decay_near_one_keeps_its_float32_value_under_autocast():
    layer = build_model(tiny("gated_deltanet"), 32).blocks[0].mixer
    gates = layer.gates
    (decay,) = [i for i, info in enumerate(gates.infos) if info.name == "decay"]
    rows = slice(decay * gates.n_heads, (decay + 1) * gates.n_heads)
    with torch.no_grad():  # every head's decay at DECAY, whatever x is
        gates.up.weight.zero_()
        gates.up.bias[rows] = unsquash(DECAY, gates.infos[decay].allowed)
    x = torch.randn(2, 5, 16)
    plain = gates(x)["decay"]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cast = gates(x)["decay"]
        q, _, _, _, _ = layer.memory_inputs(x, None)
    assert plain.dtype == cast.dtype == torch.float32
    assert torch.allclose(plain, torch.full_like(plain, DECAY), atol=1e-6)
    assert torch.equal(cast, plain)
    # The q, k, v projection is still a bf16 product (then cast up for the float32 rule): q
    # is within bf16's rounding of the float32 q, not equal to it.
    exact, _, _, _, _ = layer.memory_inputs(x, None)
    assert q.dtype == torch.float32
    assert torch.allclose(q, exact, atol=2e-2) and not torch.equal(q, exact)


@pytest.mark.parametrize("name,variant", [("gated_deltanet", None), ("titans", "mag")])
def test_no_norm_sees_a_bf16_input_against_a_float32_weight(name, variant):
    model = build_model(tiny(name, **({"variant": variant} if variant else {})), 32)
    tokens = torch.randint(0, 32, (2, 16))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's rms_norm warns about the mismatch
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(tokens)
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits.float()).all()
