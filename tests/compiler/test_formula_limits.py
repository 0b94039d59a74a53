"""The limits that bound the work a formula asks of sympy (miras/derive/formula.py), and what validate
refuses so that derive never meets it: each adversarial formula is refused with the project's
own error, naming the field and the limit, within its time bound (validate 1 s, derive 10 s)."""

from __future__ import annotations

import contextlib
import signal
import time

import pytest
import sympy as sp

from miras.derive.affine import analyze
from miras.derive.bias_derive import derive_bias
from miras.derive.describe import latex_math, latex_text
from miras.derive.formula import (
    FLOAT64_MAX,
    MAX_CALL_DEPTH,
    MAX_DEGREE,
    MAX_DEPTH,
    OVERFLOW,
    not_finite,
    parse_formula,
    value_at,
)
from miras.errors import FormulaError, SpecError
from miras.spec import load_spec

BASE = {"name": "adv", "memory": "matrix", "retention": "none", "optimizer": "gd"}
E = sp.Symbol("e")


def nest(function: str, levels: int, inner: str = "e") -> str:
    for _ in range(levels):
        inner = f"{function}({inner})"
    return inner


@contextlib.contextmanager
def within(seconds: float):
    """Fail if the block takes longer than `seconds`; a hang is cut at 3x that by SIGALRM."""

    def hung(signum, frame):
        raise TimeoutError(f"still running after {3 * seconds:g} s")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(max(1, int(3 * seconds)))
    start = time.perf_counter()
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    elapsed = time.perf_counter() - start
    assert elapsed < seconds, f"took {elapsed:.2f} s; the bound is {seconds} s"


def refusal(loss: str | None = None, seconds: float = 1.0, **fields) -> str:
    """load_spec's SpecError message for a spec with this custom loss (or these fields)."""
    spec = {**BASE, "bias": {"kind": "custom", "loss": loss} if loss else "l2", **fields}
    with within(seconds), pytest.raises(SpecError) as info:
        load_spec(spec)
    return str(info.value)


# Formula size and shape, measured on the syntax tree -------------------------------------------


def test_nested_functions_are_refused_at_the_call_depth_limit():
    # Before: exp five deep ended validate in a raw OverflowError (from sp.N), six deep hung.
    for levels in (5, 6, 10):
        message = refusal(nest("exp", levels))
        assert "bias.loss:" in message and f"at most {MAX_CALL_DEPTH}" in message
    message = refusal(nest("tanh", 10))  # before: 8.7 s at validate
    assert f"functions are nested {MAX_CALL_DEPTH + 1} deep" in message


def test_a_power_of_a_power_is_refused_by_total_degree():
    # Before: each exponent passed the exponent limit and derive hung for over 120 s.
    message = refusal("((e**2+1)**16)**16")
    assert "bias.loss:" in message
    assert "total degree 512" in message and f"at most {MAX_DEGREE}" in message
    parse_formula("(e**2 + 1)**16", {"e": E})  # degree 32: at the limit, allowed


def test_deep_nesting_is_refused():
    with pytest.raises(FormulaError, match=f"more than {MAX_DEPTH} levels deep"):
        parse_formula("-" * MAX_DEPTH + "e", {"e": E})
    parse_formula("-" * (MAX_DEPTH - 1) + "e", {"e": E})


def test_a_long_literal_is_shortened_in_its_message():
    with pytest.raises(FormulaError) as info:
        parse_formula("1" * 1500 + "*e", {"e": E})
    message = str(info.value)
    assert "too large" in message and "(1500 characters)" in message and len(message) < 200


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("\ufb01", "'\ufb01' (U+FB01 LATIN SMALL LIGATURE FI) at column 1"),  # read as fi
        ("\uff45**2", "'\uff45' (U+FF45 FULLWIDTH LATIN SMALL LETTER E) at column 1"),  # as e
        ("e + \u03b1", "(U+03B1 GREEK SMALL LETTER ALPHA) at column 5"),
    ],
)
def test_non_ascii_is_refused_naming_the_character(text, shown):
    # Before: Python's NFKC reading reported 'fi' and silently read a fullwidth e as e.
    with pytest.raises(FormulaError) as info:
        parse_formula(text, {"e": E, "fi": sp.Symbol("fi")})
    assert shown in str(info.value) and "ASCII" in str(info.value)


def test_a_non_ascii_parameter_name_is_refused():
    spec = {**BASE, "bias": {"kind": "custom", "loss": "e**2", "params": {"\u03b1": 1.0}}}
    with pytest.raises(SpecError) as info:
        load_spec(spec)
    message = str(info.value)
    assert "bias.params" in message and "ASCII letters" in message


# Numeric evaluation: overflow is overflow ----------------------------------------------------


