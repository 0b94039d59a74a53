"""A closed-form memory of one's own, and the memory hooks the code outside asks.

A memory that declares `closed_form` and writes its run and its oracle gets the forms
registry's closed form, the end-to-end check against its own oracle, the plan's schedule and
chunk form from its own words, and the check's sizes and memory estimate from its `lookback`:
nothing outside the component asks for softmax attention by name."""

from __future__ import annotations

from typing import Literal

import pytest
import torch

import miras
from miras.checks.end_to_end import check_end_to_end
from miras.checks.inputs import sizes_for
from miras.components.memory.nonparametric import NonparametricMemory
from miras.registry import registered
from miras.resources import check_estimate, check_work
from miras.spec import load_spec

f64 = torch.float64


class CausalMean(NonparametricMemory):
    """The mean of the values of the last `span` tokens: a closed form with uniform weights,
    whose reach is its own field (not `window`)."""

    kind: Literal["causal_mean"] = "causal_mean"
    span: int = 12

    def closed_form(self) -> str:
        return "a causal mean"

    def run_closed_form(self, q, k, v):
        """v [B, H, T, Dv] -> o [B, H, T, Dv]: each token's mean over the last `span`."""
        i = torch.arange(v.shape[2])
        distance = i[:, None] - i[None, :]
        mask = ((distance >= 0) & (distance < self.span)).to(v.dtype)  # [T, T]
        return (mask / mask.sum(-1, keepdim=True)) @ v

    def reference_closed_form(self, q, k, v):
        """v [B, T, H, Dv] -> o [B, T, H, Dv], token by token."""
        t = v.shape[1]
        return torch.stack([v[:, max(0, s - self.span + 1) : s + 1].mean(1) for s in range(t)], 1)

    def schedule(self) -> str:
        return "closed form: a causal mean of the values (no inner optimization)"

    def lookback(self, spec) -> int:
        return self.span

    def lookback_fields(self, spec) -> dict:
        return {"memory.span": self.span}


class WrongMean(CausalMean):
    """A causal mean whose run is twice its oracle: the check must see it."""

    kind: Literal["wrong_mean"] = "wrong_mean"

    def run_closed_form(self, q, k, v):
        return 2 * super().run_closed_form(q, k, v)


def mean_rule(cls=CausalMean, span: int = 12):
    return miras.compile({"name": cls.__name__, "memory": {"kind": cls().kind, "span": span}})


def test_the_forms_registry_runs_the_memorys_own_closed_form():
    with registered(CausalMean):
        rule = mean_rule(span=3)
        gen = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(2, 7, 2, 4, generator=gen, dtype=f64) for _ in range(3))
        expected = CausalMean(span=3).reference_closed_form(q, k, v)
        for backend in ("recurrent", "chunk"):
            o, final = rule(q, k, v, backend=backend)
            torch.testing.assert_close(o, expected)
            assert final is None
        with pytest.raises(ValueError, match="a causal mean carries no state here; pass None"):
            rule(q, k, v, initial_state=torch.zeros(2, 2, 4, 4, dtype=f64))


def test_the_plan_and_the_chunk_form_say_what_the_memory_says():
    with registered(CausalMean):
        plan = mean_rule().plan
    assert plan.schedule == "closed form: a causal mean of the values (no inner optimization)"
    assert plan.chunk_form.reason == "a causal mean is computed in closed form; nothing to chunk"
    assert plan.gates == ()  # no inner step for the optimizer's lr gate to scale


def test_the_end_to_end_check_compares_the_run_with_the_memorys_oracle():
    with registered(CausalMean), registered(WrongMean):
        right = check_end_to_end(mean_rule(), triton=False)
        wrong = check_end_to_end(mean_rule(WrongMean), triton=False)
    assert right and all(r.passed for r in right)
    assert wrong and not any(r.passed for r in wrong)


def test_the_check_reaches_past_the_memorys_lookback():
    with registered(CausalMean):
        rule = mean_rule(span=12)
        assert sizes_for(rule).length == 15  # the span, and 3 tokens past it
        estimate = check_estimate(rule.spec, 15, 2, 4)
        check_work(rule.spec, 10_000)  # the mean's oracle sums no window terms
    (part,) = estimate.parts
    assert part.fields == {"memory.span": 12, "T": 15}
    # float64 per head and token: the state-sized trace (16 x Dk Dk), the 12 tokens in reach
    # (4 x 12 x (Dk + Dk)) and the oracle's 15 scores (4 x 15).
    assert part.bytes == 8 * 2 * 15 * (16 * 16 + 4 * 12 * 8 + 4 * 15)


def test_a_memory_of_weights_reads_the_feature_map_and_the_omega_window():
    spec = load_spec({"name": "w", "feature_map": "taylor", "window": {"c": 4}})
    memory = spec.memory
    assert memory.closed_form() is None
    assert memory.feature_width(spec, 4) == spec.feature_map.output_dim(4) != 4
    assert memory.lookback(spec) == 4 and memory.lookback_fields(spec) == {"window.c": 4}
    assert memory.oracle_cost(spec, 9) == (9 * 4, 0)
    whole = load_spec({"name": "g", "window": {"c": "global"}})
    assert whole.memory.lookback(whole) is None
    assert whole.memory.oracle_cost(whole, 9) == (9 * 9, 0)
    with pytest.raises(NotImplementedError, match="memory 'matrix' has no closed form"):
        memory.run_closed_form(None, None, None)


def test_softmax_attention_answers_with_its_window():
    spec = load_spec({"name": "swa", "memory": {"kind": "nonparametric", "window": 5}})
    memory = spec.memory
    assert memory.closed_form() == "softmax attention"
    assert memory.feature_width(spec, 4) == 4
    assert memory.lookback(spec) == 5 and memory.lookback_fields(spec) == {"memory.window": 5}
    assert memory.oracle_cost(spec, 9) == (0, 9)
    full = load_spec({"name": "a", "memory": "nonparametric"})
    assert full.memory.lookback(full) is None
    assert full.memory.lookback_fields(full) == {"memory.window": "the sequence"}
