"""The emitted bias_grad against sympy's own derivative of the written-out loss, in float64.

tests/compiler/test_bias.py checks the derived dL/dy against autograd of the emitted `bias_loss`, which
shares the printer (and the channel-sum bookkeeping) with `bias_grad`: a printing mistake made
in both would pass. The oracle here shares neither. The parsed formula is written out as one
scalar expression over Dv = 3 concrete channels (each sum(f) becomes f(e_0, y_0, v_0) + ... +
f(e_2, y_2, v_2), with e_j = y_j - v_j; sigmoid and softplus spelt out as exponentials), sympy
differentiates it with respect to each y_j by its own rules, and the result is evaluated with
`subs` and `evalf` at 30 digits at random points. No chain rule through channel sums, no
`_tidy`, no torch printer.

Tolerance: 1e-10 relative (to the largest entry of each gradient, at least 1): float64
rounding in the emitted torch code against an almost exact value.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import sympy as sp
import torch

import miras
from miras.components import CustomBias, DotBias, HuberBias, L2Bias, LpBias, RobustBias
from miras.derive.bias_derive import derive_bias
from miras.derive.emit import load_module, module_source
from miras.derive.symbols import ChannelSum, e, gate_symbol, sigmoid, softplus, v, y

ROOT = Path(__file__).resolve().parents[2]
DV = 3  # value channels written out
POINTS = 6  # random (y, v, gates) vectors per bias
DIGITS = 30
TOL = 1e-10

YS = sp.symbols(f"y0:{DV}", real=True)
VS = sp.symbols(f"v0:{DV}", real=True)


def _shipped_custom_biases() -> dict[str, CustomBias]:
    found = {}
    for path in sorted([*ROOT.glob("specs/*.yaml"), *ROOT.glob("specs/examples/*.yaml")]):
        bias = miras.load_spec(path).bias
        if bias.kind == "custom":
            found[path.stem] = bias
    return found


SHIPPED = _shipped_custom_biases()

# Formulas written for this test (and the custom biases of tests/compiler/test_bias.py): elementwise and
# whole-vector losses, in e, y and v, gated and fixed parameters, every family of function.
WRITTEN = {
    "logcosh": CustomBias(loss="log(cosh(e))"),
    "scaled_logcosh_gate": CustomBias(loss="a*log(cosh(e/a))", params={"a": "gate"}),
    "pseudo_huber": CustomBias(loss="c**2*(sqrt(1 + (e/c)**2) - 1)", params={"c": 0.7}),
    "softplus_in_y": CustomBias(loss="softplus(-y*v) + y**2/4"),
    "where_asymmetric": CustomBias(loss="where(e > 0, 2*e**2, e**2/2)"),
    "cauchy_norm": CustomBias(loss="c**2/2*log(1 + sum(e**2)/c**2)", params={"c": 2.0}),
    "norm_and_sum": CustomBias(loss="norm(e) + sum(tanh(y)*v)", params={}),
    "constant_gradient": CustomBias(loss="sum(3*y)"),
    "sigmoid_weighted": CustomBias(loss="sigmoid(y*v)*e**2 + log1p(e**2)"),
    "erf_asinh_atan": CustomBias(loss="e*erf(e) + asinh(e)*e + e*atan(e)"),
    "trig_exp": CustomBias(loss="exp(-v**2)*(1 - cos(e)) + sin(y)**2/3"),
    "piecewise_abs": CustomBias(
        loss="Piecewise((abs(e)**3, abs(e) < t), (t**2*abs(e), True))", params={"t": "gate"}
    ),
    "min_max": CustomBias(loss="max(e**2, abs(e)/2) + min(y, v)**2"),
    "two_gates_two_sums": CustomBias(
        loss="sqrt(b + sum(e**2)) * (1 + sum(sinh(e/a))**2/10)",
        params={"a": "gate", "b": "gate"},
    ),
    "abs_cubed": CustomBias(loss="abs(e)**3/3 + e**2/2"),
    # sign's derivative is a DiracDelta: the compiler keeps the almost-everywhere derivative
    # (it once raised UnsupportedExpression on the delta instead). sign(e) e^3 = |e|^3 keeps the
    # loss bounded below (sign(e) e^4 is not: such a loss is refused at validation).
    "sign_cubed": CustomBias(loss="sign(e)*e**3/3 + e**2/2"),
}

BUILT_IN = {
    "dot": DotBias(),
    "l2": L2Bias(),
    "lp3": LpBias(p=3),
    "lp1.5": LpBias(p=1.5, eps=0.01),
    "huber_gate": HuberBias(),
    "huber_fixed": HuberBias(delta=0.4),
    "robust_gate": RobustBias(radius="gate"),
}

CASES = {
    **{f"spec_{name}": bias for name, bias in SHIPPED.items()},
    **{f"written_{name}": bias for name, bias in WRITTEN.items()},
    **{f"builtin_{name}": bias for name, bias in BUILT_IN.items()},
}


def test_the_shipped_specs_have_custom_biases():
    """The oracle covers every shipped custom bias; these two at least must be among them."""
    assert {"cauchy_memory", "logcosh_deltanet"} <= set(SHIPPED)


def written_out(bias) -> sp.Expr:
    """L over the DV concrete channels, parameters still symbols, with no ChannelSum left and
    sigmoid/softplus as exponentials (so sympy's derivative does not use their fdiff)."""

    def expand(term: sp.Expr) -> sp.Expr:
        return sp.Add(
            *(
                term.subs({e: YS[j] - VS[j], y: YS[j], v: VS[j]}, simultaneous=True)
                for j in range(DV)
            )
        )

    loss = bias.expression().replace(ChannelSum, expand)
    loss = loss.replace(sigmoid, lambda z: 1 / (1 + sp.exp(-z)))
    loss = loss.replace(softplus, lambda z: sp.log(1 + sp.exp(z)))
    assert not loss.has(ChannelSum, sigmoid, softplus) and not loss.free_symbols & {e, y, v}
    return loss


def sample(bias, seed: int):
    """y, v [POINTS, DV] and each gate [POINTS, 1], float64."""
    gen = torch.Generator().manual_seed(seed)
    y_ = torch.randn(POINTS, DV, dtype=torch.float64, generator=gen)
    v_ = torch.randn(POINTS, DV, dtype=torch.float64, generator=gen)
    gates = {
        n: 0.1 + torch.rand(POINTS, 1, dtype=torch.float64, generator=gen) for n in bias.gates()
    }
    return y_, v_, gates


def exact(expr: sp.Expr, bias, y_, v_, gates, row: int) -> float:
    values = {s: sp.Float(float(x), DIGITS) for s, x in zip(YS, y_[row].tolist(), strict=True)}
    values |= {s: sp.Float(float(x), DIGITS) for s, x in zip(VS, v_[row].tolist(), strict=True)}
    values |= {gate_symbol(n): sp.Float(float(g[row, 0]), DIGITS) for n, g in gates.items()}
    values |= {gate_symbol(n): sp.nsimplify(x) for n, x in bias.fixed().items()}
    number = expr.subs(values).evalf(DIGITS)
    assert number.is_number and number.is_real, f"not a real number: {number}"
    return float(number)


@pytest.mark.parametrize("name", list(CASES))
def test_emitted_gradient_equals_sympy_derivative(name):
    bias = CASES[name]
    loss = written_out(bias)
    gradient = [sp.diff(loss, yj) for yj in YS]
    module = load_module(module_source(f"oracle {name}", [derive_bias(bias).source]))
    y_, v_, gates = sample(bias, seed=0)

    got_grad = module.bias_grad(y_, v_, *gates.values())
    got_loss = module.bias_loss(y_, v_, *gates.values())
    want_grad = torch.tensor(
        [[exact(g, bias, y_, v_, gates, r) for g in gradient] for r in range(POINTS)],
        dtype=torch.float64,
    )
    want_loss = torch.tensor(
        [[exact(loss, bias, y_, v_, gates, r)] for r in range(POINTS)], dtype=torch.float64
    )
    assert got_grad.shape == (POINTS, DV) and got_loss.shape == (POINTS, 1)
    for what, got, want in (("dL/dy", got_grad, want_grad), ("L", got_loss, want_loss)):
        scale = want.abs().max().clamp_min(1.0)
        err = float((got - want).abs().max() / scale)
        assert err <= TOL, f"{what}: relative error {err:.3g}\ngot {got}\nwant {want}"


def test_the_oracle_catches_a_printing_mistake():
    """A gradient off by a small factor in the emitted source is caught."""
    bias = CustomBias(loss="log(cosh(e))")
    source = derive_bias(bias).source
    broken = source.replace("torch.tanh(e)", "1.000001*torch.tanh(e)")
    assert broken != source
    module = load_module(module_source("oracle broken", [broken]))
    y_, v_, gates = sample(bias, 0)
    gradient = [sp.diff(written_out(bias), yj) for yj in YS]
    want = torch.tensor(
        [[exact(g, bias, y_, v_, gates, r) for g in gradient] for r in range(POINTS)],
        dtype=torch.float64,
    )
    err = float((module.bias_grad(y_, v_) - want).abs().max() / want.abs().max().clamp_min(1))
    assert err > TOL
