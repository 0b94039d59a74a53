"""The dual form of deep memories (miras/runtime/dual.py) against the per-token chunk-start path.

- It computes the chunk-start form of `miras.runtime.chunk` (`chunk_mode="start"`, the
  separately written reference) to 1e-10 in float64: outputs, final state, and the gradients
  with respect to q, k, v, every gate, the initial state and the feature map's parameters.
- It never builds a tensor with a chunk axis next to both axes of a weight: every op's output
  is seen by a `TorchDispatchMode`, forward and backward, and the same check fails on the
  per-token path.
- The compiler records the form and `miras derive` says it; `chunk_mode` picks the path.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import miras
from miras.runtime import chunk, dual
from tests.helpers import GATED_MOMENTUM, chunk_grads, random_inputs

SPECS = Path(__file__).resolve().parents[2] / "specs"
TOL = 1e-10
CASES = {
    "titans": SPECS / "titans.yaml",  # mlp, l2 bias, l2 retention, momentum
    "yaad": SPECS / "yaad.yaml",  # residual + LN mlp, huber bias (gated delta), l2, gd
    "gated_momentum": GATED_MOMENTUM,
    "residual_retained": {  # residual + LN, three layers, the retained gradient point
        "name": "residual_retained",
        "memory": {"kind": "mlp", "depth": 3, "expansion": 2, "residual_norm": True},
        "bias": "l2",
        "retention": {"kind": "l2", "grad_at": "retained"},
        "optimizer": "momentum",
    },
}


# The residual + LN form is ill-conditioned at the helpers' learning rates (up to 0.5): LN's
# backward scales the error by 1/std, the gradients with respect to early inputs and W_0 grow
# to 1e5 over 63 tokens, and the rounding of two equal computations grows with them (yaad:
# relative 1e-15 at T = 7, 1e-11 at T = 35). Those cases run where the memory is stable:
# learning rates scaled by 0.05 and W_0 by 3 (the largest gradients are then 1e3-1e4).
CONDITIONING = {"yaad": (0.05, 3.0), "residual_retained": (0.05, 3.0)}


def run_with_grads(rule, mode, t_len, chunk_size):
    lr_scale, w_scale = CONDITIONING.get(rule.spec.name, (1.0, 1.0))
    q, k, v, gates = random_inputs(rule, b=2, t=t_len, h=2, dk=4, dv=4, seed=3)
    gates["lr"] = gates["lr"] * lr_scale
    params = {
        n: p.clone().requires_grad_(True) for n, p in rule.default_params(torch.float64).items()
    }
    # A non-zero momentum, so its carry into the first chunk is exercised too.
    init = {
        n: (s + 0.01 if n.startswith("S.") else w_scale * s).requires_grad_(True)
        for n, s in rule.initial_state(2, 2, 4, 4, torch.float64).items()
    }
    return chunk_grads(rule, q, k, v, gates, init, params, chunk_size=chunk_size, chunk_mode=mode)


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("t_len,chunk_size", [(63, 7), (100, 16)])
def test_dual_form_equals_the_per_token_path(name, t_len, chunk_size, monkeypatch):
    rule = miras.compile(CASES[name])
    assert rule.plan.chunk_form.form == "dual"
    calls = []
    monkeypatch.setattr(dual, "chunk_step", _spy(dual.chunk_step, calls))
    o, final, grads = run_with_grads(rule, "auto", t_len, chunk_size)
    assert len(calls) == -(-t_len // chunk_size)
    o_ref, final_ref, grads_ref = run_with_grads(rule, "start", t_len, chunk_size)
    assert len(calls) == -(-t_len // chunk_size)  # "start" kept the per-token path
    torch.testing.assert_close(o, o_ref, rtol=TOL, atol=TOL)
    assert list(final) == list(final_ref)
    for key in final:
        torch.testing.assert_close(final[key], final_ref[key], rtol=TOL, atol=TOL, msg=key)
    assert list(grads) == list(grads_ref)
    for key, g in grads.items():
        if grads_ref[key] is None:
            assert g is None, key
            continue
        assert g is not None, key
        torch.testing.assert_close(g, grads_ref[key], rtol=TOL, atol=TOL, msg=key)


def _spy(fn, calls):
    def spy(*args, **kwargs):
        calls.append(1)
        return fn(*args, **kwargs)

    return spy


class LargestOutputs(TorchDispatchMode):
    """Every op's outputs: the largest numel seen, and the shapes at or above `limit`."""

    def __init__(self, limit: int):
        super().__init__()
        self.limit, self.largest, self.over = limit, 0, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
                if t.numel() >= self.limit:
                    self.over.append((str(func), tuple(t.shape)))
        return out


# B = H = 1, Dk = Dv = 8: titans' weights are [32, 8] and [8, 32] (256 entries), so one
# chunk's per-token weights [1, 1, 8, 32, 8] would be 2048 entries.
T_SMALL, CHUNK_SMALL, D_SMALL = 32, 8, 8


def _forward_backward(rule, mode):
    q, k, v, gates = random_inputs(rule, b=1, t=T_SMALL, h=1, dk=D_SMALL, dv=D_SMALL, seed=1)
    for x in [q, k, v, *gates.values()]:
        x.requires_grad_(True)
    o, _ = rule(q, k, v, gates, backend="chunk", chunk_mode=mode, chunk_size=CHUNK_SMALL)
    o.square().sum().backward()
    return q.grad


