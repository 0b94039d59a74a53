"""Issue 10, item 9: the lq text names the spec's q, Bregman errors say what sympy found, the lp
gradient prints simplified, the 'appears outside sum' wording, params keys and values refused
by name, and gates whose dtype differs from the inputs' refused."""

from __future__ import annotations

import pytest
import sympy as sp
import torch
from helpers import random_inputs
from typer.testing import CliRunner

from miras import compile as compile_spec
from miras.cli import app
from miras.compiler.bias_check import check_bias
from miras.compiler.bias_derive import _sign_to_abs, derive_bias
from miras.compiler.retention_derive import _solve_unique, derive_retention
from miras.components.bias.lp import LpBias
from miras.components.retention.bregman import BregmanRetention
from miras.components.retention.lq import LqRetention
from miras.errors import DerivationError, SpecError
from miras.spec import load_spec
from miras.symbols import e, w

BASE = {"name": "t", "memory": "matrix", "bias": "l2", "retention": "l2", "optimizer": "gd"}
runner = CliRunner()


def problems(fields: dict) -> list[str]:
    with pytest.raises(SpecError) as info:
        load_spec({**BASE, **fields})
    return [str(p) for p in info.value.problems]


# --- lq: the spec's q ------------------------------------------------------------------------


def test_lq_equation_names_the_specs_q(tmp_path):
    assert "||A_t||_3^1" in LqRetention(q=3).spec_equation()
    assert "q = 3 here, 4 in Moneta" in LqRetention(q=3).spec_equation()
    assert "||A_t||_4^2" in LqRetention().spec_equation()
    path = tmp_path / "lq3.yaml"
    path.write_text("name: lq3\nmemory: matrix\nbias: l2\nretention: {kind: lq, q: 3}\n")
    text = runner.invoke(app, ["derive", str(path)]).stdout
    assert "||A_t||_3^1   (MIRAS eq. 24; q = 3 here, 4 in Moneta)" in text
    assert "q = 4)" not in text


# --- Bregman: what sympy found ---------------------------------------------------------------


def test_bregman_error_when_sympy_finds_no_solution():
    with pytest.raises(DerivationError) as info:  # F' = w^5 + w; unvalidated (validation refuses)
        derive_retention(BregmanRetention.model_construct(potential="w**6/6 + w**2/2"))
    message = str(info.value)
    assert "sympy found no closed-form solution for w" in message
    assert "no solution was not" not in message and "retention.solver: newton" in message


def test_bregman_error_lists_the_rejected_solutions_on_the_command_line(tmp_path):
    path = tmp_path / "cubic.yaml"
    path.write_text(
        "name: cubic\nmemory: matrix\nbias: l2\nretention: {kind: bregman, potential: 'w**4/4'}\n"
    )
    result = runner.invoke(app, ["derive", str(path)])
    assert result.exit_code == 1
    # rich used to read the bracketed list as markup and print "its solutions  are not"
    assert "none of its solutions for w (z**(1/3), " in result.stderr, result.stderr
    assert "is a real inverse at every sample point" in result.stderr


def test_solve_unique_says_how_many_solutions_sympy_found():
    with pytest.raises(DerivationError, match=r"sympy found no solution of exp\(w\) = 0 for w"):
        _solve_unique(sp.exp(w), w, "case")
    with pytest.raises(DerivationError, match=r"sympy found 2: -1, 1"):
        _solve_unique(w**2 - 1, w, "case")


# --- lp: a simplified gradient ---------------------------------------------------------------


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


# --- custom loss wording ---------------------------------------------------------------------


def test_appears_outside_sum_is_grammatical():
    (one,) = problems({"bias": {"kind": "custom", "loss": "sum(e**2) + y"}})
    assert one.startswith("bias.loss: y appears outside sum(...)/norm(...); ")
    (two,) = problems({"bias": {"kind": "custom", "loss": "sum(e**2) + y*v"}})
    assert two.startswith("bias.loss: v, y appear outside sum(...)/norm(...); ")


# --- params keys and values ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("params", "path", "words"),
    [
        ({"c": float("nan")}, "feature_map.params.c", "expected a number in (-inf, inf), got nan"),
        ({"c": float("inf")}, "feature_map.params.c", "expected a number in (-inf, inf), got inf"),
        ({"c": True}, "feature_map.params.c", "got True"),
        ({"c": "gate"}, "feature_map.params.c", "got 'gate'"),
        ({"c": "2"}, "feature_map.params.c", "got '2'"),
    ],
    ids=["nan", "inf", "bool", "gate", "text"],
)
def test_feature_map_param_values_must_be_finite_numbers(params, path, words):
    fields = {"feature_map": {"kind": "custom", "formula": "c*x", "params": params}}
    (message,) = problems(fields)
    assert message.startswith(f"{path}: ") and words in message


@pytest.mark.parametrize("name", ["exp", "sum", "norm", "where", "sigmoid"])
def test_param_named_like_a_function_is_refused(name):
    bias = {"bias": {"kind": "custom", "loss": f"{name}*e**2", "params": {name: 1.0}}}
    (message,) = problems(bias)
    assert message.startswith("bias.params: ")
    assert f"parameter name '{name}' is the name of a formula function" in message


def test_unused_param_names_the_key_and_the_used_ones():
    bias = {"bias": {"kind": "custom", "loss": "c*e**2", "params": {"c": 1.0, "delta": 2.0}}}
    (message,) = problems(bias)
    assert message == (
        "bias.params: parameter name 'delta' is declared in params but not used in loss "
        "(it uses c); use it in the formula or remove it"
    )


# --- gate dtypes -----------------------------------------------------------------------------


def test_gate_dtype_must_match_the_inputs():
    rule = compile_spec("specs/gated_deltanet.yaml")
    q, k, v, gates = random_inputs(rule, t=5, dtype=torch.float32)
    rule(q, k, v, gates)  # matching dtypes run
    wide = {**gates, "lr": gates["lr"].double()}
    with pytest.raises(ValueError) as info:
        rule(q, k, v, wide)
    assert str(info.value) == (
        "gates['lr']: the gate is float64 but q, k, v are float32; pass gates in the inputs' "
        "dtype, e.g. gates['lr'].to(q.dtype)"
    )
    q16, k16, v16 = (x.bfloat16() for x in (q, k, v))
    with pytest.raises(
        ValueError, match=r"gates\['decay'\]: the gate is float32 but q, k, v are bfloat16"
    ):
        rule(q16, k16, v16, gates)
