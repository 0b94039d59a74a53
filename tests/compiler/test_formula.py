"""The safe formula parser: what it accepts, and that it refuses everything else by name."""

import builtins

import pytest
import sympy as sp

from miras.derive.formula import parse_formula
from miras.derive.symbols import ChannelSum, e, gate_symbol, sigmoid, softplus, v, y
from miras.errors import FormulaError

SYMBOLS = {"e": e, "y": y, "v": v, "a": gate_symbol("a")}
a = gate_symbol("a")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("e**2/2", e**2 / 2),
        ("log(cosh(e))", sp.log(sp.cosh(e))),
        ("a*log(cosh(e/a))", a * sp.log(sp.cosh(e / a))),
        ("abs(e)**3", sp.Abs(e) ** 3),
        ("-y*v", -y * v),
        ("sigmoid(e) + softplus(e)", sigmoid(e) + softplus(e)),
        ("sqrt(e**2 + 1) - 1", sp.sqrt(e**2 + 1) - 1),
        ("max(e, 0) + min(e, a)", sp.Max(e, 0) + sp.Min(e, a)),
        (
            "where(abs(e) <= a, e**2/2, a*abs(e))",
            sp.Piecewise((e**2 / 2, sp.Abs(e) <= a), (a * sp.Abs(e), True)),
        ),
        ("Piecewise((e, e > 0), (0, True))", sp.Piecewise((e, e > 0), (0, True))),
        ("sum(e**2)/2", ChannelSum(e**2) / 2),
        ("2*pi*e", 2 * sp.pi * e),
        ("1.5e-3*e", sp.Float(1.5e-3) * e),
    ],
    ids=lambda x: str(x) if isinstance(x, str) else None,
)
def test_parses(text, expected):
    assert sp.simplify(parse_formula(text, SYMBOLS, channel_sums=True) - expected) == 0


def test_norm_is_the_smoothed_l2_norm_over_channels():
    expr = parse_formula("norm(e)", SYMBOLS, channel_sums=True)
    assert expr.has(ChannelSum) and expr.func is sp.Pow and expr.exp == sp.Rational(1, 2)


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("__import__('os').system('true')", "attribute access"),
        ("__import__('os')", "'__import__' is not allowed"),
        ("__builtins__", "'__builtins__' is not allowed"),
        ("e.__class__", "attribute access"),
        ("(lambda: 1)()", "cannot be called"),
        ("lambda: e", "a lambda"),
        ("e**100000", "exponent 100000 is too large"),
        ("9**9**9", "too large"),
        ("open('x')", "'open' is not allowed"),
        ("exp(e", "syntax error"),
        ("x + 1", "unknown symbol 'x'"),
        ("ee + 1", "did you mean 'e'"),
        ("cosh(e, 2)", "takes 1 argument"),
        ("e[0]", "indexing"),
        ("[e for e in v]", "comprehension"),
        ("e if e > 0 else 0", "inline if"),
        ("e // 2", "operator //"),
        ("'text'", "only numbers"),
        ("1e300 * e", "too large"),
        ("sum(sum(e))", "cannot be nested"),
        ("exp", "is a function"),
        ("", "empty"),
        ("e " * 1500, "characters long"),
        ("tanhh(e)", "did you mean 'tanh'"),
        ("exp(x=e)", "keyword"),
        ("Piecewise((e, e > 0))", "condition True"),
        ("1 < e < 2", "chained comparisons"),
        ("e and v", "and/or"),
    ],
)
def test_refuses(text, words, monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("the parser must never evaluate Python")

    monkeypatch.setattr(builtins, "eval", forbidden)
    monkeypatch.setattr(builtins, "exec", forbidden)
    with pytest.raises(FormulaError, match=None) as info:
        parse_formula(text, SYMBOLS, channel_sums=True)
    assert words in str(info.value)


def test_channel_sums_only_where_enabled():
    with pytest.raises(FormulaError, match="only allowed in an attentional-bias loss"):
        parse_formula("sum(e)", SYMBOLS)