@pytest.mark.parametrize("name", ["titans", "gated_momentum"])
def test_dual_form_builds_no_per_token_weights(name):
    rule = miras.compile(CASES[name])
    shapes = rule.runtime.shapes(D_SMALL, D_SMALL)
    limit = CHUNK_SMALL * min(o * i for o, i in shapes.values())
    window, hidden = rule.spec.window.c, max(max(s) for s in shapes.values())
    # The shapes tell the two apart: the sequence's keys ([T, D] per head, c copies for the
    # window's rows) and a layer's activations over one chunk's window rows ([b c, hidden])
    # stay under one chunk of per-token weights.
    assert T_SMALL * D_SMALL * window < limit and CHUNK_SMALL * window * hidden < limit
    with LargestOutputs(limit) as seen:
        _forward_backward(rule, "auto")
    assert seen.over == [], seen.over[:5]
    assert seen.largest > 0
    with LargestOutputs(limit) as seen_start:  # the check can fail: the per-token path
        _forward_backward(rule, "start")
    assert seen_start.over, "the per-token path built no per-token weights?"


@pytest.mark.parametrize(
    ("spec", "form"),
    [
        ("titans", "dual"),
        ("yaad", "dual"),
        ("dla", "dual"),
        ("sw_deep_transformer", "dual"),
        ("deep_omega_transformer", "dual"),
        ("atlas", "start"),  # muon
        ("memora", "start"),  # KL retention
        ("moneta", "start"),  # lq retention
        ("deep_transformer", "start"),  # window: global
        ("gated_deltanet", "exact"),  # a matrix memory
    ],
)
def test_the_compiler_records_the_dual_form(spec, form):
    rule = miras.compile(SPECS / f"{spec}.yaml")
    assert rule.plan.chunk_form.form == form


def test_derive_reports_the_dual_form_and_why():
    text = str(miras.compile(SPECS / "titans.yaml").derivation())
    assert "chunk: dual form (the mlp memory's gradient is a product of per-token factors" in text
    assert "retention l2 and optimizer momentum are linear in it" in text
    text = str(miras.compile(SPECS / "atlas.yaml").derivation())
    assert "chunk: chunk-start approximation (Titans section 3.2)" in text
    assert "dual form" not in text


def test_exact_is_refused_with_the_reason():
    rule = miras.compile(SPECS / "titans.yaml")
    q, k, v, gates = random_inputs(rule, t=8)
    with pytest.raises(ValueError, match="prediction is not linear in its weights"):
        rule(q, k, v, gates, backend="chunk", chunk_mode="exact")


def test_chunk_size_one_is_the_recurrence():
    rule = miras.compile(CASES["gated_momentum"])
    q, k, v, gates = random_inputs(rule, t=11)
    o, final = rule(q, k, v, gates, backend="chunk", chunk_size=1, output_final_state=True)
    o_ref, final_ref = rule(q, k, v, gates, backend="recurrent", output_final_state=True)
    torch.testing.assert_close(o, o_ref, rtol=TOL, atol=TOL)
    for key in final_ref:
        torch.testing.assert_close(final[key], final_ref[key], rtol=TOL, atol=TOL, msg=key)


def test_per_token_path_is_still_the_reference_module():
    """`chunk_mode="start"` runs `miras.runtime.chunk`'s general path on a dual spec."""
    rule = miras.compile(SPECS / "titans.yaml")
    assert rule.runtime.start_path == "general" and chunk.recomputes(rule.runtime)


@pytest.mark.parametrize("name", ["titans_mlp", "moneta_mlp", "gated_mlp_huber"])
def test_dual_form_equals_the_autograd_chunk_loop(name):
    """Also against tests/runtime/test_runtime.py's plain loop (inner gradients by autograd)."""
    from tests.runtime.test_runtime import chunk_reference
    from tests.runtime.test_runtime import compiled as runtime_spec

    rule = runtime_spec(name)
    if name == "moneta_mlp":  # its lq retention has no dual form: the same memory and bias on l2
        rule = miras.compile({**rule.spec.model_dump(), "name": "moneta_l2", "retention": "l2"})
    assert rule.plan.chunk_form.form == "dual"
    q, k, v, gates = random_inputs(rule, t=40, b=1, seed=3)
    o, state = rule(q, k, v, gates, backend="chunk", chunk_size=16, output_final_state=True)
    o_ref, state_ref = chunk_reference(rule, q, k, v, gates, 16, rule.default_params(q.dtype))
    torch.testing.assert_close(o, o_ref, rtol=1e-9, atol=1e-9)
    for key, expected in state_ref.items():
        torch.testing.assert_close(state[key], expected, rtol=1e-9, atol=1e-9, msg=key)


def test_decoding_continues_a_dual_prefill():
    """A `MirasLayer` on titans decodes in the dual form's own semantics: after a prefill of
    two chunks, tokens one by one (each rerunning the partial third chunk from its start
    state) equal the dual form over the whole sequence."""
    from miras.models import MirasLayer

    torch.manual_seed(0)
    layer = MirasLayer(SPECS / "titans.yaml", 16, 2, chunk_size=4).double()
    x = torch.randn(2, 11, 16, dtype=torch.float64)
    _, cache = layer(x[:, :8], layer.empty_cache(2))
    steps = []
    for t in range(8, 11):
        y, cache = layer(x[:, t : t + 1], cache)
        steps.append(y)
    whole, _ = layer(x)
    torch.testing.assert_close(torch.cat(steps, 1), whole[:, 8:], rtol=TOL, atol=TOL)
