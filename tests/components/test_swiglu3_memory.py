"""A deep memory of the user's own, defined here and nowhere else: a 3-layer SwiGLU MLP.

It is registered the way a user's component is (`miras.registry.register`), writes only its
component hooks (`parameter_shapes`, `network`, `gradient_factors`), and gets every form a
deep memory qualifies for: the dual form of the chunk-start form (`chunk_mode="auto"`), the
per-token chunk-start path and the recurrence. The dual form equals the per-token path to the
tolerance of tests/runtime/test_dual_form.py (forward, final state and every gradient), and at chunk
size 1 it equals the recurrence. The memory's own forward and backward pass the memory
contract of tests/components/test_component_contracts.py.
"""

from __future__ import annotations

import math
from typing import Literal

import pytest
import torch

import miras
from miras.components.base import Memory, Range, number
from miras.components.memory.mlp import Activation, activation_functions
from miras.registry import registered
from tests.components.test_component_contracts import MemoryContract
from tests.helpers import assert_runs_close, chunk_grads, random_inputs

TOL = 1e-10  # tests/runtime/test_dual_form.py's


class SwiGLU3Memory(Memory):
    """A 3-layer SwiGLU MLP whose weights are the memory.

    Equation: M(x) = O (act(G2 h) * U2 h), h = act(G1 x) * U1 x
    """

    kind: Literal["swiglu3"] = "swiglu3"
    expansion: number(Range(0, 64, hi_closed=True)) = 2.0  # hidden width / input width
    activation: Activation = "silu"

    def parameter_shapes(self, d_in: int, d_out: int) -> dict[str, tuple[int, ...]]:
        hidden = max(1, math.ceil(self.expansion * d_in))
        return {
            "G1": (hidden, d_in),
            "U1": (hidden, d_in),
            "G2": (hidden, hidden),
            "U2": (hidden, hidden),
            "O": (d_out, hidden),
        }

    def emitted_functions(self):
        return activation_functions(self.activation)

    def network(self, names, linear, x, activation=None):
        a1, b1 = linear("G1", x), linear("U1", x)
        h1 = activation(a1) * b1
        a2, b2 = linear("G2", h1), linear("U2", h1)
        h2 = activation(a2) * b2
        return linear("O", h2), (x, a1, b1, h1, a2, b2, h2)

    def gradient_factors(self, names, transposed, cache, grad_y, activation=None, grad=None):
        x, a1, b1, h1, a2, b2, h2 = cache
        g_h2 = transposed("O", grad_y)
        e_g2, e_u2 = g_h2 * b2 * grad(a2), g_h2 * activation(a2)
        g_h1 = transposed("G2", e_g2) + transposed("U2", e_u2)
        e_g1, e_u1 = g_h1 * b1 * grad(a1), g_h1 * activation(a1)
        return {
            "G1": (e_g1, x),
            "U1": (e_u1, x),
            "G2": (e_g2, h1),
            "U2": (e_u2, h1),
            "O": (grad_y, h2),
        }


@pytest.fixture(scope="module", autouse=True)
def _registered():
    with registered(SwiGLU3Memory):
        yield


SPEC = {
    "name": "swiglu3_momentum",
    "memory": {"kind": "swiglu3", "expansion": 1.5},
    "bias": {"kind": "huber", "delta": "gate"},
    "retention": "l2",
    "optimizer": "momentum",
    "window": {"c": 2, "gamma": "gate"},
}
B, T, H, D = 2, 30, 2, 4


class TestSwiGLU3Memory(MemoryContract):
    memory = SwiGLU3Memory(expansion=1.5)
    d_out = 4

    def reference(self, weights, x):
        act = torch.nn.functional.silu
        h = act(weights["G1"] @ x) * (weights["U1"] @ x)
        return weights["O"] @ (act(weights["G2"] @ h) * (weights["U2"] @ h))

    @pytest.fixture(scope="class")
    @staticmethod
    def rule():
        return miras.compile(SPEC)

    @staticmethod
    def _run(rule, mode, chunk_size, seed=3):
        q, k, v, gates = random_inputs(rule, b=B, t=T, h=H, dk=D, dv=D, seed=seed)
        params = {n: p.clone() for n, p in rule.default_params(torch.float64).items()}
        # A non-zero momentum, so its carry into the first chunk is exercised too.
        init = {
            n: s + 0.01 if n.startswith("S.") else s
            for n, s in rule.initial_state(B, H, D, D, torch.float64).items()
        }
        return chunk_grads(
            rule, q, k, v, gates, init, params, chunk_size=chunk_size, chunk_mode=mode
        )

    def test_the_compiler_gives_it_the_dual_form(self, rule):
        assert rule.plan.chunk_form.form == "dual"
        assert "the swiglu3 memory's gradient is a product of per-token factors" in str(
            rule.derivation()
        )

    @pytest.mark.parametrize("chunk_size", [7, 16])
    def test_dual_form_equals_the_per_token_path(self, rule, chunk_size, monkeypatch):
        from miras.runtime import dual

        calls = []
        step = dual.chunk_step
        monkeypatch.setattr(dual, "chunk_step", lambda *a, **kw: calls.append(1) or step(*a, **kw))
        got = self._run(rule, "auto", chunk_size)
        assert len(calls) == -(-T // chunk_size)  # the dual form ran, once per chunk
        want = self._run(rule, "start", chunk_size)
        assert len(calls) == -(-T // chunk_size)  # "start" kept the per-token path
        assert_runs_close(got, want, TOL)
        weights = ["G1", "U1", "G2", "U2", "O"]
        assert rule.runtime.param_names == weights
        assert {*weights, *(f"S.{n}" for n in weights)} <= set(got[1])  # W and momentum

    def test_dual_form_at_chunk_size_one_is_the_recurrence(self, rule):
        """Forward, final state and the gradients with respect to q, k, v, every gate and the
        initial state, against the recurrent backend."""
        q, k, v, gates = random_inputs(rule, b=B, t=11, h=H, dk=D, dv=D, seed=5)
        init = rule.initial_state(B, H, D, D, torch.float64)
        leaves = [q, k, v, *gates.values(), *init.values()]
        results = []
        for backend in ("chunk", "recurrent"):
            inputs = [x.detach().clone().requires_grad_(True) for x in leaves]
            q_, k_, v_ = inputs[:3]
            g_ = dict(zip(gates, inputs[3 : 3 + len(gates)], strict=True))
            s_ = dict(zip(init, inputs[3 + len(gates) :], strict=True))
            o, final = rule(
                q_,
                k_,
                v_,
                g_,
                initial_state=s_,
                backend=backend,
                chunk_size=1,
                output_final_state=True,
            )
            weights = torch.Generator().manual_seed(7)
            loss = (o * torch.randn(o.shape, generator=weights, dtype=o.dtype)).sum()
            loss = loss + sum(final[n].square().sum() for n in sorted(final))
            loss.backward()
            results.append((o.detach(), {n: w.detach() for n, w in final.items()}, inputs))
        (o, final, inputs), (o_ref, final_ref, inputs_ref) = results
        torch.testing.assert_close(o, o_ref, rtol=TOL, atol=TOL)
        assert list(final) == list(final_ref)
        for key in final:
            torch.testing.assert_close(final[key], final_ref[key], rtol=TOL, atol=TOL, msg=key)
        for x, x_ref in zip(inputs, inputs_ref, strict=True):
            assert x.grad is not None and x_ref.grad is not None
            torch.testing.assert_close(x.grad, x_ref.grad, rtol=TOL, atol=TOL)
