"""`TritonPrinter`: sympy expressions to Triton source, strict.

The Triton sibling of `TorchPrinter` (miras/derive/printer.py): every construct it knows has a
`_print_<Class>` method or an entry in `FUNCTIONS`; anything else raises `UnsupportedExpression`,
so no half-printed kernel is ever emitted. The printed code runs inside a `@triton.jit`
function on blocks that broadcast together; numbers are literals.

Functions `triton.language` lacks (tanh, cosh, sign, softplus, log1p, hypot, ...) come from
`miras.kernels.common.math`, written with `tl.exp`/`tl.log` so that they run on a GPU and under
`TRITON_INTERPRET=1` alike. Channel sums reduce the last axis of a block with the channel mask
`cmask` (a padded channel must not enter a sum): `tl.sum(tl.where(cmask, f, 0.0), axis=1, ...)`.
"""

from __future__ import annotations

import sympy as sp
from sympy.codegen.cfunctions import expm1, hypot, log1p
from sympy.codegen.numpy_nodes import logaddexp

from miras.derive.printer import StrictPrinter, UnsupportedExpression
from miras.derive.symbols import ChannelSum, sigmoid, soft_threshold, softplus

# The name of the channel mask a printed channel sum reads (a [1, BV] or [BT, BV] block).
CHANNEL_MASK = "cmask"

# Integer powers up to this are printed as products (exact, and cheaper than exp/log); a higher
# integer power raises (exp(n log x) would be NaN for a negative x).
MAX_PRODUCT_POWER = 16


class TritonPrinter(StrictPrinter):
    printmethod = "_tritoncode"
    target = "Triton"
    one = "1.0"

    # sympy function class -> Triton function name, for one-argument functions.
    FUNCTIONS: dict[type, str] = {
        sp.exp: "tl.exp",
        sp.log: "tl.log",
        sp.Abs: "tl.abs",
        sp.sin: "tl.sin",
        sp.cos: "tl.cos",
        sp.erf: "tl.erf",
        sigmoid: "tl.sigmoid",
        sp.sign: "sign",  # miras.kernels.common.math from here on
        sp.tanh: "tanh",
        sp.cosh: "cosh",
        sp.sinh: "sinh",
        sp.asinh: "asinh",
        sp.acosh: "acosh",
        sp.atanh: "atanh",
        log1p: "log1p",
        expm1: "expm1",
        softplus: "softplus",
    }

    # Atoms ---------------------------------------------------------------------------------
    def _number(self, expr: sp.Expr) -> str:
        value = complex(expr.evalf(17))
        if value.imag != 0:
            raise UnsupportedExpression(f"complex constant {expr}")
        # Always a float literal: an integer literal would make integer arithmetic in Triton.
        return repr(float(value.real))

    # Arithmetic: + - * / from StrictPrinter ---------------------------------------------------
    def _print_Pow(self, expr: sp.Pow) -> str:
        base, exp = expr.base, expr.exp
        if exp == sp.Rational(1, 2):
            return f"tl.sqrt({self._print(base)})"
        if exp == -sp.Rational(1, 2):
            return f"tl.rsqrt({self._print(base)})"
        if exp.is_number and exp.is_negative:
            return f"(1.0/{self._print(base ** (-exp))})"
        if exp.is_Integer:
            if exp > MAX_PRODUCT_POWER:
                raise UnsupportedExpression(f"integer power above {MAX_PRODUCT_POWER}: {expr}")
            b = self._print(base)
            return "(" + "*".join([b] * int(exp)) + ")"
        # Any other power, as exp(p log x): defined for x > 0, as torch's x**p for non-integer p.
        return f"tl.exp({self._print(exp)}*tl.log({self._print(base)}))"

    # Comparisons and branches ----------------------------------------------------------------
    def _print_And(self, expr) -> str:
        return "(" + " & ".join(self._print(a) for a in expr.args) + ")"

    def _print_Or(self, expr) -> str:
        return "(" + " | ".join(self._print(a) for a in expr.args) + ")"

    def _print_Piecewise(self, expr: sp.Piecewise) -> str:
        *branches, (last_value, last_cond) = expr.args
        if last_cond is not sp.true:
            raise UnsupportedExpression(f"Piecewise without a default (True) branch: {expr}")
        out = self._print(last_value)
        for value, cond in reversed(branches):
            out = f"tl.where({self._print(cond)}, {self._print(value)}, {out})"
        return out

    def _minmax(self, expr, fn: str) -> str:
        args = [self._print(a) for a in expr.args]
        out = args[0]
        for a in args[1:]:
            out = f"{fn}({out}, {a})"
        return out

    def _print_Min(self, expr) -> str:
        return self._minmax(expr, "tl.minimum")

    def _print_Max(self, expr) -> str:
        return self._minmax(expr, "tl.maximum")

    def _print_Heaviside(self, expr) -> str:
        return f"tl.where({self._print(expr.args[0])} > 0, 1.0, 0.0)"

    def _print_hypot(self, expr: hypot) -> str:
        a, b = (self._print(x) for x in expr.args)
        return f"hypot({a}, {b})"

    def _print_logaddexp(self, expr: logaddexp) -> str:
        a, b = (self._print(x) for x in expr.args)
        return f"logaddexp({a}, {b})"

    # miras functions -----------------------------------------------------------------------
    def _print_soft_threshold(self, expr: soft_threshold) -> str:
        z, t = (self._print(a) for a in expr.args)
        return f"soft_threshold({z}, {t})"

    def _print_ChannelSum(self, expr: ChannelSum) -> str:
        body = self._print(expr.args[0])
        return f"tl.sum(tl.where({CHANNEL_MASK}, {body}, 0.0), axis=1, keep_dims=True)"


def triton_code(expr: sp.Expr) -> str:
    """The Triton source of one expression."""
    return TritonPrinter().doprint(expr)
