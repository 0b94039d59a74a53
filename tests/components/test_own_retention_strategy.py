"""A retention of the user's own with a derivation strategy of its own, written in its class
and nowhere else: the compiler runs the component's `derive_step`, with no table to extend.

The strategy here is the separable one with the stationarity condition solved by hand (the
objective is l2's, so the step is the gated-delta step a w0 - u): the compiled rule carries
that step, `miras derive` shows the strategy's own lines, and the rule runs."""

from __future__ import annotations

from typing import ClassVar, Literal

import pytest
import torch

import miras
from miras.components.base import UNIT, Range, Retention, gate_or
from miras.registry import registered
from tests.helpers import random_inputs


class HandSolvedRetention(Retention):
    """l2 retention whose argmin is written out instead of solved by sympy.

    Equation: W_t = a_t W_{t-1} - u_t
    """

    kind: Literal["hand_solved"] = "hand_solved"
    decay: gate_or(UNIT) = "gate"
    gateable: ClassVar[dict[str, Range]] = {"decay": UNIT}
    decay_gate: ClassVar[str | None] = "decay"
    linear_step: ClassVar[bool] = True

    def objective(self):
        from miras.derive.symbols import alpha, eta, u, w, w0

        return u * w + (w - w0) ** 2 / (2 * eta) + w**2 / (2 * alpha)

    def reparameterization(self):
        from miras.derive.symbols import alpha, eta, gate_symbol

        a = gate_symbol("decay")
        return {eta: 1 / a, alpha: 1 / (1 - a)}

    def derive_step(self):
        import sympy as sp

        from miras.derive.symbols import gate_symbol, u, w, w0

        step = gate_symbol("decay") * w0 - u
        return [("by hand", "J'(w) = u + w - a w0 = 0"), ("step", sp.Eq(w, step))], step


@pytest.fixture(scope="module", autouse=True)
def _registered():
    with registered(HandSolvedRetention):
        yield


def test_the_compiler_runs_the_retentions_own_strategy():
    from miras.derive.symbols import gate_symbol, u, w0

    rule = miras.compile({"name": "hand_solved_delta", "retention": "hand_solved"})
    assert rule.retention.step == gate_symbol("decay") * w0 - u
    text = str(rule.derivation())
    assert "by hand" in text and "J'(w) = u + w - a w0 = 0" in text
    assert not HandSolvedRetention.derives_separably()
    q, k, v, gates = random_inputs(rule, t=9)
    o, final = rule(q, k, v, gates, backend="recurrent", output_final_state=True)
    o_ref, final_ref = miras.compile({"name": "l2_delta", "retention": "l2"})(
        q, k, v, gates, backend="recurrent", output_final_state=True
    )
    torch.testing.assert_close(o, o_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(final, final_ref, rtol=1e-12, atol=1e-12)  # W, [B, H, Dv, Dk]
