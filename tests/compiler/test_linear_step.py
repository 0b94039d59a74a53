"""The compiler's linear-step record (miras/derive/linear_step.py, `LinearStep` in the IR)
and its one unrolling for the torch fast forms (miras/runtime/unroll.py).

- The record exists exactly where the composed step is linear: retention none or l2 (the
  derived step a_t w0 - u, the state read as it is) with gd, proximal, preconditioned (gd's
  step at the step size the runtime makes first, as proximal's), momentum or Nesterov;
  its coefficients are the gates the components name, or the fixed values.
- Nesterov, linear but of neither hand-tagged shape, gets the exact form, equal to the
  recurrence, and the linear chunk-start path.
- The decay matrix is the product of the factors each entry spans, with exact zeros and
  finite gradients at a zero factor; the unrolled M, C, N equal the recurrences stepped out.
"""

from __future__ import annotations

import pytest
import torch

import miras
from miras.components import CATALOGUE
from miras.derive.affine import linear_record
from miras.errors import SpecError
from miras.ir import Coefficient, LinearStep
from miras.runtime.unroll import decay_matrix, unroll
from miras.spec import load_spec
from tests.helpers import chunk_grads, random_inputs

f64 = torch.float64
LINEAR = {"none", "l2"}
SHAPES = {
    "gd": "step",
    "proximal": "step",
    "preconditioned": "step",
    "momentum": "momentum",
    "nesterov": "general",
}

pytestmark = pytest.mark.usefixtures("one_thread")


def _specs():
    for retention in CATALOGUE["retention"]:
        for optimizer in CATALOGUE["optimizer"]:
            try:
                spec = load_spec({"name": "p", "retention": retention, "optimizer": optimizer})
            except (SpecError, ValueError):
                continue  # a combination the spec refuses
            yield retention, optimizer, spec


def test_the_record_exists_exactly_where_the_step_is_linear():
    seen = 0
    for retention, optimizer, spec in _specs():
        step, why = linear_record(spec)
        if retention in LINEAR and optimizer in SHAPES:
            assert step is not None, (retention, optimizer, why)
            assert step.shape == SHAPES[optimizer], (retention, optimizer)
            seen += 1
        else:
            assert step is None and why, (retention, optimizer)
    assert seen == 2 * len(SHAPES)


def test_the_coefficients_are_the_components_gates_or_their_fixed_values():
    lr, theta = ("optimizer", "lr"), ("optimizer", "momentum")
    step, _ = linear_record(load_spec({"name": "p", "retention": "l2", "optimizer": "nesterov"}))
    assert step == LinearStep(
        decay=Coefficient(1.0, (("retention", "decay"),)),
        from_gradient=Coefficient(1.0, (lr,)),
        from_state=Coefficient(1.0, (theta,)),
        state_decay=Coefficient(1.0, (theta,)),
        state_input=Coefficient(1.0, (lr,)),
    )
    assert step.gate_names("optimizer") == ("lr", "momentum")
    fixed = load_spec({"name": "p", "retention": {"kind": "l2", "decay": 0.5}, "optimizer": "gd"})
    step, _ = linear_record(fixed)
    assert step.decay == Coefficient(0.5) and step.from_gradient == Coefficient(1.0, (lr,))
    none, _ = linear_record(load_spec({"name": "p", "retention": "none"}))
    assert none.decay.is_one and not none.stateful


def test_a_step_that_is_not_linear_says_why():
    step, why = linear_record(load_spec({"name": "p", "retention": "elastic_net"}))
    assert step is None and "is not linear in w0" in why
    step, why = linear_record(load_spec({"name": "p", "optimizer": "muon"}))
    assert step is None and "not one elementwise expression" in why


NESTEROV = {"name": "nesterov_l2", "bias": "l2", "retention": "l2", "optimizer": "nesterov"}


def _run(rule, backend, chunk_size, mode):
    q, k, v, gates = random_inputs(rule, b=2, t=11, h=2, dk=4, dv=4, seed=5)
    gen = torch.Generator().manual_seed(6)
    init = {
        n: 0.3 * torch.randn(s.shape, generator=gen, dtype=f64)
        for n, s in rule.initial_state(2, 2, 4, 4, f64).items()
    }
    return chunk_grads(
        rule, q, k, v, gates, init, {}, chunk_size=chunk_size, chunk_mode=mode, backend=backend
    )


def test_nesterov_gets_the_exact_form_equal_to_the_recurrence():
    rule = miras.compile(NESTEROV)
    assert rule.plan.chunk_form.form == "exact"
    assert rule.plan.chunk_form.start_path == "linear"
    o, final, grads = _run(rule, "chunk", 4, "exact")
    o_ref, final_ref, grads_ref = _run(rule, "recurrent", 1, "auto")
    torch.testing.assert_close(o, o_ref, rtol=1e-10, atol=1e-10)
    for key in final_ref:
        torch.testing.assert_close(final[key], final_ref[key], rtol=1e-10, atol=1e-10)
    for key, g in grads_ref.items():
        torch.testing.assert_close(grads[key], g, rtol=1e-10, atol=1e-10, msg=key)
    # The linear chunk-start path at chunk size 1 is the recurrence too.
    o1, final1, grads1 = _run(rule, "chunk", 1, "start")
    torch.testing.assert_close(o1, o_ref, rtol=1e-10, atol=1e-10)
    for key in final_ref:
        torch.testing.assert_close(final1[key], final_ref[key], rtol=1e-10, atol=1e-10)
    for key, g in grads_ref.items():
        torch.testing.assert_close(grads1[key], g, rtol=1e-10, atol=1e-10, msg=key)


