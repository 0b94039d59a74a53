"""Shared contract suites for memories, optimizers and feature maps (as `RetentionContract` in
test_retention.py and the bias suite in test_bias.py): every member of the catalogue is a
subclass that names the component and, where the contract needs one, writes its published
rule by hand in torch. A new component gets the whole battery by subclassing one class.

What each contract checks is what the runtime relies on: the hooks the backends call
(`Optimizer.update`, `Memory.forward/backward/initial_weights`, `FeatureMap.features`) and the
display lines `miras derive` prints from them.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from pydantic import ValidationError
from torch.func import grad

import miras
from miras.checks.end_to_end import check_end_to_end
from miras.compiler.triton_kernels import unsupported_reason
from miras.components import FEATURE_MAPS, MEMORIES, OPTIMIZERS
from miras.components.base import FeatureMap, Memory, Optimizer
from miras.components.feature_map.custom import CustomMap
from miras.components.feature_map.exp_kernel import ExpKernelMap
from miras.components.feature_map.identity import IdentityMap
from miras.components.feature_map.polynomial import PolynomialMap
from miras.components.feature_map.taylor import TaylorMap
from miras.components.memory.gated_mlp import GatedMLPMemory
from miras.components.memory.matrix import MatrixMemory
from miras.components.memory.mlp import MLPMemory
from miras.components.memory.nonparametric import NonparametricMemory
from miras.components.optimizer.exact import Exact
from miras.components.optimizer.gd import GD
from miras.components.optimizer.momentum import Momentum
from miras.components.optimizer.muon import Muon, newton_schulz
from miras.components.optimizer.nesterov import Nesterov
from miras.components.optimizer.preconditioned import Preconditioned
from miras.components.optimizer.proximal import Proximal
from miras.components.retention.f_divergence import FDivergenceRetention
from miras.derive.describe import plain_lines
from miras.derive.retention_derive import derive_retention
from miras.errors import DerivationError
from tests.compiler.test_retention import RetentionContract

f64 = torch.float64
B, H, N = 2, 3, 5
RTOL = 1e-10


def _randn(*shape, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=f64)


def _gates(component, shape, seed: int) -> dict[str, torch.Tensor]:
    """Every gateable field inside its range, one value per row: [..., rows, 1]."""
    gen = torch.Generator().manual_seed(seed)
    values = {}
    for name, allowed in component.gateable.items():
        lo = allowed.lo if math.isfinite(allowed.lo) else -1.0
        hi = allowed.hi if math.isfinite(allowed.hi) else lo + 2.0
        r = torch.rand(*shape[:-1], 1, generator=gen, dtype=f64)
        values[name] = lo + (hi - lo) * (0.1 + 0.8 * r)
    return values


def _run(spec: dict, backend: str, chunk_size: int = 1, length: int = 7, chunk_mode="auto"):
    """A compiled spec on random inputs with every gate inside its range: o [B, T, H, Dv]."""
    rule = miras.compile(spec, checked=False)
    gen = torch.Generator().manual_seed(1)
    q, k = (
        torch.nn.functional.normalize(
            torch.randn(1, length, 2, 4, generator=gen, dtype=f64), dim=-1
        )
        for _ in range(2)
    )
    v = torch.randn(1, length, 2, 4, generator=gen, dtype=f64)
    gates = {}
    for info in rule.plan.gates:
        lo, hi = info.allowed.lo, info.allowed.hi
        hi = hi if math.isfinite(hi) else lo + 1.0
        gates[info.name] = lo + (hi - lo) * (
            0.1 + 0.8 * torch.rand(1, length, 2, generator=gen, dtype=f64)
        )
    o, _ = rule(q, k, v, gates, backend=backend, chunk_size=chunk_size, chunk_mode=chunk_mode)
    return o


# Optimizers ------------------------------------------------------------------------------------


class OptimizerContract:
    """Every optimizer passes these. Subclass: set `optimizer`, write `expected`."""

    optimizer: Optimizer
    # The spec fields `test_backends_run_the_update` runs on: a memory whose chunk-start form
    # calls `update` per token (the general path).
    backend_fields: dict = {"memory": "mlp"}

    def expected(self, g, s, gates) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The published (u_t, s_t) from g_t and s_{t-1}, written by hand in torch."""
        raise NotImplementedError

    def _step(self, seed: int, shape=(B, H, 4, 6)):
        g, s = _randn(*shape, seed=seed), _randn(*shape, seed=seed + 1)
        gates = _gates(self.optimizer, shape, seed + 2)
        state = s if self.optimizer.stateful else None
        return g, state, gates

    def test_registered_under_its_kind(self):
        assert OPTIMIZERS[self.optimizer.kind] is type(self.optimizer)

    def test_update_is_the_published_rule(self):
        g, s, gates = self._step(0)
        u, s_new = self.optimizer.update(g, s, **gates)
        u_ref, s_ref = self.expected(g, s, gates)
        torch.testing.assert_close(u, u_ref, rtol=RTOL, atol=0)
        if self.optimizer.stateful:
            torch.testing.assert_close(s_new, s_ref, rtol=RTOL, atol=0)
        else:
            assert s_new is None

    def test_first_step_from_zero_state(self):
        """The runtime starts the state at zeros: the same step as no state at all."""
        if not self.optimizer.stateful:
            pytest.skip("a stateless optimizer takes no state")
        g, _, gates = self._step(3)
        from_zero = self.optimizer.update(g, torch.zeros_like(g), **gates)
        from_none = self.optimizer.update(g, None, **gates)
        for a, b in zip(from_zero, from_none, strict=True):
            torch.testing.assert_close(a, b, rtol=RTOL, atol=0)

    def test_linear_form_is_what_update_computes(self):
        """The compiled linear update licenses every fast form (torch and Triton) to unroll the
        update as decay matrices, and `linear_form` names its shape: its coefficients, at the
        gates, must give what `update` computes."""
        from miras.derive.linear_step import optimizer_update

        step, _ = optimizer_update(self.optimizer)
        form = self.optimizer.linear_form
        if step is None:
            assert form is None
            pytest.skip("the fast chunk forms do not apply")
        assert form == step.shape
        g, s, gates = self._step(5)
        u, s_new = self.optimizer.update(g, s, **gates)

        def value(c):
            out = torch.full_like(g, c.constant)
            for _, name in c.gates:
                out = out * gates[name]
            return out

        if not step.stateful:
            torch.testing.assert_close(u, value(step.from_gradient) * g, rtol=RTOL, atol=0)
            return
        state = value(step.state_decay) * s + value(step.state_input) * g
        torch.testing.assert_close(s_new, state, rtol=RTOL, atol=0)
        want = value(step.from_state) * state + value(step.from_gradient) * g
        torch.testing.assert_close(u, want, rtol=RTOL, atol=0)

    def test_update_expressions_are_what_update_computes(self):
        """The compiler proves the fast forms from `update_expressions` (the compiled
        LinearStep); the recurrence runs `update`: the two must be the same step."""
        expressions = self.optimizer.update_expressions()
        if expressions is None:
            pytest.skip("no elementwise update: the fast linear forms do not apply")
        import sympy as sp

        from miras.derive.symbols import g as grad
        from miras.derive.symbols import gate_symbol, s_new, s_prev

        g, s, gates = self._step(11)
        u, s_next = self.optimizer.update(g, s, **gates)
        symbols = [grad, s_prev, s_new, *(gate_symbol(n) for n in gates)]
        update, state = expressions
        zeros = torch.zeros_like(g)
        at = (g, zeros if s is None else s, zeros if s_next is None else s_next, *gates.values())
        torch.testing.assert_close(sp.lambdify(symbols, update, "math")(*at), u, rtol=RTOL, atol=0)
        assert (state is None) == (s_next is None)
        if state is not None:
            got = sp.lambdify(symbols, state, "math")(*at)
            torch.testing.assert_close(got, s_next, rtol=RTOL, atol=0)

    def test_fixed_gates_are_accepted(self):
        g, s, _ = self._step(7)
        fixed = {name: 0.5 for name in self.optimizer.gateable}
        u, _ = self.optimizer.update(g, s, **fixed)
        assert u.shape == g.shape and bool(torch.isfinite(u).all())

    def test_triton_runs_only_the_linear_forms(self):
        """The kernels run an update the compiler proved linear (`linear_form` not None): any
        other update is refused, never run as one of those."""
        spec = miras.load_spec({"name": "contract", "optimizer": self.optimizer.model_dump()})
        refused = unsupported_reason(spec)
        assert (refused is None) == (self.optimizer.linear_form is not None), refused

    def test_update_lines_name_u_t(self):
        text = "\n".join(plain_lines(self.optimizer.update_lines()))
        assert "u_t =" in text

    def test_backends_run_the_update(self, monkeypatch):
        """The recurrence and the chunk-start form call `update`, and agree at chunk size 1.
        (For gd and momentum an MLP memory's "auto" form is the dual form, which takes the
        optimizer's linear form instead: tests/runtime/test_dual_form.py.)"""
        calls = []
        original = type(self.optimizer).update

        def spy(self_, *args, **kwargs):
            calls.append(1)
            return original(self_, *args, **kwargs)

        spec = {"name": f"contract_{self.optimizer.kind}", **self.backend_fields}
        spec["optimizer"] = {"kind": self.optimizer.kind, **self.optimizer.parameters()}
        monkeypatch.setattr(type(self.optimizer), "update", spy)
        recurrent = _run(spec, "recurrent")
        assert calls, "the recurrent backend did not call the optimizer's update"
        calls.clear()
        chunk = _run(spec, "chunk", chunk_size=1, chunk_mode="start")
        assert calls, "the chunk-start form did not call the optimizer's update"
        torch.testing.assert_close(chunk, recurrent, rtol=1e-12, atol=1e-12)


