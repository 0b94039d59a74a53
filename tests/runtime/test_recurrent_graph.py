"""The recurrent references stay linear in T. Each token reads its slices of the inputs
through one `unbind` per input, whose backward is one stack, never through indexing the whole
tensor, whose backward adds a zero full-length gradient per token (quadratic in T: the
gated_deltanet backward at T = 4096 took 26 s before, 3.5 s after). And the token loops run
with Python's cycle collector paused, whose full collections over the objects a long loop
keeps alive made the forward grow faster than T (docs/benchmarks.md)."""

from __future__ import annotations

import gc
from collections import Counter
from pathlib import Path

import pytest
import torch
import yaml

import miras
from miras.runtime import exact_minimizer, recurrent
from miras.runtime.recurrent import TokenSlices
from tests.helpers import random_inputs

ROOT = Path(__file__).resolve().parents[2]


def graph_nodes(output: torch.Tensor) -> Counter:
    """The autograd graph behind `output`, counted by node type."""
    seen, todo, names = set(), [output.grad_fn], Counter()
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names[type(node).__name__] += 1
        todo.extend(parent for parent, _ in node.next_functions)
    return names


def leaves(rule, t: int):
    """`random_inputs` (float64, in the gates' ranges) as leaves that require grad."""
    q, k, v, gates = random_inputs(rule, t=t)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    return q, k, v, {n: g.requires_grad_() for n, g in gates.items()}


INDEXING = ("SelectBackward0", "SliceBackward0", "IndexBackward0")


def windowed_mesanet() -> dict:
    """specs/mesanet.yaml with a window of 3 tokens: the exact minimizer's `window_recurrent`."""
    spec = yaml.safe_load((ROOT / "specs/mesanet.yaml").read_text())
    return {**spec, "name": "mesanet_window", "window": {**spec["window"], "c": 3}}


@pytest.mark.parametrize("name", ["gated_deltanet", "titans", "mesanet", "mesanet_window"])
def test_no_token_indexes_a_whole_input(name):
    """The graph's indexing nodes do not grow with T (a per-token index would add one per
    token); the unbinds do not either, and the gradients reach every input."""
    spec = windowed_mesanet() if name == "mesanet_window" else ROOT / f"specs/{name}.yaml"
    rule = miras.compile(spec, checked=False)
    counts = []
    for t in (4, 8):
        q, k, v, gates = leaves(rule, t)
        o = rule(q, k, v, gates, backend="recurrent")[0]
        nodes = graph_nodes(o)
        counts.append({kind: nodes[kind] for kind in (*INDEXING, "UnbindBackward0")})
    assert counts[0] == counts[1], counts
    assert counts[1]["UnbindBackward0"] >= 3, counts  # q, k and v at least
    o.square().sum().backward()
    for x in (q, k, v, *gates.values()):
        assert x.grad is not None and x.grad.abs().sum() > 0


def test_token_slices_take_only_a_token_index():
    x = torch.arange(24.0).view(1, 2, 3, 4)
    slices = TokenSlices(x)
    assert torch.equal(slices[:, :, 2], x[:, :, 2])
    assert slices.shape == x.shape
    with pytest.raises(TypeError, match=r"index \[:, :, i\]"):
        slices[0]
    with pytest.raises(TypeError, match="must be an int"):
        slices[:, :, 1:2]


# Each recurrence's per-token call, to watch the collector from inside its loop.
PER_TOKEN = {
    "gated_deltanet": (recurrent, "step"),
    "mesanet": (exact_minimizer, "solve"),
    "mesanet_window": (exact_minimizer, "solve"),
}


@pytest.fixture
def collector_on():
    was = gc.isenabled()
    gc.enable()
    yield
    if not was:
        gc.disable()


@pytest.mark.parametrize("name", sorted(PER_TOKEN))
def test_the_token_loops_run_with_the_cycle_collector_paused(name, monkeypatch, collector_on):
    """Every token runs with the collector paused; it is back on after the call, and after a
    loop that raises; a caller's paused collector stays paused."""
    spec = windowed_mesanet() if name == "mesanet_window" else ROOT / f"specs/{name}.yaml"
    rule = miras.compile(spec, checked=False)
    q, k, v, gates = random_inputs(rule, t=5)
    module, attr = PER_TOKEN[name]
    real, enabled = getattr(module, attr), []

    def watched(*args, **kwargs):
        enabled.append(gc.isenabled())
        if len(enabled) == fail_at:
            raise RuntimeError("token 3 fails")
        return real(*args, **kwargs)

    monkeypatch.setattr(module, attr, watched)
    fail_at = None
    rule(q, k, v, gates, backend="recurrent")
    assert len(enabled) >= 5 and not any(enabled) and gc.isenabled()

    enabled.clear()
    fail_at = 3
    with pytest.raises(RuntimeError, match="token 3 fails"):
        rule(q, k, v, gates, backend="recurrent")
    assert enabled == [False] * 3 and gc.isenabled()

    fail_at = None
    gc.disable()
    rule(q, k, v, gates, backend="recurrent")
    assert not gc.isenabled()