def test_the_decay_matrix_is_the_product_of_the_factors_it_spans():
    gen = torch.Generator().manual_seed(0)
    a = (0.5 + 0.5 * torch.rand(2, 6, 3, generator=gen, dtype=f64)).requires_grad_(True)
    got = decay_matrix(a)  # [2, 3, 6, 6]
    for t in range(6):
        for s in range(6):
            want = (
                torch.prod(a[:, s + 1 : t + 1], dim=1) if s <= t else torch.zeros(2, 3, dtype=f64)
            )
            torch.testing.assert_close(got[:, :, t, s], want, rtol=1e-14, atol=0)
    # A zero factor: exact zeros below it, and the gradient of every factor finite.
    z = torch.tensor([[0.9], [0.0], [0.8], [0.7]], dtype=f64, requires_grad=True)
    matrix = decay_matrix(z)[0]
    assert matrix[2, 0] == 0 and matrix[3, 0] == 0 and matrix[2, 1] == 0.8
    (grad,) = torch.autograd.grad(matrix.sum(), z)
    assert torch.isfinite(grad).all()
    assert grad[1, 0] == pytest.approx(1.0 + 0.8 + 0.8 * 0.7)  # d(L[2,0] + L[3,0] + L[3, 0..])


def test_unrolled_weights_equal_the_recurrences_stepped_out():
    """W_t = D_t W_0 - C_t S_0 - sum_s M[t, s] g_s and S_t = Theta_t S_0 + sum_s N[t, s] g_s,
    against the recurrences run on scalars (one entry, per head)."""
    step, _ = linear_record(load_spec(NESTEROV))
    gen = torch.Generator().manual_seed(1)
    n = 5
    gates = {
        "decay": 0.8 + 0.2 * torch.rand(n, 1, generator=gen, dtype=f64),
        "lr": 0.1 + 0.4 * torch.rand(n, 1, generator=gen, dtype=f64),
        "momentum": 0.9 * torch.rand(n, 1, generator=gen, dtype=f64),
    }
    unrolled = unroll(step, lambda field, name: gates[name], gates["lr"])
    g = torch.randn(n, generator=gen, dtype=f64)
    w0, s0 = torch.tensor(0.7, dtype=f64), torch.tensor(-0.4, dtype=f64)
    w, s = w0, s0
    for t in range(n):
        a, lr, theta = (gates[k][t, 0] for k in ("decay", "lr", "momentum"))
        s = theta * s + lr * g[t]
        w = a * w - (theta * s + lr * g[t])
        mix = unrolled.mix[0, t, : t + 1] @ g[: t + 1]
        want_w = unrolled.d[t, 0] * w0 - unrolled.carry[t, 0] * s0 - mix
        want_s = unrolled.state_carry[t, 0] * s0 + unrolled.state_mix[0, t, : t + 1] @ g[: t + 1]
        torch.testing.assert_close(w, want_w, rtol=1e-13, atol=1e-13)
        torch.testing.assert_close(s, want_s, rtol=1e-13, atol=1e-13)


def test_the_triton_templates_take_the_optimizers_lines_from_the_record():
    """The templates' block phase multiplies every gradient by the one gate the gradient terms
    share (`scale`); the token phase runs the rest of the record's coefficients."""
    from miras.compiler.triton import optimizer_step
    from miras.derive.printer import UnsupportedExpression

    lr, theta = (
        Coefficient(1.0, (("optimizer", "lr"),)),
        Coefficient(1.0, (("optimizer", "momentum"),)),
    )
    momentum = optimizer_step(load_spec({"name": "p", "retention": "l2", "optimizer": "momentum"}))
    assert momentum.scale == "lr" and momentum.stateful
    assert momentum.step.state_decay == theta and momentum.step.state_input.is_one
    assert momentum.step.from_state.is_one and momentum.step.from_gradient.is_zero
    gd = optimizer_step(load_spec({"name": "p", "retention": "none"}))
    assert gd.scale == "lr" and not gd.stateful and gd.step.from_gradient.is_one
    nesterov = optimizer_step(load_spec({"name": "p", "optimizer": "nesterov"}))
    assert nesterov.scale == "lr" and nesterov.step.from_state == theta
    assert nesterov.step.from_gradient.is_one and nesterov.step.state_input.is_one
    assert lr not in (nesterov.step.from_state, nesterov.step.state_decay)
    with pytest.raises(UnsupportedExpression, match="linear"):
        optimizer_step(load_spec({"name": "p", "optimizer": "muon"}))


def test_the_retentions_declared_linear_step_is_what_the_compiler_proves():
    """Spec validation reads `Retention.linear_step` (n steps per token, the exact optimizer)
    without deriving anything; it must agree with the proof every fast form reads."""
    from miras.derive.linear_step import retention_decay
    from miras.derive.retention_derive import derive_retention

    for kind, cls in CATALOGUE["retention"].items():
        spec = load_spec({"name": "p", "retention": kind})
        decay, why = retention_decay(spec, derive_retention(spec.retention))
        assert cls.linear_step == (decay is not None), (kind, why)
