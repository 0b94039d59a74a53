"""Formulas that cannot compile, or that give NaN in every backend, are refused when the spec is
loaded, naming the field and the reason (issue 10, item 4): never a raw TypeError/AttributeError
from sympy or the printer later on."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from miras.cli import app
from miras.derive.bias_derive import derive_bias
from miras.derive.emit import load_module, module_source
from miras.errors import SpecError
from miras.spec import load_spec

BASE = {"name": "t", "memory": "matrix", "retention": "l2", "optimizer": "gd"}


def problem(fields: dict) -> str:
    """The one problem load_spec reports for BASE + fields, as 'path: message'."""
    with pytest.raises(SpecError) as info:  # a SpecError, not a TypeError/AttributeError
        load_spec({**BASE, **fields})
    assert len(info.value.problems) == 1, info.value.problems
    return str(info.value.problems[0])


def custom_bias(loss: str, params: dict | None = None) -> dict:
    return {"bias": {"kind": "custom", "loss": loss, "params": params or {}}}


# --- custom bias loss ------------------------------------------------------------------------

REFUSED_LOSSES = [
    # the four
    ("1", "is a constant (it uses none of e, y, v)"),
    ("e > 0", "'e > 0' is a condition (true or false), not a number"),
    ("e**2/0", "'e**2/0' divides by zero"),
    ("e**0.5", "the gradient dL/dy is infinite at e = 0"),
    # the same classes, elsewhere in a formula
    ("abs(e)**0.5", "the gradient dL/dy is undefined (NaN) at e = 0"),
    ("(e > 0)*e", "'e > 0' is a condition"),
    ("where(e, e**2, 0)", "the condition 'e' is not a comparison"),
    ("e**2 + log(0)", "'log(0)' is infinite (sympy: zoo)"),
    ("e**2 + 0**-1", "'0**-1' is infinite"),
    ("e**2 + 1/(1/0)", "'1/0' divides by zero"),
    ("e**2 + sqrt(-1)", "'sqrt(-1)' is not real"),
    ("log(e)", "the loss is infinite at e = 0"),
    ("e/tanh(e)", "the loss is undefined (NaN) at e = 0"),
    ("sqrt(sum(e**2))", "the gradient dL/dy is undefined (NaN) at e = 0"),
    ("e**1.5", "the loss is not real at e = -1/2"),
    ("v**2", "does not change with the prediction y"),
    ("where(e > 0, 1, 0)", "does not change with the prediction y"),
]


@pytest.mark.parametrize(("loss", "reason"), REFUSED_LOSSES, ids=[c[0] for c in REFUSED_LOSSES])
def test_custom_loss_refused_naming_field_and_reason(loss, reason):
    message = problem(custom_bias(loss))
    assert message.startswith("bias.loss: "), message
    assert reason in message


def test_not_differentiable_at_zero_says_so_and_how_to_smooth():
    message = problem(custom_bias("abs(e)**0.5"))
    assert "not differentiable there" in message and "(e**2 + 1e-6)**(p/2)" in message


def test_gate_parameter_probed_at_one_and_fixed_ones_at_their_value():
    # a*e**0.5 with a gate: still infinite slope at 0; c*log(1 + e**2) with c fixed: fine.
    assert "infinite at e = 0" in problem(custom_bias("a*e**0.5", {"a": "gate"}))
    load_spec({**BASE, **custom_bias("c*log(1 + e**2)", {"c": 0.5})})


ACCEPTED_LOSSES = [
    ("a*log(cosh(e/a))", {"a": "gate"}),
    ("c**2/2*log(1 + sum(e**2)/c**2)", {"c": 2.0}),
    ("norm(e) + sum(tanh(y)*v)", {}),
    ("softplus(-y*v) + y**2/4", {}),
    ("where(e > 0, 2*e**2, e**2/2)", {}),
    ("abs(e)", {}),  # a kink with a finite slope: gradient sign(e)
    ("abs(e)**1.5", {}),
    ("sum(3*y)", {}),  # linear: a constant, nonzero gradient
]


@pytest.mark.parametrize(("loss", "params"), ACCEPTED_LOSSES, ids=[c[0] for c in ACCEPTED_LOSSES])
def test_accepted_losses_have_finite_gradient_at_zero_error(loss, params):
    """What validation lets through computes finite values at e = 0 exactly (y = v)."""
    spec = load_spec({**BASE, **custom_bias(loss, params)})
    rule = derive_bias(spec.bias)
    module = load_module(module_source("bias", [rule.source]))
    v = torch.randn(3, 5, dtype=torch.float64)
    gates = [torch.ones(3, 1, dtype=torch.float64) for _ in rule.gates]
    for y in (v.clone(), v + 0.5, v - 2.0):
        assert torch.isfinite(module.bias_loss(y, v, *gates)).all()
        assert torch.isfinite(module.bias_grad(y, v, *gates)).all()


@pytest.mark.parametrize(
    ("loss", "torch_loss"),
    [
        ("e**0.5", lambda e: e**0.5),
        ("abs(e)**0.5", lambda e: e.abs() ** 0.5),
        ("e/tanh(e)", lambda e: e / torch.tanh(e)),
        ("log(e)", torch.log),
    ],
    ids=lambda c: c if isinstance(c, str) else "",
)
def test_refused_losses_would_be_nan_at_zero_error(loss, torch_loss):
    """The refusals at e = 0 are real: torch gives a non-finite loss or gradient there."""
    assert "at e = 0" in problem(custom_bias(loss))
    y = torch.zeros(4, dtype=torch.float64, requires_grad=True)
    value = torch_loss(y - torch.zeros(4, dtype=torch.float64)).sum()
    (grad,) = torch.autograd.grad(value, y)
    assert not (torch.isfinite(value) and torch.isfinite(grad).all())


# --- custom feature map, bregman potential ---------------------------------------------------

REFUSED_MAPS = [
    ("1", {}, "the feature map does not use x"),
    ("c", {"c": 2.0}, "the feature map does not use x"),
    ("x > 0", {}, "'x > 0' is a condition"),
    ("x/0", {}, "'x/0' divides by zero"),
    ("x/c", {"c": 0.0}, "'x/c' divides by zero"),
    ("log(x)", {}, "phi(x) is infinite at x = 0"),
    ("sqrt(x)", {}, "the derivative phi'(x) is infinite at x = 0"),
    ("x**1.5", {}, "phi(x) is not real at x = -1/2"),
]


@pytest.mark.parametrize(
    ("formula", "params", "reason"), REFUSED_MAPS, ids=[c[0] for c in REFUSED_MAPS]
)
def test_custom_feature_map_refused(formula, params, reason):
    fields = {"bias": "l2", "feature_map": {"kind": "custom", "formula": formula, "params": params}}
    message = problem(fields)
    assert message.startswith("feature_map.formula: "), message
    assert reason in message


@pytest.mark.parametrize(
    ("potential", "reason"),
    [
        ("w > 0", "'w > 0' is a condition"),
        ("w**2/0", "'w**2/0' divides by zero"),
        ("w**2 + log(0)", "'log(0)' is infinite"),
        ("3", "does not depend on w"),
    ],
)
def test_bregman_potential_refused(potential, reason):
    fields = {"bias": "l2", "retention": {"kind": "bregman", "potential": potential}}
    message = problem(fields)
    assert message.startswith("retention.potential: "), message
    assert reason in message


# --- the custom loss's wording; params keys and values ---------------------------------------


def test_appears_outside_sum_is_grammatical():
    one = problem({"bias": {"kind": "custom", "loss": "sum(e**2) + y"}})
    assert one.startswith("bias.loss: y appears outside sum(...)/norm(...); ")
    two = problem({"bias": {"kind": "custom", "loss": "sum(e**2) + y*v"}})
    assert two.startswith("bias.loss: v, y appear outside sum(...)/norm(...); ")


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
    fields = {"bias": "l2", "feature_map": {"kind": "custom", "formula": "c*x", "params": params}}
    message = problem(fields)
    assert message.startswith(f"{path}: ") and words in message


@pytest.mark.parametrize("name", ["exp", "sum", "norm", "where", "sigmoid"])
def test_param_named_like_a_function_is_refused(name):
    bias = {"bias": {"kind": "custom", "loss": f"{name}*e**2", "params": {name: 1.0}}}
    message = problem(bias)
    assert message.startswith("bias.params: ")
    assert f"parameter name '{name}' is the name of a formula function" in message


def test_unused_param_names_the_key_and_the_used_ones():
    bias = {"bias": {"kind": "custom", "loss": "c*e**2", "params": {"c": 1.0, "delta": 2.0}}}
    message = problem(bias)
    assert message == (
        "bias.params: parameter name 'delta' is declared in params but not used in loss "
        "(it uses c); use it in the formula or remove it"
    )


# --- the command line ------------------------------------------------------------------------


def write_spec(tmp_path, name: str, loss: str):
    path = tmp_path / f"{name}.yaml"
    path.write_text(
        f'name: {name}\nmemory: matrix\nbias: {{kind: custom, loss: "{loss}"}}\n'
        "retention: l2\noptimizer: gd\n"
    )
    return path


@pytest.mark.parametrize(
    ("loss", "reason"),
    [
        ("1", "is a constant"),
        ("e > 0", "is a condition"),
        ("e**2/0", "divides by zero"),
        ("e**0.5", "infinite at e = 0"),
    ],
)
def test_cli_validate_and_check_refuse_cleanly(tmp_path, loss, reason):
    path = write_spec(tmp_path, "bad", loss)
    runner = CliRunner()
    for command in ("validate", "check"):
        result = runner.invoke(app, [command, str(path)])
        assert result.exit_code == 1, (command, result.output)
        assert "bias.loss" in result.stderr and reason in result.stderr, result.stderr
        assert "Traceback" not in result.output
        assert not isinstance(result.exception, (TypeError, AttributeError))
