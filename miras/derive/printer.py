"""`TorchPrinter`: sympy expressions to torch source, strict.

Every construct the printer knows has a `_print_<Class>` method or an entry in `FUNCTIONS`;
anything else raises `UnsupportedExpression`, so no half-printed code is ever emitted.
Arguments of emitted functions are tensors that broadcast together; numbers are literals.
Every expression is first put in its stable forms (`miras.derive.stabilize`): asinh, log1p,
expm1, logaddexp, hypot where sympy wrote a cancelling or overflowing shape.
"""

from __future__ import annotations

import sympy as sp
from sympy.codegen.cfunctions import expm1, hypot, log1p
from sympy.codegen.numpy_nodes import logaddexp
from sympy.printing.printer import Printer

from miras.derive.stabilize import stable_forms
from miras.derive.symbols import ChannelSum, e, sigmoid, soft_threshold, softplus, v, y


class UnsupportedExpression(ValueError):
    """The printer has no translation for a sympy construct."""


class StrictPrinter(Printer):
    """What the torch and Triton printers share: the dispatch, arithmetic and comparisons.

    A subclass names its target (`target`), the literal for an empty numerator (`one`), its
    one-argument functions (`FUNCTIONS`) and how it prints numbers (`_number`).
    """

    target = ""
    one = "1"
    FUNCTIONS: dict[type, str] = {}

    def doprint(self, expr) -> str:  # type: ignore[override]
        return self._print(stable_forms(sp.sympify(expr)))

    def _print(self, expr, **kwargs) -> str:
        if isinstance(expr, sp.Expr) and expr.is_number and not isinstance(expr, sp.Symbol):
            return self._number(expr)
        if isinstance(expr, sp.Function) and type(expr) in self.FUNCTIONS:
            return f"{self.FUNCTIONS[type(expr)]}({self._print(expr.args[0])})"
        return super()._print(expr, **kwargs)

    def emptyPrinter(self, expr):
        raise UnsupportedExpression(
            f"the {self.target} printer does not support {type(expr).__name__}: {expr}"
        )

    def _number(self, expr: sp.Expr) -> str:
        raise NotImplementedError

    def _print_Symbol(self, expr: sp.Symbol) -> str:
        return expr.name

    # Arithmetic (composite printers parenthesize their own output) ---------------------------
    def _print_Add(self, expr: sp.Add) -> str:
        terms = list(sp.Add.make_args(expr))
        out = self._print(terms[0])
        for term in terms[1:]:
            coeff, _ = term.as_coeff_Mul()
            if coeff.is_negative:
                out += " - " + self._print(-term)
            else:
                out += " + " + self._print(term)
        return f"({out})"

    def _print_Mul(self, expr: sp.Mul) -> str:
        coeff, rest = expr.as_coeff_Mul()
        if coeff == -1:
            return f"(-{self._print(rest)})"
        numer, denom = [], []
        for factor in sp.Mul.make_args(expr):
            if factor.is_Pow and factor.exp.is_number and factor.exp.is_negative:
                denom.append(factor.base ** (-factor.exp))
            elif factor.is_Rational and factor.q != 1 and factor.p == 1:
                denom.append(sp.Integer(factor.q))
            else:
                numer.append(factor)
        text = "*".join(self._print(f) for f in numer) if numer else self.one
        for f in denom:
            text += "/" + self._print(f)
        return f"({text})"

    # Comparisons -----------------------------------------------------------------------------
    def _relational(self, expr, op: str) -> str:
        return f"({self._print(expr.lhs)} {op} {self._print(expr.rhs)})"

    def _print_StrictLessThan(self, expr) -> str:
        return self._relational(expr, "<")

    def _print_LessThan(self, expr) -> str:
        return self._relational(expr, "<=")

    def _print_StrictGreaterThan(self, expr) -> str:
        return self._relational(expr, ">")

    def _print_GreaterThan(self, expr) -> str:
        return self._relational(expr, ">=")


