"""Every attentional bias: the derived dL/dy equals autograd of L (float64, rel. 1e-10).

`BiasContract` is the battery; each bias subclasses it with an instance and what it expects,
so a new bias gets every check by adding one class.
"""

import pytest
import sympy as sp
import torch

import miras
from miras.components import CustomBias, DotBias, HuberBias, L2Bias, LpBias, RobustBias
from miras.components.bias.layer_norm import LayerNormBias
from miras.derive.bias_check import check_bias
from miras.derive.bias_derive import _sign_to_abs, derive_bias
from miras.derive.emit import load_module, module_source
from miras.derive.symbols import channels, e, gate_symbol, v, y
from miras.errors import DerivationError
from tests.helpers import random_inputs

TOL = 1e-10


class BiasContract:
    bias = None
    elementwise = True
    # Whether its gates may come per value channel (`BiasRule.channel_gates`); None: where it
    # is elementwise. A whole-vector loss may still read a gate inside its channel sums only.
    channel_gates = None

    @pytest.fixture(scope="class")
    @classmethod
    def rule(cls):
        return derive_bias(cls.bias)

    @pytest.fixture(scope="class")
    @classmethod
    def module(cls, rule):
        return load_module(module_source("test", [rule.source]))

    @pytest.mark.parametrize("seed", [0, 1, 2])
    def test_gradient_matches_autograd(self, rule, seed):
        results = check_bias(self.bias, rule, seed=seed, tolerance=TOL)
        assert results, "no check ran"
        for r in results:
            assert r.passed, f"{r.piece}: {r.error:.3g}"

    def test_elementwise_detection(self, rule):
        assert rule.elementwise is self.elementwise

    def test_channel_gates_are_declared(self, rule):
        per_channel = self.elementwise if self.channel_gates is None else self.channel_gates
        assert set(rule.channel_gates) == (set(self.bias.gates()) if per_channel else set())

    def test_per_channel_gates_and_odd_shapes(self, module):
        """Gates per channel [..., Dv] broadcast like per-head ones [..., 1]. A whole-vector
        loss whose gate scales a norm has no per-channel gate, so it gets one per vector."""
        gen = torch.Generator().manual_seed(5)
        y = torch.randn(2, 5, 3, 60, dtype=torch.float64, generator=gen, requires_grad=True)
        v_ = torch.randn(2, 5, 3, 60, dtype=torch.float64, generator=gen)
        per_channel = self.elementwise if self.channel_gates is None else self.channel_gates
        width = 60 if per_channel else 1
        gates = [
            0.1 + torch.rand(2, 5, 3, width, dtype=torch.float64, generator=gen)
            for _ in self.bias.gates()
        ]
        derived = module.bias_grad(y, v_, *gates)
        loss = module.bias_loss(y, v_, *gates)
        assert loss.shape == (2, 5, 3, 1) and derived.shape == y.shape
        (expected,) = torch.autograd.grad(loss.sum(), y)
        torch.testing.assert_close(derived, expected, rtol=TOL, atol=TOL)


class KnownGradient(BiasContract):
    """A bias whose gradient the paper states: the derivation must find exactly it."""

    gradient: sp.Expr  # dL/dy in e, v and gates

    def test_known_gradient(self, rule):
        assert sp.simplify(rule.gradient - self.gradient) == 0


class TestDot(KnownGradient):
    bias = DotBias()
    gradient = -v


class TestL2(KnownGradient):
    bias = L2Bias()
    gradient = e


class TestLp3(KnownGradient):
    bias = LpBias(p=3)
    gradient = 3 * e * sp.Abs(e)


class TestLp1Smoothed(KnownGradient):
    bias = LpBias(p=1)  # sqrt(e^2 + 1e-6): MIRAS Remark 5
    gradient = e / sp.sqrt(e**2 + sp.Rational(1, 10**6))


class TestLp1point5(BiasContract):
    bias = LpBias(p=1.5, eps=0.01)


class TestHuberGate(KnownGradient):
    bias = HuberBias()
    d = gate_symbol("delta")
    gradient = sp.Piecewise((e, sp.Abs(e) <= d), (d * sp.sign(e), True))


class TestHuberFixed(BiasContract):
    bias = HuberBias(delta=0.4)


class TestRobust(BiasContract):
    bias = RobustBias(radius="gate")
    elementwise = False


class TestRobustFixed(BiasContract):
    bias = RobustBias(radius=0.3)
    elementwise = False


