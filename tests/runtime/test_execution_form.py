"""The execution form is recorded in the IR whole: the compiler's chunk_form pass records the
chunk-start path (`ChunkForm.start_path`), and the runtime dispatches on that record alone."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

import miras
from miras.runtime import linear
from tests.helpers import random_inputs


@pytest.mark.parametrize(
    ("spec", "form", "path"),
    [
        ({"name": "gdn", "retention": {"kind": "l2", "grad_at": "retained"}}, "exact", "linear"),
        ({"name": "yaad_matrix", "bias": "huber", "retention": "l2"}, "start", "linear"),
        ({"name": "mom", "optimizer": "momentum", "retention": "l2"}, "exact", "linear"),
        ({"name": "moneta_matrix", "bias": "l2", "retention": "lq"}, "start", "general"),
        ({"name": "muon_matrix", "optimizer": "muon"}, "start", "general"),
        # The dual form under "auto"; chunk_mode="start" takes the general path.
        ({"name": "mlp", "memory": {"kind": "mlp", "depth": 2}}, "dual", "general"),
        ({"name": "mlp_muon", "memory": {"kind": "mlp"}, "optimizer": "muon"}, "start", "general"),
    ],
)
def test_the_chunk_form_pass_records_the_start_path(spec, form, path):
    chunk_form = miras.compile(spec).plan.chunk_form
    assert (chunk_form.form, chunk_form.start_path) == (form, path)


def test_the_runtime_takes_the_path_the_ir_records(monkeypatch):
    """Same spec, two records: the linear module runs only where the IR says "linear", and
    both paths compute the same chunk-start form."""
    shared = miras.compile({"name": "yaad_matrix", "bias": "huber", "retention": "l2"})
    rule = copy.copy(shared)  # its own program below: miras.compile's rule is shared
    calls = []
    original = linear.forward

    def spy(rt, seq, state, chunk_size):
        calls.append(rt.start_path)
        return original(rt, seq, state, chunk_size)

    monkeypatch.setattr(linear, "forward", spy)
    q, k, v, gates = random_inputs(rule, b=1, t=10, h=2, dk=4, dv=4)
    fast, _ = rule(q, k, v, gates=gates, backend="chunk", chunk_size=4)
    assert calls == ["linear"]

    runtime = dataclasses.replace(rule.runtime, start_path="general")
    rule.program = dataclasses.replace(rule.program, runtime=runtime)
    general, _ = rule(q, k, v, gates=gates, backend="chunk", chunk_size=4)
    assert calls == ["linear"]  # the general path ran, though the spec's pieces are linear
    torch.testing.assert_close(general, fast, rtol=1e-10, atol=1e-12)
    assert shared.runtime.start_path == "linear"  # the shared rule is untouched
    assert miras.compile({"name": "yaad_matrix", "bias": "huber", "retention": "l2"}) is shared
