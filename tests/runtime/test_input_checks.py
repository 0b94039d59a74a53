"""Non-finite inputs at the boundary (miras/runtime/inputs.py): q, k, v are checked for NaN and
inf by default, naming the tensor and the first bad token in time; `check_inputs=False` skips
the check, and then the chunk form spreads a NaN back to its chunk's start. A memory layer
whose output goes non-finite names the token where the recurrence first does, not the chunk
start (miras.models.layer.MirasLayer.diverged)."""

from __future__ import annotations

import pytest
import torch

import miras
from miras.errors import ForwardDiverged
from miras.models.layer import MirasLayer, unsquash
from tests.helpers import random_inputs

pytestmark = pytest.mark.usefixtures("one_thread")

ELU = {
    "name": "elu-deltanet",
    "feature_map": {"kind": "custom", "formula": "where(x > 0, x + 1, exp(x))"},
    "bias": "l2",
    "retention": "none",
    "optimizer": {"kind": "gd", "lr": "gate"},
}


@pytest.fixture(scope="module")
def gdn():
    return miras.compile("specs/gated_deltanet.yaml")


def _bad_tokens(o: torch.Tensor) -> list[int]:
    """The tokens of o [B, T, H, D] with a non-finite entry."""
    return (~torch.isfinite(o)).flatten(2).any(-1).any(0).nonzero().flatten().tolist()


@pytest.mark.parametrize("backend", ["chunk", "recurrent"])
@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_a_non_finite_input_names_the_tensor_and_its_first_token(gdn, backend, name):
    q, k, v, gates = random_inputs(gdn, b=2, t=16, h=2)
    inputs = {"q": q, "k": k, "v": v}
    inputs[name][1, 9, 0, 2] = float("nan")
    inputs[name][1, 6, 1, 3] = float("inf")  # the earlier one in time, in row 1, head 1
    with pytest.raises(ValueError, match=rf"^{name}: .* inf at token 6 \(batch row 1, head 1\)"):
        gdn(q, k, v, gates, backend=backend, chunk_size=4)


def test_check_inputs_false_lets_the_nan_spread_as_documented(gdn):
    q, k, v, gates = random_inputs(gdn, b=1, t=16, h=2)
    k[0, 6, 1, 3] = float("inf")
    o, _ = gdn(q, k, v, gates, backend="chunk", chunk_size=4, check_inputs=False)
    assert _bad_tokens(o) == list(range(4, 16))  # back to the start of token 6's chunk
    o, _ = gdn(q, k, v, gates, backend="recurrent", check_inputs=False)
    assert _bad_tokens(o) == list(range(6, 16))


def test_finite_values_whose_sum_overflows_pass(gdn):
    # The fast path sums each tensor; a non-finite float32 sum of finite entries is re-checked.
    q, k, v, gates = random_inputs(gdn, b=1, t=8, h=2, dtype=torch.float32)
    v[0, 3, 1, :] = 3e38
    assert not torch.isfinite(v.sum()) and torch.isfinite(v).all()
    gdn(q, k, v, gates, backend="recurrent")  # no error: every entry is finite


def test_packed_sequences_count_tokens_from_the_packed_start(gdn):
    q, k, v, gates = random_inputs(gdn, b=1, t=12, h=2)
    v[0, 9, 0, 0] = float("-inf")
    cu = torch.tensor([0, 5, 12])
    with pytest.raises(ValueError, match=r"^v: .* -inf at token 9 \(batch row 0, head 0\)"):
        gdn(q, k, v, gates, cu_seqlens=cu)


def test_a_nan_gate_names_its_first_token(gdn):
    q, k, v, gates = random_inputs(gdn, b=2, t=10, h=2)
    gates["decay"][0, 7, 1] = float("nan")
    with pytest.raises(ValueError, match=r"gates\['decay'\]: .* found nan at token 7"):
        gdn(q, k, v, gates)


# The memory layer --------------------------------------------------------------------------


def _old_start_layer(spec, chunk_size: int) -> MirasLayer:
    """A layer whose learning rate starts at 0.5 whatever the feature map (the start before it
    accounted for ||phi(k)||^2): with elu + 1 on heads of 16 the step is ~9 per token."""
    torch.manual_seed(0)
    layer = MirasLayer(spec, 32, 2, chunk_size=chunk_size)
    info = layer.gates.infos[0]
    with torch.no_grad():
        layer.gates.up.bias.fill_(unsquash(0.5, info.allowed, 1.0))
    return layer


def test_a_diverging_layer_names_the_recurrences_first_token_and_the_cause():
    layer = _old_start_layer(ELU, chunk_size=64)
    x = torch.randn(2, 64, 32, generator=torch.Generator().manual_seed(1))
    layer.check_inputs, layer.backend = False, "recurrent"
    with torch.no_grad():
        reference, _ = layer(x)
    first = _bad_tokens(reference.unsqueeze(2))[0]  # where the exact recurrence overflows
    assert first > 0
    layer.check_inputs, layer.backend = True, "chunk"
    with pytest.raises(ForwardDiverged) as err:
        layer(x)
    assert err.value.token == first
    text = str(err.value)
    assert f"non-finite from token {first} " in text
    assert "spreads it back to token 0, its chunk's start" in text
    assert "lr * ||phi(k)||^2 reaches" in text and "`normalize: true`" in text


def test_a_layer_with_a_non_finite_input_names_its_first_token():
    torch.manual_seed(0)
    layer = MirasLayer("specs/gated_deltanet.yaml", 32, 2)
    x = torch.randn(2, 20, 32)
    x[1, 13, 5] = float("nan")
    with pytest.raises(ForwardDiverged, match=r"input x is non-finite from token 13 \(batch row 1"):
        layer(x)


def test_training_that_diverges_at_step_one_blames_the_initialization(monkeypatch):
    from miras.models import layer as layer_module
    from miras.tasks import make_task

    monkeypatch.setattr(layer_module, "feature_norm_bound", lambda rule, d: 1.0)  # lr 0.5
    spec = {**ELU, "model": {"d_model": 32, "n_heads": 2, "n_layers": 2}}
    task = make_task("mqar", seq_len=64, num_pairs=8)
    with pytest.raises(miras.TrainingDiverged) as err:
        miras.train(spec, task, steps=2, batch_size=4, progress=False)
    text = str(err.value)
    assert err.value.step == 1 and "the forward pass is nan" in text
    assert "before any update" in text and "lower the learning rate" not in text
    assert "memory layer (spec 'elu-deltanet'): its output is non-finite from token" in text


# Gates whose dtype differs from the inputs' are refused, naming the gate and the fix -----------


def test_gate_dtype_must_match_the_inputs():
    rule = miras.compile("specs/gated_deltanet.yaml")
    q, k, v, gates = random_inputs(rule, t=5, dtype=torch.float32)
    rule(q, k, v, gates)  # matching dtypes run
    wide = {**gates, "lr": gates["lr"].double()}
    with pytest.raises(ValueError) as info:
        rule(q, k, v, wide)
    assert str(info.value) == (
        "gates['lr']: the gate is float64 but q, k, v are float32; pass gates in the inputs' "
        "dtype, e.g. gates['lr'].to(q.dtype)"
    )
    q16, k16, v16 = (x.bfloat16() for x in (q, k, v))
    with pytest.raises(
        ValueError, match=r"gates\['decay'\]: the gate is float32 but q, k, v are bfloat16"
    ):
        rule(q16, k16, v16, gates)