class TestLayerNorm(BiasContract):
    bias = LayerNormBias()
    elementwise = False
    channel_gates = True  # the weight and bias of channel j meet channel j's term

    def test_gradient_is_the_layer_norm_backward(self, module):
        """The derived dL/dy is LayerNorm's backward written out (as fla's ttt_linear writes it):
        with n = LN(y), s = sqrt(var + eps) and g = w (w n + b - v),
        dL/dy = (D g - sum(g) - n sum(g n)) / (s D); per-head and per-channel w, b, and a mean
        far from 0 (the two-pass variance)."""
        gen = torch.Generator().manual_seed(3)
        y = 5.0 + torch.randn(4, 3, 24, dtype=torch.float64, generator=gen)
        v_ = torch.randn(4, 3, 24, dtype=torch.float64, generator=gen)
        for width in (1, 24):
            w, b = (torch.randn(4, 3, width, dtype=torch.float64, generator=gen) for _ in "wb")
            mean = y.mean(-1, keepdim=True)
            s = torch.sqrt(y.var(-1, unbiased=False, keepdim=True) + 1e-6)
            n = (y - mean) / s
            g = w * (w * n + b - v_)
            d = y.shape[-1]
            want = (d * g - g.sum(-1, keepdim=True) - n * (g * n).sum(-1, keepdim=True)) / (s * d)
            torch.testing.assert_close(module.bias_grad(y, v_, w, b), want, rtol=1e-9, atol=1e-12)

    def test_the_mean_and_variance_are_sums_inside_the_loss(self, rule):
        """Channel statistics: the variance's sum reads the mean's (two passes, as torch's
        layer_norm), and the gradient reads both."""
        mean = next(s for s, f in rule.sums if f == y)
        variance = next(s for s, f in rule.sums if f == (y - mean / channels) ** 2)
        assert rule.gradient.has(mean) and rule.gradient.has(variance)
        assert not rule.elementwise


class TestLayerNormFixed(BiasContract):
    bias = LayerNormBias(ln_weight=1.5, ln_bias=-0.25, ln_eps=1e-5)
    elementwise = False


class TestCustomLogCosh(KnownGradient):
    bias = CustomBias(loss="log(cosh(e))")
    gradient = sp.tanh(e)


class TestCustomScaledLogCosh(KnownGradient):
    bias = CustomBias(loss="a*log(cosh(e/a))", params={"a": "gate"})
    gradient = sp.tanh(e / gate_symbol("a"))


class TestCustomPseudoHuber(BiasContract):
    bias = CustomBias(loss="c**2*(sqrt(1 + (e/c)**2) - 1)", params={"c": 0.7})


class TestCustomInY(BiasContract):
    """A loss in y and v, not only e."""

    bias = CustomBias(loss="softplus(-y*v) + y**2/4")


class TestCustomPiecewise(BiasContract):
    bias = CustomBias(loss="where(e > 0, 2*e**2, e**2/2)")


class TestCustomCauchyOfNorm(BiasContract):
    bias = CustomBias(loss="c**2/2*log(1 + sum(e**2)/c**2)", params={"c": 2.0})
    elementwise = False


class TestCustomNormAndSum(BiasContract):
    bias = CustomBias(loss="norm(e) + sum(tanh(y)*v)", params={})
    elementwise = False


class TestCustomConstantGradient(KnownGradient):
    """dL/dy does not depend on e: the emitted gradient is still a full tensor."""

    bias = CustomBias(loss="sum(3*y)")
    gradient = sp.Integer(3)


def test_check_catches_a_wrong_gradient():
    """The check can fail: a rule whose gradient is off by a factor is reported."""
    bias = L2Bias()
    rule = derive_bias(bias)
    broken = rule.__class__(**{**rule.__dict__, "source": rule.source.replace("+ e", "+ 1.001*e")})
    assert broken.source != rule.source
    assert not all(r.passed for r in check_bias(bias, broken))


def test_loss_without_channel_sum_is_refused():
    class Broken(L2Bias):
        def expression(self):
            return e**2

    with pytest.raises(DerivationError, match="no channel sum"):
        derive_bias(Broken())


def test_whole_vector_bias_refuses_per_channel_gates():
    rule = miras.compile({"name": "robust-gate", "bias": {"kind": "robust", "radius": "gate"}})
    q, k, v, gates = random_inputs(rule, t=5)
    gates["radius"] = gates["radius"].unsqueeze(-1).expand(*gates["radius"].shape, v.shape[-1])
    with pytest.raises(ValueError, match="radius"):
        rule(q, k, v, gates, backend="recurrent")


# The lp gradient prints simplified: sign(e) absorbed into |e| ---------------------------------


@pytest.mark.parametrize(
    ("p", "gradient"),
    [(3, "3*e*Abs(e)"), (5, "5*e**3*Abs(e)"), (2.5, "5*e*sqrt(Abs(e))/2"), (4, "4*e**3")],
)
def test_lp_gradient_is_simplified_and_checks(p, gradient):
    bias = LpBias(p=p)
    rule = derive_bias(bias)
    assert str(rule.gradient) == gradient
    assert all(r.passed for r in check_bias(bias, rule))


def test_sign_to_abs_is_the_same_function_at_zero_too():
    cases = [e**2 * sp.sign(e), 3 * e**4 * sp.sign(e) + e, e * sp.sign(e), sp.sign(e) + e]
    for expr in cases:
        rewritten = _sign_to_abs(expr)
        for point in (-2, -sp.Rational(1, 3), 0, sp.Rational(1, 2), 3):
            assert rewritten.subs(e, point) == expr.subs(e, point), (expr, point)
    assert _sign_to_abs(e**2 * sp.sign(e)) == e * sp.Abs(e)
    assert _sign_to_abs(sp.sign(e) + e) == sp.sign(e) + e  # no power of e to absorb sign(e)
