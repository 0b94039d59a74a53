"""An optimizer of the user's own, written in its class and nowhere else: a heavy-ball step
with a fixed factor, S_t = 0.9 S_{t-1} + g_t, u_t = lr_t S_t (the step size outside the
momentum, unlike `momentum`'s S_t = theta_t S_{t-1} + lr_t g_t).

Its `update_expressions` are all the fast forms need: the compiler proves the step linear and
records it (`plan.linear_step`), and the exact form (its scan in torch and in the Triton scan
kernels, under TRITON_INTERPRET=1), the linear chunk-start path and the dual form of a deep
memory run it, each equal to its reference: the recurrence, or the recurrence with every
gradient of a chunk taken at the chunk's start state (a token loop written out below). The
emitted Triton chunk kernels print its lines from the same record (`backend="triton"`: the
general template, the step size applied per token since the gradient term carries none)."""

from __future__ import annotations

from typing import ClassVar, Literal

import pytest
import torch

import miras
from miras.components.base import NONNEGATIVE, Optimizer, Range, gate_or
from miras.ir import Coefficient
from miras.registry import registered
from tests.helpers import assert_runs_close, chunk_grads, projection_grads, random_inputs

FACTOR = 0.9
f64 = torch.float64
TOL = 1e-10  # float64: equal computations up to rounding

pytestmark = pytest.mark.usefixtures("one_thread")


class HeavyBall(Optimizer):
    """Heavy-ball momentum of the raw gradient with a fixed factor, scaled by the step size.

    Equation: s_t = 0.9 s_{t-1} + g_t,  u_t = b_t s_t
    """

    kind: Literal["heavy_ball"] = "heavy_ball"
    lr: gate_or(NONNEGATIVE) = "gate"
    gateable: ClassVar[dict[str, Range]] = {"lr": NONNEGATIVE}
    stateful: ClassVar[bool] = True
    step_size_gate: ClassVar[str | None] = "lr"  # b_t: what a layer bounds and fla's ops call beta

    def update(self, grad, state, lr):
        s = grad if state is None else FACTOR * state + grad
        return lr * s, s

    def update_lines(self) -> list:
        from miras.derive.terms import Line, Name, Plus, scalar, sym, times

        kept = times(Name(f"{FACTOR:g}"), sym("S_{t-1}"))
        return [
            Line(sym("S_t"), Plus((kept, sym("g_t")))),
            Line(sym("u_t"), times(scalar(self.lr, "lr"), sym("S_t"))),
        ]

    def update_expressions(self):
        import sympy as sp

        from miras.derive.symbols import g, gate_symbol, s_new, s_prev

        return gate_symbol("lr") * s_new, sp.Rational(9, 10) * s_prev + g


@pytest.fixture(scope="module", autouse=True)
def _registered():
    with registered(HeavyBall):
        yield


MATRIX = {"name": "heavy_ball", "bias": "l2", "retention": "l2", "optimizer": "heavy_ball"}
DEEP = {**MATRIX, "name": "heavy_ball_mlp", "memory": "mlp"}


def compiled(fields: dict):
    return miras.compile(fields)