class TestGD(OptimizerContract):
    optimizer = GD()

    def expected(self, g, s, gates):
        return gates["lr"] * g, None


class TestMomentum(OptimizerContract):
    optimizer = Momentum()

    def expected(self, g, s, gates):
        s_new = gates["momentum"] * s + gates["lr"] * g
        return s_new, s_new


class TestMuon(OptimizerContract):
    optimizer = Muon(ns_steps=3)

    def expected(self, g, s, gates):
        s_new = gates["momentum"] * s + g
        return gates["lr"] * newton_schulz(s_new, 3), s_new


class TestNesterov(OptimizerContract):
    optimizer = Nesterov()

    def expected(self, g, s, gates):
        # PyTorch's SGD(nesterov=True) with dampening 0, the gradient scaled by lr first.
        buf = gates["momentum"] * s + gates["lr"] * g
        return gates["lr"] * g + gates["momentum"] * buf, buf

    def test_its_linear_form_is_neither_gd_nor_momentum(self):
        assert self.optimizer.linear_form == "general"  # u_t = theta_t S_t + lr_t g_t


class TestExact(OptimizerContract):
    """The exact minimizer takes no step: `update` is never called, and the contract's
    per-token checks become what it does instead (tests/runtime/test_exact_minimizer.py has the rest)."""

    optimizer = Exact()
    fields = {"retention": {"kind": "l2", "decay": "gate"}, "window": "global"}

    def test_update_is_the_published_rule(self):
        g, s, gates = self._step(0)
        with pytest.raises(ValueError, match="no per-token update"):
            self.optimizer.update(g, s, **gates)

    def test_linear_form_is_what_update_computes(self):
        assert self.optimizer.linear_form is None  # no update for the fast forms to unroll

    def test_fixed_gates_are_accepted(self):
        spec = {
            "name": "contract_exact",
            **self.fields,
            "optimizer": {"kind": "exact", "ridge": 0.5},
        }
        o = _run(spec, "chunk", chunk_size=4)
        assert bool(torch.isfinite(o).all())

    def test_triton_runs_only_the_linear_forms(self):
        spec = miras.load_spec({"name": "contract", **self.fields, "optimizer": {"kind": "exact"}})
        assert "exact optimizer" in unsupported_reason(spec)

    def test_update_lines_name_u_t(self):
        """No u_t: the step is the statistics, then W_t, the minimizer."""
        assert "no update" in "\n".join(plain_lines(self.optimizer.update_lines()))
        spec = miras.load_spec({"name": "contract", **self.fields, "optimizer": {"kind": "exact"}})
        text = "\n".join(plain_lines(self.optimizer.whole_step_lines(spec)))
        assert "H_kk,t =" in text and "W_t =" in text

    def test_backends_run_the_update(self):
        """Both backends run the statistics, and agree at chunk sizes 1 and 4."""
        spec = {"name": "contract_exact", **self.fields, "optimizer": {"kind": "exact"}}
        recurrent = _run(spec, "recurrent")
        for size in (1, 4):
            chunk = _run(spec, "chunk", chunk_size=size)
            torch.testing.assert_close(chunk, recurrent, rtol=1e-12, atol=1e-12)


