"""miras.runtime.program.Program: the frozen compiled rule `run` takes below the facade.

- `MemoryRule.__call__` is `run(rule.program, ...)` under its autocast guard: the same outputs
  and states, on a matrix and a deep memory.
- `program.read(q, state)` is the memory's read with no update: at the last token of a
  sequence it gives the output the rule read there from its final state (the output is read
  after the step), for a matrix memory, a deep one and lq's normalized read.
- The Triton kernels reach the runtime through `program.kernels` only: a chunk or recurrent
  run never asks the provider; the triton backend asks it for its refusal first and refuses
  with it before any kernel is loaded; without a provider it is refused, naming why.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

import miras
from miras.runtime import run
from miras.runtime.program import Program
from tests.helpers import GATED_MOMENTUM, random_inputs

ROOT = Path(__file__).resolve().parents[2]
SPECS = {
    "deltanet": ROOT / "specs" / "deltanet.yaml",
    "gated_momentum": GATED_MOMENTUM,
    "lq": {"name": "lq_read", "retention": {"kind": "lq", "q": 3}},
}


def _rule(name):
    return miras.compile(SPECS[name], checked=False)


def test_the_program_is_frozen():
    program = _rule("deltanet").program
    with pytest.raises(dataclasses.FrozenInstanceError):
        program.plan = None


@pytest.mark.parametrize("name", ["deltanet", "gated_momentum"])
def test_the_rule_runs_its_program(name):
    rule = _rule(name)
    q, k, v, gates = random_inputs(rule, t=9)
    options = dict(backend="chunk", chunk_size=4, chunk_mode="start", output_final_state=True)
    o, state = rule(q, k, v, gates, **options)
    o_, state_ = run(rule.program, q, k, v, gates, **options)
    assert torch.equal(o, o_)
    states = (state, state_) if isinstance(state, dict) else ({"W": state}, {"W": state_})
    assert states[0].keys() == states[1].keys()
    assert all(torch.equal(states[0][n], states[1][n]) for n in states[0])


@pytest.mark.parametrize("name", list(SPECS))
def test_read_gives_the_output_at_the_last_token(name):
    rule = _rule(name)
    q, k, v, gates = random_inputs(rule, t=7)
    o, state = rule(q, k, v, gates, backend="recurrent", output_final_state=True)
    last = q[:, -1:].transpose(1, 2)  # [B, H, 1, Dk]
    read = rule.program.read(last, state)  # [B, H, 1, Dv]
    torch.testing.assert_close(read.transpose(1, 2), o[:, -1:], rtol=1e-12, atol=1e-12)


class Provider:
    """A kernel provider that records what the runtime asks of it."""

    def __init__(self, refusal):
        self.asked: list[str] = []
        self._refusal = refusal

    def refusal(self):
        self.asked.append("refusal")
        return self._refusal

    def gate_plan(self):
        self.asked.append("gate_plan")
        raise AssertionError("the gate plan is read only after the refusal passes")

    def module(self):
        self.asked.append("module")
        raise AssertionError("no kernel is loaded for a refused call")


def test_the_kernels_come_from_the_provider_and_only_on_the_triton_backend():
    rule = _rule("deltanet")
    provider = Provider("a reason of the provider's own")
    program = dataclasses.replace(rule.program, kernels=provider)
    q, k, v, gates = random_inputs(rule, t=5)
    for backend in ("recurrent", "chunk"):
        run(program, q, k, v, gates, backend=backend)
    assert provider.asked == []
    with pytest.raises(ValueError, match="a reason of the provider's own"):
        run(program, q, k, v, gates, backend="triton")
    assert provider.asked == ["refusal"]
    bare = dataclasses.replace(rule.program, kernels=None)
    with pytest.raises(ValueError, match=r"no Triton kernels .*Program\.kernels"):
        run(bare, q, k, v, gates, backend="triton")


def test_the_facade_supplies_the_compilers_provider():
    rule = _rule("deltanet")
    assert isinstance(rule.program, Program)
    assert rule.program.kernels.refusal() is None  # deltanet is covered
    assert rule.program.kernels.gate_plan().order == ("lr",)