def test_overflow_is_reported_as_overflow():
    # exp(exp(exp(exp(2)))) overflows float64 many times over; sp.N raised OverflowError.
    with within(1.0):
        value = value_at(parse_formula(nest("exp", 4), {"e": E}), {E: 2})
    assert value == OVERFLOW and "overflows the float64 range" in not_finite(value)
    assert not_finite(value_at(sp.exp(E), {E: 700})) is None  # 1e304: still in range
    assert value_at(sp.exp(E), {E: 710}) == OVERFLOW  # 2.2e308 > FLOAT64_MAX
    assert float(value_at(sp.exp(E), {E: 709})) < FLOAT64_MAX


@pytest.mark.parametrize("loss", [nest("exp", 4), nest("exp", 3), "exp(e**16)"])
def test_a_loss_that_overflows_is_refused_at_validate(loss):
    message = refusal(loss)
    assert "bias.loss: the loss is too large (a term overflows the float64 range" in message


def test_the_check_names_an_overflow():
    # exp(e**8) is finite at the sample errors (|e| <= 2) and overflows at the check's random
    # ones (|e| near 4); the check said "error nan > 1e-10" for each piece.
    from miras.compiler.pipeline import compile_ir
    from miras.errors import DerivationError

    spec = load_spec({**BASE, "bias": {"kind": "custom", "loss": "exp(e**8)"}})
    with pytest.raises(DerivationError) as info:
        compile_ir(spec)
    assert "L and dL/dy overflow in float64 on the check inputs" in str(info.value)
    assert "error nan" not in str(info.value)


# The derivation's sympy work is bounded ------------------------------------------------------


def test_nested_tanh_derives_quickly():
    # Before: tanh four deep took 23.8 s to derive (90 s on a loaded machine) in simplify,
    # proving the slope not affine; six deep over 100 s (now refused at validate).
    spec = load_spec({**BASE, "bias": {"kind": "custom", "loss": nest("tanh", 4)}})
    with within(10.0):
        form = analyze(spec, derive_bias(spec.bias))
    assert form.form == "start" and "not affine in y" in form.reason


# A loss not bounded below ------------------------------------------------------------------


@pytest.mark.parametrize("loss", ["-e**2", "-abs(e)**3", "e**2 - e**4", "-cosh(e)"])
def test_a_loss_that_falls_ever_faster_is_refused(loss):
    # Before: -e**2 was accepted; derive printed "slope -2" and the rule was NaN by T = 600.
    message = refusal(loss)
    assert "bias.loss: the loss is not bounded below" in message


@pytest.mark.parametrize("loss", ["-e*v", "-y*v", "log(1 + e**2)", "1 - exp(-e**2)", "-e"])
def test_a_loss_that_does_not_run_away_is_allowed(loss):
    # The dot product's -y*v falls linearly; Cauchy and Welsch flatten out but never fall.
    load_spec({**BASE, "bias": {"kind": "custom", "loss": loss}})


# validate refuses what derive refuses ------------------------------------------------------


@pytest.mark.parametrize(
    ("retention", "field", "words"),
    [
        ({"kind": "bregman", "potential": "exp(w)"}, "retention.potential", "tends to 0"),
        ({"kind": "bregman", "potential": "w**4"}, "retention.potential", "solver: newton"),
        (
            {"kind": "bregman", "potential": nest("exp", 3, "w")},
            "retention.potential",
            "tends to 0",
        ),
        ({"kind": "f_divergence", "f": "(t-1)**2"}, "retention.f", "LambertW"),
    ],
)
def test_validate_refuses_a_retention_that_derive_refuses(retention, field, words):
    # Before: each was accepted by validate and refused by derive (the f-divergence with a
    # raw UnsupportedExpression from the torch printer).
    message = refusal(None, seconds=10.0, retention=retention)
    assert f"{field}: retention {retention['kind']}" in message and words in message


@pytest.mark.parametrize(
    "potential", ["exp(exp(exp(w**16)))", "w**2/2 + cosh(cosh(cosh(cosh(w))))"]
)
def test_a_potential_whose_curvature_overflows_is_refused_as_such(potential):
    # Before: sympy evaluated F'' at a Float sample on the spot; the first raised a raw
    # OverflowError ("too many digits in integer"), the second was called "undefined".
    message = refusal(None, seconds=5.0, retention={"kind": "bregman", "potential": potential})
    assert "retention.potential: retention bregman" in message
    assert "beyond float64 at w = " in message


def test_newton_accepts_what_closed_form_cannot_invert():
    load_spec({**BASE, "retention": {"kind": "bregman", "potential": "w**4", "solver": "newton"}})


# LaTeX output is ASCII ---------------------------------------------------------------------


def test_latex_output_is_ascii():
    text = latex_text("a \u00b1 b_c")
    assert text == r"\text{a U+00B1 b\_c}"
    assert latex_math(sp.Symbol("\u03b1") + 1) == r"\text{U+03B1} + 1"
