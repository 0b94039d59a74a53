"""Stable forms: rewrite the cancelling and overflowing shapes sympy writes into the functions
that compute them accurately, before an expression is printed.

    log(z + sqrt(z**2 + 1))      -> asinh(z)          (cancels for z << 0: NaN at z = -1e4)
    log(z + sqrt(z**2 - 1))      -> acosh(z)
    log((c + z)/(c - z))         -> 2 atanh(z/c)
    log(1 + exp(a))              -> softplus(a)        (overflows for a > 88 in float32)
    log(exp(a) + exp(b))         -> logaddexp(a, b)
    log(1 + x)                   -> log1p(x)           (loses x below eps)
    c exp(a) - c                 -> c expm1(a)
    sqrt(k z**2 + c)             -> hypot(sqrt(k) z, sqrt(c))   (z**2 overflows at 1.8e19)
    log(cosh(z))                 -> |z| + softplus(-2|z|) - log(2)   (cosh overflows at 89)

Every rewrite is an identity on the reals where the original is defined (asinh, softplus, ...
are the same functions), so the derivation's value is unchanged; only its rounding improves.
The pass runs top-down (a whole `log(z + sqrt(z**2 + 1))` is seen before its square root) and
again on a node whose arguments it rewrote.
"""

from __future__ import annotations

from collections.abc import Callable

import sympy as sp
from sympy.codegen.cfunctions import expm1, hypot, log1p
from sympy.codegen.numpy_nodes import logaddexp

from miras.derive.symbols import softplus

HALF = sp.Rational(1, 2)


def _log_of_sum(arg: sp.Expr) -> sp.Expr | None:
    """log(arg) for an Add `arg`: asinh / acosh, softplus, logaddexp, log1p."""
    terms = sp.Add.make_args(arg)
    for t in terms:  # z + sqrt(z**2 +- 1)
        if t.is_Pow and t.exp == HALF:
            z = arg - t
            rest = _square_offset(t.base, z)
            if rest == 1:
                return sp.asinh(z)
            if rest == -1:
                return sp.acosh(z)
    exps = []
    for t in terms:
        k, f = t.as_coeff_Mul()
        if isinstance(f, sp.exp) and k.is_positive:
            exps.append(f.args[0] + (sp.log(k) if k != 1 else 0))
    if len(terms) == 2 and len(exps) == 2:
        return logaddexp(*exps)
    number, rest = arg.as_coeff_Add()
    if number == 1:
        if isinstance(rest, sp.exp):
            return softplus(rest.args[0])
        return log1p(rest)
    return None


# Expanding is the fallback test of base = z**2 + c: only for small expressions (a large
# solution would take long to expand, and sympy writes the square unexpanded anyway).
EXPAND_LIMIT = 60


def _square_offset(base: sp.Expr, z: sp.Expr) -> sp.Expr | None:
    """c when base is z**2 + c for a number c, else None: structurally ((+-z)**2 + c), or by
    expanding base - z**2 when both are small."""
    c, square = base.as_coeff_Add()
    if square.is_Pow and square.exp == 2 and (square.base == z or square.base == -z):
        return c
    if sp.count_ops(base) + sp.count_ops(z) > EXPAND_LIMIT:
        return None
    rest = sp.expand(base - z**2)
    return rest if rest.is_number else None


def _log_of_ratio(arg: sp.Expr) -> sp.Expr | None:
    """log((c + z)/(c - z)) -> 2 atanh(z/c): the ratio of 1 + x and 1 - x, which lose x's
    low bits; a ratio such as w/(1 - w) keeps them and is left alone."""
    if sp.count_ops(arg) > EXPAND_LIMIT:
        return None
    numer, denom = arg.as_numer_denom()
    c, z = numer.as_coeff_Add()
    c2, z2 = denom.as_coeff_Add()
    if c != 0 and c == c2 and z != 0 and sp.expand(z + z2) == 0:
        return 2 * sp.atanh(z / c)
    return None


def _log(node: sp.Basic) -> sp.Expr | None:
    if not isinstance(node, sp.log):
        return None
    (arg,) = node.args
    if isinstance(arg, sp.cosh):
        a = sp.Abs(arg.args[0])
        return a + softplus(-2 * a) - sp.log(2)
    if arg.is_Add:
        return _log_of_sum(arg)
    if arg.is_Mul or arg.is_Pow:
        return _log_of_ratio(arg)
    return None


def _exp_minus_constant(node: sp.Basic) -> sp.Expr | None:
    """c exp(a) - c + rest -> c expm1(a) + rest."""
    if not node.is_Add:
        return None
    number, rest = node.as_coeff_Add()
    if number == 0:
        return None
    for t in sp.Add.make_args(rest):
        k, f = t.as_coeff_Mul()
        if isinstance(f, sp.exp) and k == -number:
            return rest - t + k * expm1(f.args[0])
    return None


def _root_of_square_plus_constant(node: sp.Basic) -> sp.Expr | None:
    """sqrt(k z**2 + c) (k, c > 0) -> hypot(sqrt(k) z, sqrt(c)); the power -1/2 likewise."""
    if not (node.is_Pow and node.exp in (HALF, -HALF) and node.base.is_Add):
        return None
    c, rest = node.base.as_coeff_Add()
    k, square = rest.as_coeff_Mul()
    if not (c.is_positive and k.is_positive and square.is_Pow and square.exp == 2):
        return None
    root = hypot(sp.sqrt(k) * square.base, sp.sqrt(c))
    return root if node.exp == HALF else 1 / root


RULES: tuple[Callable[[sp.Basic], sp.Expr | None], ...] = (
    _log,
    _exp_minus_constant,
    _root_of_square_plus_constant,
)


def _rewrite(node: sp.Basic) -> sp.Basic | None:
    for rule in RULES:
        new = rule(node)
        if new is not None:
            return new
    return None


def _visit(node: sp.Basic) -> sp.Basic:
    if not node.args or isinstance(node, sp.Symbol | sp.Number):
        return node
    new = _rewrite(node)
    if new is not None:
        return _visit_args(new)
    rebuilt = _visit_args(node)
    if rebuilt != node:
        new = _rewrite(rebuilt)
        if new is not None:
            return _visit_args(new)
    return rebuilt


def _visit_args(node: sp.Basic) -> sp.Basic:
    if not node.args or isinstance(node, sp.Symbol | sp.Number):
        return node
    args = [_visit(a) for a in node.args]
    return node.func(*args) if args != list(node.args) else node


def stable_forms(expr: sp.Basic) -> sp.Basic:
    """`expr` with every cancelling or overflowing shape above replaced by its stable form."""
    return _visit(sp.sympify(expr))


def elementary(expr: sp.Basic) -> sp.Basic:
    """The inverse rewrite: log1p, expm1, logaddexp, hypot and softplus written out with log,
    exp and sqrt again (for comparing a stable form with sympy's own)."""
    out = sp.sympify(expr)
    for func, plain in (
        (log1p, lambda x: sp.log(1 + x)),
        (expm1, lambda x: sp.exp(x) - 1),
        (logaddexp, lambda a, b: sp.log(sp.exp(a) + sp.exp(b))),
        (hypot, lambda a, b: sp.sqrt(a**2 + b**2)),
        (softplus, lambda x: sp.log(1 + sp.exp(x))),
    ):
        out = out.replace(func, plain)
    return out
