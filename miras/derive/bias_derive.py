"""Bias pass, derivation: the attentional bias gradient dL/dy by the chain rule.

A bias is `L = G(S_1, ..., S_m)` where each `S_i = sum_j f_i(e_j, y_j, v_j)` is a channel sum
(`ChannelSum`). By the chain rule, per channel j,

    dL/dy_j = sum_i dG/dS_i * df_i/dy (e_j, y_j, v_j),     e = y - v.

When every dG/dS_i is a constant (the usual `L = sum_j f(e_j)`), the gradient is elementwise;
otherwise (a norm term, as in the robust bias) it needs the channel sums S_i first, which the
emitted code computes once per vector. For a memory M_W the gradient in W follows by the chain
rule through M (for a matrix, dL/dW = dL/dy phi(k)^T), assembled by the runtime.

The result is a `miras.ir.BiasRule`, with the torch source of `bias_loss` and `bias_grad`
(written by `miras.derive.bias_emit`); `miras.derive.bias_check` tests it against autograd.
"""

from __future__ import annotations

import sympy as sp

from miras.derive.bias_emit import bias_source
from miras.derive.describe import Line, Math, Name, latex_lines, plain_lines
from miras.derive.formula import bounded_simplify
from miras.derive.memo import Memo, component_key
from miras.derive.printer import UnsupportedExpression
from miras.derive.protocols import BiasParts
from miras.derive.symbols import ChannelSum, channel_gradient, e, gate_symbol, v, y
from miras.errors import DerivationError
from miras.ir import BiasRule


def bias_lines(loss: sp.Expr, sums, gradient: sp.Expr, elementwise: bool) -> list[Line]:
    """L, e, the channel sums the gradient reads, and dL/dy_j, as display lines."""
    lines = [
        Line(Name("L(y, v)", r"\mathcal{L}(y, v)"), Math(loss)),
        Line(Math(e), Name("y - v")),
    ]
    lines += [Line(Math(s), Math(ChannelSum(f))) for s, f in sums]
    form = "elementwise" if elementwise else "needs channel sums"
    name = Name("dL/dy_j", r"\frac{\partial \mathcal{L}}{\partial y_j}")
    lines.append(Line(name, Math(gradient), f"[{form}]"))
    return lines


def _sign_to_abs(expr: sp.Expr) -> sp.Expr:
    """s**n * sign(s) -> s**(n - 1) * |s| for a positive integer n (s * sign(s) = |s|), which
    sympy does not do by itself: the l_p gradient e**2*sign(e) + 2*e*|e| becomes 3*e*|e|. Both
    sides are the same function everywhere, e = 0 included, so nothing is divided."""

    def rewrite(term: sp.Mul) -> sp.Expr:
        factors = list(term.args)
        for sign in [f for f in factors if isinstance(f, sp.sign)]:
            s = sign.args[0]
            for i, f in enumerate(factors):
                base, n = f.as_base_exp()
                if base == s and n.is_integer and n.is_positive:
                    factors[i] = s ** (n - 1) * sp.Abs(s)
                    factors.remove(sign)
                    break
        return sp.Mul(*factors)

    return expr.replace(lambda t: isinstance(t, sp.Mul) and t.has(sp.sign), rewrite)


def _tidy(expr: sp.Expr) -> sp.Expr:
    """The shortest of a few rewritings, refusing any that adds special cases (simplify likes
    to turn e**2*sign(e) into a Piecewise around e = 0)."""
    best = expr
    expanded = sp.expand_mul(expr)
    simplified = bounded_simplify(expr)  # None for a large gradient: kept as derived
    for candidate in (expanded, _sign_to_abs(expanded), simplified):
        if candidate is None:
            continue
        added_cases = candidate.has(sp.Piecewise) and not expr.has(sp.Piecewise)
        if not added_cases and sp.count_ops(candidate) < sp.count_ops(best):
            best = candidate
    return best


# Bias (class, fields) -> its derived rule: validation (a formula's slope), the passes and
# every spec with an equal bias share one derivation (miras.derive.memo).
BIASES: Memo[BiasRule] = Memo("bias")


def derive_bias(bias: BiasParts) -> BiasRule:
    """dL/dy of `bias` by the chain rule through its channel sums; derived once per bias
    (its class and fields), then read from `BIASES`."""
    return BIASES.get(component_key(bias), lambda: _derive(bias))


def _derive(bias: BiasParts) -> BiasRule:
    loss = bias.expression()
    sums, outer, gradient = channel_gradient(loss)
    if not sums:
        raise DerivationError(f"bias {bias.kind}: the loss has no channel sum: {loss}")
    stray = outer.free_symbols & {e, y, v}
    if stray:
        raise DerivationError(f"bias {bias.kind}: {sorted(map(str, stray))} outside a channel sum")
    gradient = _tidy(gradient)
    # The sums the gradient reads, and those their terms read (channel statistics).
    needed = gradient.free_symbols
    for s, f in reversed(sums):
        if s in needed:
            needed = needed | f.free_symbols
    used = tuple((s, f) for s, f in sums if s in needed)
    gates = tuple(bias.gates())
    lines = bias_lines(loss, used, gradient, not used)
    try:
        source = bias_source(loss, used, gradient, gates, bias.fixed())
    except UnsupportedExpression as err:
        raise DerivationError(
            f"bias {bias.kind}: the loss or dL/dy has no torch form ({err})"
        ) from None
    # The gates that may come per channel: every gate of an elementwise gradient (it reads no
    # sum, so a gate meets channel j's term wherever it stands); otherwise those G does not
    # read outside the sums.
    outside = outer.free_symbols if used else set()
    return BiasRule(
        kind=bias.kind,
        loss=loss,
        sums=used,
        gradient=gradient,
        elementwise=not used,
        gates=gates,
        source=source,
        display="\n".join(plain_lines(lines)),
        display_latex=latex_lines(lines),
        channel_gates=tuple(g for g in gates if gate_symbol(g) not in outside),
    )
