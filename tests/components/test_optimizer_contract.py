"""The optimizer contract at the level of a whole rule: every rung of the optimizer axis, run as
a spec, passes the same battery. (The hooks alone, `Optimizer.update` against each paper's
equation, are checked in test_component_contracts.py.)

    spec round trip        load -> to_yaml / normalized -> load gives an equal spec and digest
    validation errors      a fixed value outside a field's range, and an unknown field, are
                           refused at the field's path with the range
    the update equation    one recurrent token from a random state equals W_e minus the
                           component's own update of the autograd gradient (an implicit step:
                           W_e minus the numerical argmin of its objective; a preconditioned
                           one: at its step size times M(A_t)), state included
    derived vs autograd    `miras check`'s end-to-end stage passes on every backend it runs
    the forms it claims    an exact chunk form equals the recurrence at chunk size 4 (forward
                           and backward); a chunk-start form equals it at chunk size 1; a
                           Triton claim emits its kernels, a refusal names the reason

A new rung joins with one subclass of `OptimizerRungContract` naming its spec fields (the
list at the end of this file).
"""

from __future__ import annotations

import math

import pytest
import torch

import miras
from miras.checks.end_to_end import check_end_to_end, proximal_update
from miras.compiler.pipeline import kernel_source
from miras.compiler.triton_kernels import unsupported_reason
from miras.errors import SpecError
from miras.spec import load_spec

f64 = torch.float64

# The rung's spec fields over this base: a matrix memory, the l2 bias, l2 retention (a decay gate).
BASE = {"memory": "matrix", "bias": "l2", "retention": "l2", "window": 1}


def gates_for(rule, b, t, h, seed=0) -> dict[str, torch.Tensor]:
    """Every gate of `rule` inside its range, per head [B, T, H]."""
    gen = torch.Generator().manual_seed(seed)
    gates = {}
    for info in rule.plan.gates:
        lo, hi = info.allowed.lo, info.allowed.hi
        lo = lo if math.isfinite(lo) else -1.0  # a real-valued gate (a center): in (-1, 0)
        hi = hi if math.isfinite(hi) else lo + 1.0
        r = torch.rand(b, t, h, generator=gen, dtype=f64)
        gates[info.name] = lo + (hi - lo) * (0.1 + 0.8 * r)
    return gates


def qkv(b=2, t=11, h=2, dk=4, dv=3, seed=1):
    """q, k [B, T, H, Dk] (keys not normalized: ||k|| varies), v [B, T, H, Dv], float64."""
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(b, t, h, dk, generator=gen, dtype=f64) for _ in range(2))
    return q, k, torch.randn(b, t, h, dv, generator=gen, dtype=f64)


def outputs_and_grads(rule, q, k, v, gates, **options):
    leaves = [x.clone().requires_grad_() for x in (q, k, v, *gates.values())]
    q_, k_, v_, *gate_leaves = leaves
    named = dict(zip(gates, gate_leaves, strict=True))
    o, _ = rule(q_, k_, v_, named, **options)
    weight = torch.randn(o.shape, generator=torch.Generator().manual_seed(7), dtype=f64)
    return o.detach(), torch.autograd.grad((o * weight).sum(), leaves)


