"""Bounded memory for deep memories on the chunk-start general path (miras/runtime/chunk.py).

- The recomputing backward (`_BoundedChunk`: only chunk-start states kept, one chunk recomputed
  at a time) equals the storing one (`recomputes` patched off, or `recompute=False`: autograd
  keeps every token's weights) to 1e-10 in float64: outputs, final state, and the gradients with respect to q, k,
  v, every gate, the initial state and the feature map's parameters.
- The bytes autograd keeps between the forward and the backward, and their peak over both
  (the recompute of one chunk included), grow like T / b copies of the state, not T: counted
  with `torch.autograd.graph.saved_tensors_hooks` and held to bounds computed from the shapes.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import miras
from miras.runtime import chunk
from tests.helpers import GATED_MOMENTUM, chunk_grads, random_inputs

SPECS = Path(__file__).resolve().parents[2] / "specs"
TOL = 1e-10


def compiled(name):
    return miras.compile(GATED_MOMENTUM if name == "gated_momentum" else SPECS / f"{name}.yaml")


def storing(monkeypatch):
    monkeypatch.setattr(chunk, "recomputes", lambda rt: False)


def run_with_grads(rule, t_len, chunk_size):
    q, k, v, gates = random_inputs(rule, b=2, t=t_len, h=2, dk=4, dv=4, seed=3)
    params = {
        n: p.clone().requires_grad_(True) for n, p in rule.default_params(torch.float64).items()
    }
    init = {
        n: s.clone().requires_grad_(True)
        for n, s in rule.initial_state(2, 2, 4, 4, torch.float64).items()
    }
    # A non-zero momentum, so its gradient path is exercised too.
    init = {
        n: (s + 0.01 if n.startswith("S.") else s).detach().requires_grad_(True)
        for n, s in init.items()
    }
    o, final, grads = chunk_grads(
        rule, q, k, v, gates, init, params, chunk_size=chunk_size, chunk_mode="start"
    )
    return o, final, list(grads.values())


@pytest.mark.parametrize("name", ["titans", "memora", "moneta", "atlas", "gated_momentum"])
@pytest.mark.parametrize("t_len,chunk_size", [(63, 7), (100, 16)])
def test_recomputing_backward_equals_storing(name, t_len, chunk_size, monkeypatch):
    rule = compiled(name)
    assert chunk.recomputes(rule.runtime)
    o, final, grads = run_with_grads(rule, t_len, chunk_size)
    with monkeypatch.context() as m:
        storing(m)
        o_s, final_s, grads_s = run_with_grads(rule, t_len, chunk_size)
    torch.testing.assert_close(o, o_s, rtol=TOL, atol=TOL)
    assert list(final) == list(final_s)
    for n in final:
        torch.testing.assert_close(final[n], final_s[n], rtol=TOL, atol=TOL)
    for a, b in zip(grads, grads_s, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=TOL, atol=TOL)
    # q, k, v, the gates and the initial weights all get gradients.
    assert all(g is not None for g in grads[: 3 + len(rule.plan.gates)])


def test_matrix_memory_recomputes_too():
    rule = miras.compile({"name": "kl_matrix", "memory": "matrix", "retention": "kl"})
    assert rule.runtime.start_path == "general" and chunk.recomputes(rule.runtime)


class Saved:
    """A tensor autograd saved, counted while autograd holds it (it drops the packed object when
    the backward has used it): `live` bytes now, `peak` over the forward and the backward."""

    live = 0
    peak = 0

    def __init__(self, x: torch.Tensor):
        self.x, self.size = x, x.numel() * x.element_size()
        Saved.live += self.size
        Saved.peak = max(Saved.peak, Saved.live)

    def __del__(self):
        Saved.live -= self.size


def saved_bytes(rule, t_len, chunk_size, d, **options):
    """(bytes autograd keeps from the forward for the backward, peak saved bytes over forward and
    backward) for B = H = 1, Dk = Dv = d. Includes the tensors the bounded backward saves while
    it recomputes a chunk."""
    q, k, v, gates = random_inputs(rule, b=1, t=t_len, h=1, dk=d, dv=d, seed=1)
    for x in [q, k, v, *gates.values()]:
        x.requires_grad_(True)
    Saved.live = Saved.peak = 0
    with torch.autograd.graph.saved_tensors_hooks(Saved, lambda s: s.x):
        o, _ = rule(
            q, k, v, gates, backend="chunk", chunk_mode="start", chunk_size=chunk_size, **options
        )
        kept = Saved.live
        o.sum().backward()
    return kept, Saved.peak


@pytest.mark.parametrize("name", ["titans", "moneta"])
def test_saved_bytes_grow_like_chunks_not_tokens(name, monkeypatch):
    rule = compiled(name)
    d, b = 16, 16
    state = rule.initial_state(1, 1, d, d, torch.float64)
    state_bytes = sum(s.numel() * s.element_size() for s in state.values())
    weight_bytes = sum(state[n].numel() * 8 for n in rule.runtime.param_names)
    # Per token, q, k, v, valid and the gates: a few copies of these may be kept by the ops
    # around the chunk loop (the feature map, the transposes).
    token_bytes = (3 * d + 1 + len(rule.plan.gates)) * 8
    # The recompute of one chunk keeps, per token, its gradient, update and weights (and
    # momentum): a few copies of the state each, for b tokens at a time.
    chunk_bytes = 4 * b * state_bytes
    measured = {}
    for t_len in (256, 512):
        kept_bound = (t_len // b + 1) * state_bytes + 8 * t_len * token_bytes
        kept, peak = saved_bytes(rule, t_len, b, d)
        assert kept <= kept_bound, (t_len, kept, kept_bound)
        assert peak <= kept_bound + chunk_bytes, (t_len, peak, kept_bound + chunk_bytes)
        measured[t_len] = peak
        with monkeypatch.context() as m:
            storing(m)
            kept_storing, _ = saved_bytes(rule, t_len, b, d)
        # The storing path keeps every token's weights: the bound above would fail for it.
        assert kept_storing > t_len * weight_bytes > kept_bound + chunk_bytes
    # 256 more tokens add 256 / b chunk-start states (and token-sized tensors), not 256 states.
    growth_bound = (256 // b) * state_bytes + 8 * 256 * token_bytes
    assert measured[512] - measured[256] <= growth_bound, (measured, growth_bound)


def test_recompute_chooses_the_backward_on_either_memory():
    """`recompute=False` overrides the default (`chunk.recomputes`, on for every memory): a
    deep memory and a matrix memory each keep every token's weights then; the numbers are the
    same."""
    titans = compiled("titans")
    d, b, t_len = 16, 16, 256
    weight_bytes = sum(
        s.numel() * 8
        for n, s in titans.initial_state(1, 1, d, d, torch.float64).items()
        if n in titans.runtime.param_names
    )
    kept_default, _ = saved_bytes(titans, t_len, b, d)
    kept_storing, _ = saved_bytes(titans, t_len, b, d, recompute=False)
    assert kept_default < t_len * weight_bytes < kept_storing

    matrix = miras.compile({"name": "kl_matrix", "memory": "matrix", "retention": "kl"})
    kept_default, _ = saved_bytes(matrix, t_len, b, d)
    kept_storing, _ = saved_bytes(matrix, t_len, b, d, recompute=False)
    assert kept_default < kept_storing / 2

    q, k, v, gates = random_inputs(titans, b=1, t=40, h=2, dk=4, dv=4, seed=2)
    leaves = [q, k, v, *gates.values()]
    for x in leaves:
        x.requires_grad_(True)
    got = {}
    for recompute in (True, False):
        o, _ = titans(q, k, v, gates, chunk_mode="start", chunk_size=8, recompute=recompute)
        got[recompute] = [o, *torch.autograd.grad(o.square().sum(), leaves)]
    for a, c in zip(got[True], got[False], strict=True):
        torch.testing.assert_close(a, c, rtol=TOL, atol=TOL)


def test_recompute_must_be_a_bool_or_none():
    rule = compiled("titans")
    q, k, v, gates = random_inputs(rule, b=1, t=4, h=1, dk=4, dv=4)
    with pytest.raises(ValueError, match=r"recompute: expected True, False or None .*got 'yes'"):
        rule(q, k, v, gates, recompute="yes")