class TestProximal(OptimizerContract):
    optimizer = Proximal()
    # A matrix memory (the closed form needs one) with KL retention: the general chunk-start
    # path, which calls `update` per token.
    backend_fields = {"memory": "matrix", "retention": "kl"}

    def expected(self, g, s, gates):
        # `update` takes the step size eta_t that `step_size` made of lr_t (the runtime applies
        # it first), so u_t = eta_t g_t.
        return gates["lr"] * g, None

    def test_step_size_is_the_proximal_one(self):
        """eta = lr / (1 + lr c): below lr and below 1 / c, so a write never overshoots."""
        lr = torch.tensor([0.0, 0.1, 1.0, 10.0, 1e6], dtype=f64)
        for curvature in (0.0, 0.5, 1e4):
            eta = self.optimizer.step_size(lr, torch.tensor(curvature, dtype=f64))
            torch.testing.assert_close(eta, lr / (1 + lr * curvature), rtol=RTOL, atol=0)
            assert bool((eta <= lr).all()) and bool((eta * curvature < 1).all())


class TestPreconditioned(OptimizerContract):
    optimizer = Preconditioned()
    # A matrix memory (the preconditioner scales its columns) with KL retention: the general
    # chunk-start path, which calls `update` per token.
    backend_fields = {"memory": "matrix", "retention": "kl"}

    def expected(self, g, s, gates):
        # `update` takes the step size lr_t M_t that the runtime made of lr_t (one per key
        # channel: miras.runtime.precondition), so u_t = (lr_t M_t) g_t.
        return gates["lr"] * g, None

    def test_triton_runs_only_the_linear_forms(self):
        """Its update is linear (gd's, at lr_t M_t), but the step size per key channel scales
        W's columns, where the kernels scale rows: refused, naming the optimizer."""
        assert self.optimizer.linear_form == "step"
        spec = miras.load_spec({"name": "contract", "optimizer": "preconditioned"})
        assert "preconditioned optimizer" in unsupported_reason(spec)

    def test_factor_is_fla_squash(self):
        """M = x^(-r / (1 + |r|)), r = log(A + eps) - c (fla's precond_gated_delta_rule), inside
        (1/x, x), 1 where log(A + eps) = c, and decreasing in A."""
        opt = Preconditioned(precond_range=2.0, precond_eps=1e-3)
        a = torch.tensor([0.0, 1e-6, 0.1, 1.0, 10.0, 1e6], dtype=f64)
        center = torch.tensor(0.3, dtype=f64)
        r = torch.log(a + 1e-3) - center
        want = torch.exp(-math.log(2.0) * r / (1 + r.abs()))
        m = opt.factor(a, center)
        torch.testing.assert_close(m, want, rtol=RTOL, atol=0)
        assert bool(((m > 0.5) & (m < 2.0)).all()) and bool((m.diff() < 0).all())
        at_center = opt.factor(torch.tensor(math.exp(0.3) - 1e-3, dtype=f64), center)
        torch.testing.assert_close(at_center, torch.tensor(1.0, dtype=f64), rtol=RTOL, atol=0)

    def test_accumulate_is_the_decayed_sum(self):
        a, c = _randn(B, H, 1, 6, seed=1).abs(), _randn(B, H, 1, 6, seed=2).abs()
        decay = torch.full((B, H, 1, 1), 0.7, dtype=f64)
        rate = torch.full((B, H, 1, 1), 0.3, dtype=f64)
        got = self.optimizer.accumulate(a, c, decay, rate)
        torch.testing.assert_close(got, 0.7 * a + 0.3 * c, rtol=RTOL, atol=0)