class OptimizerRungContract:
    """Every rung of the optimizer axis passes these. Subclass it with `fields`, the spec fields
    that pick the rung over BASE (the subclasses at the end of this file)."""

    fields: dict

    def spec(self) -> dict:
        name = type(self).__name__.removeprefix("Test").lower()
        return {"name": f"contract-{name}", **BASE, **self.fields}

    # --- the spec ---------------------------------------------------------------------------------

    def test_spec_round_trip(self):
        spec = load_spec(self.spec())
        for again in (load_spec(spec.to_yaml()), load_spec(spec.normalized())):
            assert again == spec and again.digest() == spec.digest()
        assert spec.normalized()["optimizer"]["kind"] == spec.optimizer.kind

    def test_out_of_range_values_and_unknown_fields_are_refused(self):
        optimizer = load_spec(self.spec()).optimizer
        long_form = {"kind": optimizer.kind, **optimizer.parameters()}
        for name, allowed in optimizer.gateable.items():
            outside = [x for x in (allowed.lo - 1, allowed.hi + 1) if math.isfinite(x)]
            for value in outside:
                with pytest.raises(SpecError) as info:
                    load_spec({**self.spec(), "optimizer": {**long_form, name: value}})
                paths = {p.path: p.message for p in info.value.problems}
                assert f"optimizer.{name}" in paths, paths
                assert str(allowed) in paths[f"optimizer.{name}"]
        with pytest.raises(SpecError) as info:
            load_spec({**self.spec(), "optimizer": {**long_form, "not_a_field": 1}})
        assert [p.path for p in info.value.problems] == ["optimizer.not_a_field"]

    # --- the step ---------------------------------------------------------------------------------

    def test_one_recurrent_token_is_the_components_update(self):
        """From a random W_{t-1} (and momentum state S_{t-1}): W_t = a_t W_{t-1} - u_t with
        u_t the optimizer's `update` of g_t = (W_{t-1} k - v) k^T, by autograd; an implicit
        step's u_t is W_{t-1} minus the numerical argmin of its objective."""
        rule = miras.compile(self.spec())
        opt = rule.spec.optimizer
        q, k, v = qkv(t=1)
        gates = gates_for(rule, 2, 1, 2)
        w = torch.randn(2, 2, 3, 4, generator=torch.Generator().manual_seed(5), dtype=f64)
        state = {"W": w}
        if opt.stateful:
            state["S.W"] = torch.randn(
                w.shape, generator=torch.Generator().manual_seed(6), dtype=f64
            )
        if opt.preconditioned:  # the curvature sum A_{t-1} per key channel, >= 0
            a = torch.rand(2, 2, 1, 4, generator=torch.Generator().manual_seed(8), dtype=f64)
            state["P.W"] = a
        _, final = rule(q, k, v, gates, backend="recurrent", initial_state=dict(state),
                        output_final_state=True)  # fmt: skip
        final = final if isinstance(final, dict) else {"W": final}

        def per_matrix(name):  # [B, 1, H] -> [B, H, 1, 1], or the fixed value
            value = getattr(opt, name) if name in opt.gateable else rule.spec.retention.decay
            return value if value != "gate" else gates[name][:, 0, :, None, None]

        x, target = k[:, 0], v[:, 0]  # [B, H, D]
        if opt.preconditioned:
            # A_t = a'_t A_{t-1} + b'_t phi(k_t)^2 (l2: s = 1), the step size lr_t M(A_t) per
            # column of W.
            a = opt.accumulate(state["P.W"], x.unsqueeze(-2) ** 2, per_matrix("precond_decay"),
                               per_matrix("precond_lr"))  # fmt: skip
            torch.testing.assert_close(final["P.W"], a, rtol=1e-12, atol=1e-12)
            lr = per_matrix("lr") * opt.factor(a, per_matrix("precond_center"))
        # `steps: n` takes the step n times on the token, the decay at the first only.
        current, s = w, state.get("S.W")
        for j in range(opt.steps_per_token()):
            if opt.implicit:
                u = proximal_update(rule, {"W": current}, x, target, [], per_matrix("lr"))["W"]
            else:
                point = current.clone().requires_grad_()
                y = (point @ x.unsqueeze(-1)).squeeze(-1)
                loss = rule.spec.bias.reference_loss(y, target).sum()
                (g,) = torch.autograd.grad(loss, point)
                values = {name: per_matrix(name) for name in opt.gateable}
                if opt.preconditioned:
                    values["lr"] = lr
                u, s = opt.update(g, s, **values)
            current = (per_matrix("decay") if j == 0 else 1.0) * current - u
        if opt.stateful:
            torch.testing.assert_close(final["S.W"], s, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(final["W"], current, rtol=1e-10, atol=1e-10)

    def test_the_derived_step_agrees_with_autograd(self):
        results = check_end_to_end(miras.compile(self.spec()), triton=False)
        failed = [r.piece for r in results if not r.passed]
        assert results and not failed, failed

    # --- the forms --------------------------------------------------------------------------------

    def test_the_chunk_form_it_claims_equals_the_recurrence(self):
        rule = miras.compile(self.spec())
        q, k, v = qkv()  # T = 11: chunks of 4 leave 3
        gates = gates_for(rule, 2, 11, 2)
        exact = rule.plan.chunk_form.form == "exact"
        chunk_size = 4 if exact else 1  # a chunk-start form is exact only at chunk size 1
        o_ref, g_ref = outputs_and_grads(rule, q, k, v, gates, backend="recurrent")
        o, g = outputs_and_grads(rule, q, k, v, gates, backend="chunk", chunk_size=chunk_size)
        torch.testing.assert_close(o, o_ref, rtol=1e-10, atol=1e-10)
        for a, b in zip(g, g_ref, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)

    def test_the_triton_claim_emits_kernels_or_names_the_reason(self):
        spec = load_spec(self.spec())
        reason = unsupported_reason(spec)
        if reason is None:
            assert "@triton.jit" in kernel_source(spec)
        else:
            assert spec.optimizer.kind in reason
            with pytest.raises(ValueError, match="do not cover"):
                kernel_source(spec)


# The rungs under contract: one subclass each, naming the spec fields that pick the rung.


class TestGD(OptimizerRungContract):
    fields = {"optimizer": "gd"}


class TestMomentum(OptimizerRungContract):
    fields = {"optimizer": "momentum"}


class TestNesterov(OptimizerRungContract):
    fields = {"optimizer": "nesterov"}


class TestMuon(OptimizerRungContract):
    fields = {"optimizer": {"kind": "muon", "ns_steps": 3}}


class TestGDSteps(OptimizerRungContract):
    fields = {"optimizer": {"kind": "gd", "steps": 3}}


class TestMomentumSteps(OptimizerRungContract):
    fields = {"optimizer": {"kind": "momentum", "steps": 2}}


class TestProximal(OptimizerRungContract):
    fields = {"optimizer": "proximal"}


class TestProximalFixedDot(OptimizerRungContract):
    fields = {"optimizer": {"kind": "proximal", "lr": 0.7}, "bias": "dot"}


class TestPreconditioned(OptimizerRungContract):
    fields = {"optimizer": "preconditioned"}


class TestPreconditionedCenterGate(OptimizerRungContract):
    fields = {"optimizer": {"kind": "preconditioned", "precond_center": "gate", "precond_range": 3}}