def inputs(rule, t_len: int, seed: int = 3):
    q, k, v, gates = random_inputs(rule, b=2, t=t_len, h=2, dk=4, dv=4, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    init = {
        n: (0.3 * torch.randn(s.shape, generator=gen, dtype=f64))
        for n, s in rule.initial_state(2, 2, 4, 4, f64).items()
    }
    return q, k, v, gates, init


def run(rule, t_len, *, chunk_size, mode, backend="chunk"):
    """o, final state and the gradients of a random functional of both (`chunk_grads`)."""
    q, k, v, gates, init = inputs(rule, t_len)
    return chunk_grads(
        rule, q, k, v, gates, init, {}, chunk_size=chunk_size, chunk_mode=mode, backend=backend
    )


def heavy_ball_loop(q, k, v, gates, init, block):
    """The heavy-ball step on a matrix memory written out, one token at a time, with the l2
    bias and l2 retention; every gradient of a block of `block` tokens at the block's start
    state (1: the recurrence). q, k [B, T, H, Dk], v [B, T, H, Dv], gates [B, T, H]."""
    w, s = init["W"], init["S.W"]
    outputs = []
    for t in range(q.shape[1]):
        if t % block == 0:
            w_start = w
        x = k[:, t]  # [B, H, Dk]
        error = (w_start @ x[..., None])[..., 0] - v[:, t]
        g = error[..., None] * x[..., None, :]
        s = FACTOR * s + g
        a, lr = (gates[n][:, t][..., None, None] for n in ("decay", "lr"))
        w = a * w - lr * s
        outputs.append((w @ q[:, t][..., None])[..., 0])
    return torch.stack(outputs, dim=1), {"W": w, "S.W": s}


def test_the_compiler_proves_the_step_linear_and_records_it():
    rule = compiled(MATRIX)
    step = rule.plan.linear_step
    assert step is not None and step.shape == "general"
    assert step.decay == Coefficient(1.0, (("retention", "decay"),))
    assert step.from_state == Coefficient(1.0, (("optimizer", "lr"),))
    assert step.from_gradient.is_zero
    assert step.state_decay == Coefficient(0.9) and step.state_input.is_one
    assert rule.plan.chunk_form.form == "exact"
    assert rule.plan.chunk_form.start_path == "linear"
    assert compiled(DEEP).plan.chunk_form.form == "dual"


def test_its_declared_step_size_is_the_plans_step_size_gate():
    """What the code outside reads (a layer's start bound, the probes' normalization, fla's
    `beta` in miras.ops) comes from the plan's role, declared once in the class."""
    roles = {info.name: info.role for info in compiled(MATRIX).plan.gates}
    assert roles == {"decay": "decay", "lr": "step_size"}


@pytest.mark.parametrize("t_len,chunk_size", [(11, 4), (16, 16)])
def test_the_exact_form_equals_the_recurrence(t_len, chunk_size):
    rule = compiled(MATRIX)
    got = run(rule, t_len, chunk_size=chunk_size, mode="exact")
    want = run(rule, t_len, chunk_size=1, mode="auto", backend="recurrent")
    assert_runs_close(got, want, TOL)


@pytest.mark.parametrize("t_len,chunk_size", [(11, 4), (8, 1)])
def test_the_linear_chunk_start_path_equals_the_token_loop(t_len, chunk_size):
    rule = compiled(MATRIX)
    got = run(rule, t_len, chunk_size=chunk_size, mode="start")
    q, k, v, gates, init = inputs(rule, t_len)
    leaves = [q, k, v, *gates.values(), *init.values()]
    for x in leaves:
        x.requires_grad_(True)
    o, final = heavy_ball_loop(q, k, v, gates, init, chunk_size)
    names = ["q", "k", "v", *gates, *(f"state {n}" for n in init)]
    assert_runs_close(got, (o, final, projection_grads(o, final, leaves, names)), TOL)


def test_the_dual_form_of_a_deep_memory_equals_the_per_token_path():
    rule = compiled(DEEP)
    got = run(rule, 11, chunk_size=4, mode="auto")  # the dual form
    want = run(rule, 11, chunk_size=4, mode="start")  # per-token maps, `update` per token
    assert_runs_close(got, want, TOL)
    at_one = run(rule, 9, chunk_size=1, mode="auto")
    assert_runs_close(at_one, run(rule, 9, chunk_size=1, mode="auto", backend="recurrent"), TOL)


def test_the_exact_triton_scan_runs_its_prepared_step(monkeypatch):
    """The exact form's scan over chunks on the Triton kernels (kernels/templates/exact.py,
    under TRITON_INTERPRET=1 on a CPU) reads only the prepared, unrolled step: with it in
    place of the torch scan, the exact form still equals the recurrence."""
    pytest.importorskip("triton")
    from miras.runtime import exact_chunk, exact_triton

    calls = []

    def on_triton(*args):
        calls.append(1)
        return exact_triton.scan(*args, "ieee")

    monkeypatch.setattr(exact_chunk, "scan_chunks", on_triton)
    rule = compiled(MATRIX)
    got = run(rule, 11, chunk_size=4, mode="exact")
    assert calls
    want = run(rule, 11, chunk_size=1, mode="auto", backend="recurrent")
    assert_runs_close(got, want, TOL)


def test_the_emitted_triton_kernels_run_it():
    """backend="triton" (TRITON_INTERPRET=1 on a CPU): the general template's optimizer lines,
    printed from the record, equal the chunk-start form; its exact form (chunk mode "exact")
    runs the Triton scan and equals the recurrence."""
    pytest.importorskip("triton")
    from miras.compiler.pipeline import kernel_source

    rule = compiled(MATRIX)
    source = kernel_source(rule.ir)
    assert "upd = g_lr * s" in source and "s = 0.9 * s + upd" in source
    got = run(rule, 11, chunk_size=4, mode="start", backend="triton")
    assert_runs_close(got, run(rule, 11, chunk_size=4, mode="start"), TOL)
    exact = run(rule, 11, chunk_size=4, mode="exact", backend="triton")
    assert_runs_close(exact, run(rule, 11, chunk_size=1, mode="auto", backend="recurrent"), TOL)