# Memories --------------------------------------------------------------------------------------

ACTIVATIONS = {"gelu": torch.nn.functional.gelu, "silu": torch.nn.functional.silu}


class MemoryContract:
    """Every parametric memory passes these. Subclass: set `memory`, write `reference` (M_W(x)
    for one vector, in torch, independent of the component)."""

    memory: Memory
    d_in, d_out = 6, 6

    def reference(self, weights: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    @pytest.fixture(scope="class")
    @classmethod
    def model(cls):
        """The run-time form: the component with the compiled activation and derivative."""
        spec = {"name": f"contract_{cls.memory.kind}", "memory": cls.memory.model_dump()}
        return miras.compile(spec, checked=False).runtime.memory

    def _weights(self, *batch, seed=0):
        shapes = self.memory.parameter_shapes(self.d_in, self.d_out)
        return {n: _randn(*batch, *s, seed=seed + i) / 2 for i, (n, s) in enumerate(shapes.items())}

    def test_registered_under_its_kind(self):
        assert MEMORIES[self.memory.kind] is type(self.memory)

    def test_shapes_read_d_in_and_give_d_out(self):
        shapes = self.memory.parameter_shapes(self.d_in, self.d_out).values()
        assert all(len(s) == 2 for s in shapes)
        assert any(s[1] == self.d_in for s in shapes) and any(s[0] == self.d_out for s in shapes)

    def test_forward_is_the_published_map(self, model):
        weights, x = self._weights(), _randn(self.d_in, seed=9)
        torch.testing.assert_close(
            model.forward(weights, x), self.reference(weights, x), rtol=RTOL, atol=1e-12
        )

    def test_backward_is_autograd_of_forward(self, model):
        """dL/dW from `backward`, for a loss with dL/dy = grad_y, equals torch.func's."""
        weights, x, grad_y = self._weights(), _randn(self.d_in, seed=9), _randn(self.d_out, seed=10)
        got = model.backward(weights, x, grad_y)
        want = grad(lambda w: (self.reference(w, x) * grad_y).sum())(weights)
        for name in weights:
            torch.testing.assert_close(got[name], want[name], rtol=RTOL, atol=1e-12)

    def test_one_weight_reads_a_run_of_tokens(self, model):
        """[B, H, 1, out, in] weights against [B, H, N, in] tokens: per-token gradients, each
        the one of its own token."""
        weights = self._weights(B, H, 1)
        x, grad_y = _randn(B, H, N, self.d_in, seed=4), _randn(B, H, N, self.d_out, seed=5)
        batched = model.backward(weights, x, grad_y)
        for t in (0, N - 1):
            single = model.backward(
                {n: w[:, :, 0] for n, w in weights.items()}, x[:, :, t], grad_y[:, :, t]
            )
            for name in weights:
                torch.testing.assert_close(
                    batched[name][:, :, t], single[name], rtol=RTOL, atol=1e-12
                )

    @pytest.mark.parametrize("domain", ["real", "positive", "unit_interval"])
    def test_initial_weights_lie_in_the_domain(self, domain):
        gen = torch.Generator().manual_seed(0)
        w = self.memory.initial_weights((B, H, 4, 6), domain, 2.0, gen).to(f64)
        assert w.shape == (B, H, 4, 6) and bool(torch.isfinite(w).all())
        if domain == "unit_interval":
            assert bool(((w > 0) & (w < 1)).all())
        if domain == "positive":
            assert bool((w > 0).all())
            torch.testing.assert_close(w.sum(-1), torch.full((B, H, 4), 2.0, dtype=f64))

    def test_update_lines_give_g_t(self):
        window = miras.spec.Spec.model_validate({"name": "w"}).window
        assert "g_t =" in "\n".join(plain_lines(self.memory.update_lines(window)))


class TestMatrixMemory(MemoryContract):
    memory = MatrixMemory()
    d_out = 4

    def reference(self, weights, x):
        return weights["W"] @ x

    def test_zero_initial_state_on_the_reals(self):
        gen = torch.Generator().manual_seed(0)
        assert not self.memory.initial_weights((1, 1, 2, 3), "real", 1.0, gen).any()


class TestMLPMemory(MemoryContract):
    memory = MLPMemory(depth=3, expansion=1.5, activation="silu")
    d_out = 4

    def reference(self, weights, x):
        h = x
        for i in (3, 2, 1):
            h = weights[f"W{i}"] @ h
            h = torch.nn.functional.silu(h) if i > 1 else h
        return h


class TestResidualMLPMemory(MemoryContract):
    memory = MLPMemory(depth=2, activation="gelu", residual_norm=True)

    def reference(self, weights, x):
        h = weights["W1"] @ torch.nn.functional.gelu(weights["W2"] @ x)
        return x + torch.nn.functional.layer_norm(h, h.shape, eps=1e-5)


class TestGatedMLPMemory(MemoryContract):
    memory = GatedMLPMemory(expansion=2.0)
    d_out = 3

    def reference(self, weights, x):
        act = torch.nn.functional.silu
        return weights["W1"] @ (act(weights["W2"] @ x) * (weights["W3"] @ x))


def test_nonparametric_memory_is_a_closed_form():
    memory = NonparametricMemory(window=4)
    assert MEMORIES["nonparametric"] is NonparametricMemory and not memory.parametric
    with pytest.raises(ValueError, match="no parametric forward"):
        memory.forward({}, _randn(3))
    window = miras.spec.Spec.model_validate({"name": "w"}).window
    assert "softmax_i" in "\n".join(plain_lines(memory.update_lines(window)))


# Feature maps ----------------------------------------------------------------------------------


class FeatureMapContract:
    """Every feature map passes these. Subclass: set `feature_map`, write `expected`."""

    feature_map: FeatureMap
    d = 4

    def expected(self, x: torch.Tensor) -> torch.Tensor:
        """phi(x) for x [..., D], written by hand in torch."""
        raise NotImplementedError

    @pytest.fixture(scope="class")
    @classmethod
    def rule(cls):
        spec = {
            "name": f"contract_{cls.feature_map.kind}",
            "feature_map": cls.feature_map.model_dump(),
        }
        return miras.compile(spec, checked=False)

    def _features(self, rule, x):
        params = {n: p.to(f64) for n, p in self.feature_map.initial_params().items()}
        return self.feature_map.features(x, params, rule.functions)

    def test_registered_under_its_kind(self):
        assert FEATURE_MAPS[self.feature_map.kind] is type(self.feature_map)

    def test_features_are_the_published_map(self, rule):
        x = _randn(B, H, N, self.d)
        torch.testing.assert_close(self._features(rule, x), self.expected(x), rtol=RTOL, atol=1e-12)

    def test_width_is_output_dim(self, rule):
        x = _randn(B, H, N, self.d)
        assert self._features(rule, x).shape == (B, H, N, self.feature_map.output_dim(self.d))

    def test_each_token_maps_alone(self, rule):
        """phi acts on one key at a time: a batch equals its tokens mapped one by one."""
        x = _randn(B, H, N, self.d, seed=3)
        batched = self._features(rule, x)
        for t in range(N):
            torch.testing.assert_close(
                batched[:, :, t], self._features(rule, x[:, :, t]), rtol=RTOL, atol=0
            )

    def test_differentiable_and_finite_at_zero(self, rule):
        """Padding feeds zero keys; training differentiates phi."""
        x = torch.zeros(2, self.d, dtype=f64, requires_grad=True)
        phi = self._features(rule, x)
        (g,) = torch.autograd.grad(phi.sum(), x)
        assert bool(torch.isfinite(phi).all()) and bool(torch.isfinite(g).all())

    def test_runtime_reads_it(self, rule):
        """The runtime's features are the component's (with the rule's default parameters)."""
        x = _randn(B, H, N, self.d, seed=8)
        got = rule.runtime.feature(x, rule.default_params(f64))
        torch.testing.assert_close(got, self.expected(x), rtol=RTOL, atol=1e-12)


class TestIdentityMap(FeatureMapContract):
    feature_map = IdentityMap()

    def expected(self, x):
        return x


class TestPolynomialMap(FeatureMapContract):
    feature_map = PolynomialMap(degree=3)

    def expected(self, x):
        a = self.feature_map.initial_coefficients().to(f64)  # the stored 1/i!, float32
        return a[0] * x + a[1] * x**2 + a[2] * x**3

    def test_initial_coefficients_are_the_taylor_ones(self):
        a = self.feature_map.initial_coefficients()
        torch.testing.assert_close(a, torch.tensor([1.0, 1 / 2, 1 / 6], dtype=a.dtype))


class TestTaylorMap(FeatureMapContract):
    feature_map = TaylorMap()

    def expected(self, x):
        d = x.shape[-1]
        pairs = [(i, j) for i in range(d) for j in range(i, d)]
        quad = [x[..., i] * x[..., j] * (1 / math.sqrt(2) if i == j else 1.0) for i, j in pairs]
        return torch.cat([torch.ones_like(x[..., :1]), x, torch.stack(quad, -1)], -1)

    def test_inner_product_is_the_taylor_kernel(self, rule):
        a, b = _randn(self.d, seed=1), _randn(self.d, seed=2)
        dot = a @ b
        got = self._features(rule, a) @ self._features(rule, b)
        torch.testing.assert_close(got, 1 + dot + dot**2 / 2, rtol=RTOL, atol=0)


class TestCustomMap(FeatureMapContract):
    feature_map = CustomMap(formula="x + c*tanh(x)", params={"c": 0.5})

    def expected(self, x):
        return x + 0.5 * torch.tanh(x)


class TestExpKernelMap(FeatureMapContract):
    """The gated exp-kernel map at order 3 (tests/components/test_exp_kernel.py holds the kernel itself)."""

    feature_map = ExpKernelMap(order=3, gating=True, max_features=10_000)  # the spec: d = 32

    def expected(self, x):
        d = x.shape[-1]
        blocks = [torch.ones_like(x[..., :1])]
        for p in range(1, 4):
            for m in itertools.combinations_with_replacement(range(d), p):
                counts = [m.count(i) for i in range(d)]
                weight = 1 / math.sqrt(math.prod(math.factorial(n) for n in counts))
                blocks.append(weight * math.prod(x[..., i] for i in m).unsqueeze(-1))
        return torch.cat(blocks, -1)


# The f-divergence retention: the retention contract, inherited ---------------------------------


class TestFDivergence(RetentionContract):
    retention = FDivergenceRetention()

    def expected(self, w0_, u_, gates):
        # The generalized KL generator: a_t log(W/W0) + (1 - a_t) log W + u = 0.
        return w0_ ** gates["decay"] * torch.exp(-u_)

    def test_bad_generator_is_refused_at_the_field(self):
        with pytest.raises(ValidationError, match="f'\\(1\\) = 1;"):
            FDivergenceRetention(f="t*log(t)")
        with pytest.raises(ValidationError, match="does not depend on t"):
            FDivergenceRetention(f="1")

    def test_generator_without_closed_form_is_a_derivation_error(self):
        # Refused when validated, with derive's message; derive refuses an unvalidated one.
        with pytest.raises(ValidationError, match="retention f_divergence"):
            FDivergenceRetention(f="(sqrt(t) - 1)**2")
        with pytest.raises(DerivationError, match="retention f_divergence"):
            derive_retention(FDivergenceRetention.model_construct(f="(sqrt(t) - 1)**2"))

    def test_end_to_end_on_every_backend(self):
        spec = {"name": "f_divergence_matrix", "retention": "f_divergence"}
        results = check_end_to_end(miras.compile(spec, checked=False), triton=False)
        assert results and all(r.passed for r in results), [str(r) for r in results]