class TorchPrinter(StrictPrinter):
    printmethod = "_torchcode"
    target = "torch"

    # sympy function class -> torch function name, for one-argument functions.
    FUNCTIONS: dict[type, str] = {
        sp.exp: "torch.exp",
        sp.log: "torch.log",
        sp.Abs: "torch.abs",
        sp.sign: "torch.sign",
        sp.tanh: "torch.tanh",
        sp.cosh: "torch.cosh",
        sp.sinh: "torch.sinh",
        sp.asinh: "torch.asinh",
        sp.acosh: "torch.acosh",
        sp.atanh: "torch.atanh",
        log1p: "torch.log1p",
        expm1: "torch.expm1",
        sp.atan: "torch.atan",
        sp.sin: "torch.sin",
        sp.cos: "torch.cos",
        sp.erf: "torch.erf",
        sigmoid: "torch.sigmoid",
        softplus: "torch.nn.functional.softplus",
    }

    # Atoms ---------------------------------------------------------------------------------
    def _number(self, expr: sp.Expr) -> str:
        value = complex(expr.evalf(17))
        if value.imag != 0:
            raise UnsupportedExpression(f"complex constant {expr}")
        if expr.is_Integer:
            return str(int(expr))
        return repr(float(value.real))

    def _print_BooleanTrue(self, expr) -> str:
        return "True"

    # Powers (+ - * / and comparisons come from StrictPrinter) -------------------------------
    def _print_Pow(self, expr: sp.Pow) -> str:
        base, exp = expr.base, expr.exp
        if exp == sp.Rational(1, 2):
            return f"torch.sqrt({self._print(base)})"
        if exp == -sp.Rational(1, 2):
            return f"torch.rsqrt({self._print(base)})"
        if exp == -1:
            return f"(1/{self._print(base)})"
        if exp.is_number and exp.is_negative:
            return f"(1/{self._print(base)}**{self._print(-exp)})"
        return f"({self._print(base)}**{self._print(exp)})"

    # Comparisons and branches ----------------------------------------------------------------
    def _print_And(self, expr) -> str:
        args = [self._print(a) for a in expr.args]
        out = args[0]
        for a in args[1:]:
            out = f"torch.logical_and({out}, {a})"
        return out

    def _print_Or(self, expr) -> str:
        args = [self._print(a) for a in expr.args]
        out = args[0]
        for a in args[1:]:
            out = f"torch.logical_or({out}, {a})"
        return out

    def _print_Piecewise(self, expr: sp.Piecewise) -> str:
        *branches, (last_value, last_cond) = expr.args
        if last_cond is not sp.true:
            raise UnsupportedExpression(f"Piecewise without a default (True) branch: {expr}")
        out = self._print(last_value)
        for value, cond in reversed(branches):
            out = f"torch.where({self._print(cond)}, {self._print(value)}, {out})"
        return out

    def _minmax(self, expr, fn: str, clamp: str) -> str:
        numbers = [a for a in expr.args if a.is_number]
        tensors = [self._print(a) for a in expr.args if not a.is_number]
        out = tensors[0]
        for t in tensors[1:]:
            out = f"torch.{fn}({out}, {t})"
        for n in numbers:
            out = f"torch.clamp({out}, {clamp}={self._number(n)})"
        return out

    def _print_Min(self, expr) -> str:
        return self._minmax(expr, "minimum", "max")

    def _print_Max(self, expr) -> str:
        return self._minmax(expr, "maximum", "min")

    def _print_Heaviside(self, expr) -> str:
        z = self._print(expr.args[0])
        return f"({z} > 0).to({z}.dtype)"

    # Two-argument functions: torch takes tensors only, so a number becomes a 0-dim float64
    # tensor (it broadcasts on any device, keeps the other argument's dtype, and rounds to it
    # only there: a float32 0-dim tensor would round 0.001 for float64 inputs too).
    def _tensor_arg(self, expr: sp.Expr) -> str:
        if not expr.is_number:
            return self._print(expr)
        # _number evaluates it (sp.Float(sqrt(10)/10) raised TypeError: no mpf from an Expr);
        # float() keeps an integer a float literal, 1.0.
        return f"torch.tensor({float(self._number(expr))!r}, dtype=torch.float64)"

    def _print_hypot(self, expr: hypot) -> str:
        a, b = (self._tensor_arg(x) for x in expr.args)
        return f"torch.hypot({a}, {b})"

    def _print_logaddexp(self, expr: logaddexp) -> str:
        a, b = (self._tensor_arg(x) for x in expr.args)
        return f"torch.logaddexp({a}, {b})"

    # miras functions -----------------------------------------------------------------------
    def _print_soft_threshold(self, expr: soft_threshold) -> str:
        z, t = (self._print(a) for a in expr.args)
        return f"(torch.sign({z})*torch.clamp(torch.abs({z}) - {t}, min=0))"

    def _print_ChannelSum(self, expr: ChannelSum) -> str:
        term = expr.args[0]
        if not term.free_symbols & {e, y, v}:
            # A term without e, y, v (a gate per head, sum_j(a**2)) is broadcast over the value
            # channels first: its sum is Dv times it, not it.
            return f"(torch.zeros_like(e) + {self._print(term)}).sum(dim=-1, keepdim=True)"
        return f"{self._print(term)}.sum(dim=-1, keepdim=True)"


def torch_code(expr: sp.Expr) -> str:
    """The torch source of one expression."""
    return TorchPrinter().doprint(expr)
