"""A safe parser from formula text (a spec field) to a sympy expression.

The text is parsed by Python's `ast` module into a syntax tree, which is then walked node by
node against a whitelist: numbers, the symbols the component declares, arithmetic, comparisons
(inside `where`/`Piecewise`) and the functions in `FUNCTIONS`. Nothing is ever evaluated as
Python: no `eval`, no `sympify` of the text, no attribute access, no names outside the list.

Every term must be a real, finite number-valued expression: a comparison is only a condition
(of `where`/`Piecewise`), and a term that sympy reduces to an infinity, NaN or an imaginary
number (`e/0`, `log(0)`, `sqrt(-1)`) is refused where it appears, with that term quoted.
"""

from __future__ import annotations

import ast
import math
import unicodedata
from collections.abc import Mapping

import sympy as sp
from sympy.logic.boolalg import Boolean

from miras.derive.symbols import ChannelSum, sigmoid, softplus
from miras.errors import FormulaError, did_you_mean

# Limits, checked on the syntax tree before sympy builds anything: they bound the work that
# sympy (differentiation, simplification, numeric evaluation) does on a formula. docs/spec.md
# lists them; each refusal names the one that was passed.
MAX_LENGTH = 2000  # characters of formula text
MAX_NODES = 400  # syntax-tree nodes
MAX_DEPTH = 40  # nesting of the syntax tree (operators and calls)
MAX_CALL_DEPTH = 4  # functions nested in functions: exp(exp(exp(exp(e)))) is 4
MAX_EXPONENT = 16  # |n| in x**n, so no formula asks sympy to expand an absurd power
MAX_DEGREE = 32  # total degree as a polynomial, a call counting as one variable
MAX_LITERAL = 1e12  # |number| allowed as a literal
# sympy.simplify's cost grows fast and unpredictably with the expression: the compiler only
# simplifies an expression derived from a formula of at most this many operations (count_ops),
# and otherwise keeps it as derived (tanh(tanh(tanh(tanh(e)))): simplify took 90 s).
MAX_SIMPLIFY_OPS = 60
FLOAT64_MAX = 1.7976931348623157e308  # a value beyond it overflows in every backend
NORM_EPS = sp.Rational(1, 10**12)  # norm(e) = sqrt(sum_j e_j^2 + eps): smooth at e = 0


def _unary(fn):
    return lambda args: fn(*args)


FUNCTIONS: dict[str, tuple[int, object]] = {
    # name: (number of arguments, builder from sympy arguments); -1 means two or more.
    "exp": (1, _unary(sp.exp)),
    "log": (1, _unary(sp.log)),
    "log1p": (1, lambda a: sp.log(1 + a[0])),
    "sqrt": (1, _unary(sp.sqrt)),
    "abs": (1, _unary(sp.Abs)),
    "sign": (1, _unary(sp.sign)),
    "tanh": (1, _unary(sp.tanh)),
    "cosh": (1, _unary(sp.cosh)),
    "sinh": (1, _unary(sp.sinh)),
    "asinh": (1, _unary(sp.asinh)),
    "atan": (1, _unary(sp.atan)),
    "sin": (1, _unary(sp.sin)),
    "cos": (1, _unary(sp.cos)),
    "erf": (1, _unary(sp.erf)),
    "sigmoid": (1, _unary(sigmoid)),
    "softplus": (1, _unary(softplus)),
    "min": (-1, lambda a: sp.Min(*a)),
    "max": (-1, lambda a: sp.Max(*a)),
    "where": (3, lambda a: sp.Piecewise((a[1], a[0]), (a[2], True))),
}
# Constructs handled by the walker itself rather than by a builder.
SPECIAL_FUNCTIONS = ("Piecewise", "sum", "norm")
CONSTANTS = {"pi": sp.pi}

_BINARY = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
}
_COMPARE = {
    ast.Lt: sp.StrictLessThan,
    ast.LtE: sp.LessThan,
    ast.Gt: sp.StrictGreaterThan,
    ast.GtE: sp.GreaterThan,
}


def allowed_functions(channel_sums: bool = False) -> list[str]:
    names = [*FUNCTIONS, "Piecewise"]
    return [*names, "sum", "norm"] if channel_sums else names


def parse_formula(
    text: str,
    symbols: Mapping[str, sp.Symbol],
    *,
    channel_sums: bool = False,
) -> sp.Expr:
    """Parse `text` into a sympy expression over `symbols` (name -> sympy symbol).

    `channel_sums` enables `sum(f)` (a sum over the value channels) and `norm(f)` (the smoothed
    l2 norm over the channels); the attentional bias uses them. Raises `FormulaError` with a
    message that says what is wrong and what is allowed.
    """
    if not isinstance(text, str):
        raise FormulaError(f"expected formula text, got {type(text).__name__}")
    if not text.strip():
        raise FormulaError("the formula is empty")
    if len(text) > MAX_LENGTH:
        raise FormulaError(f"the formula is {len(text)} characters long; at most {MAX_LENGTH}")
    _check_ascii(text)
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError as err:
        col = f" at column {err.offset}" if err.offset else ""
        raise FormulaError(f"syntax error{col}: {err.msg}") from None
    n_nodes = sum(1 for _ in ast.walk(tree))
    if n_nodes > MAX_NODES:
        raise FormulaError(f"the formula has {n_nodes} syntax nodes; at most {MAX_NODES}")
    _check_shape(tree.body, text.strip())
    return _Walker(symbols, channel_sums, text.strip()).value(tree.body)


def _check_ascii(text: str) -> None:
    """Refuse any character outside ASCII, naming it: Python reads identifiers in NFKC form,
    so a ligature 'ﬁ' would be reported as 'fi' and a fullwidth 'ｅ' silently read as e."""
    for column, ch in enumerate(text, start=1):
        if ord(ch) > 127:
            name = unicodedata.name(ch, "unnamed")
            raise FormulaError(
                f"the character {ch!r} (U+{ord(ch):04X} {name}) at column {column} is not "
                "ASCII; formulas are written in ASCII letters, digits and + - * / ** ( ) , . "
                "< <= > >="
            )


def _short(text: str, keep: int = 24) -> str:
    """A long literal shortened for a message: its first digits and its length."""
    return text if len(text) <= 2 * keep else f"{text[:keep]}... ({len(text)} characters)"


_SELECTIONS = ("min", "max", "where", "Piecewise", "sum")  # their value is one of their terms


def _check_shape(root: ast.AST, text: str) -> None:
    """Refuse a formula nested deeper than MAX_DEPTH, with functions nested deeper than
    MAX_CALL_DEPTH, or of total degree above MAX_DEGREE, all measured on the syntax tree before
    sympy sees it. The degree is that of the formula as a polynomial in its symbols and its
    calls (each call one more variable): x**n multiplies it by |n|, a product adds, a quotient
    adds numerator and denominator (sympy may bring it over one denominator), so
    ((e**2 + 1)**16)**16 has degree 512 though each exponent is 16."""

    def quote(node: ast.AST) -> str:
        return _short(repr(ast.get_source_segment(text, node) or ast.unparse(node)), 40)

    def number(node: ast.AST) -> float | None:
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            return number(node.operand)
        value = node.value if isinstance(node, ast.Constant) else None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value) if abs(value) <= MAX_LITERAL else None  # the walker refuses it
        return None

    def measure(node: ast.AST, depth: int, calls: int) -> float:  # -> the degree
        if depth > MAX_DEPTH:
            raise FormulaError(
                f"the formula nests operators and calls more than {MAX_DEPTH} levels deep "
                f"(at {quote(node)}); at most {MAX_DEPTH}"
            )
        parts = [part for part in ast.iter_child_nodes(node) if isinstance(part, ast.expr)]
        if isinstance(node, ast.Call):
            calls += 1
            if calls > MAX_CALL_DEPTH:
                raise FormulaError(
                    f"functions are nested {calls} deep at {quote(node)}; at most "
                    f"{MAX_CALL_DEPTH} (exp(exp(exp(exp(e)))) is 4 deep)"
                )
            parts = list(node.args)
        degrees = [measure(part, depth + 1, calls) for part in parts]
        if isinstance(node, ast.Name):
            return 0.0 if node.id in CONSTANTS else 1.0
        if isinstance(node, ast.Constant):
            return 0.0
        if isinstance(node, ast.Call):
            name = node.func.id if isinstance(node.func, ast.Name) else ""
            if name in _SELECTIONS:
                return max(degrees, default=0.0)
            return 1.0 if any(degrees) else 0.0
        if isinstance(node, ast.BinOp):
            base, exponent = degrees
            if isinstance(node.op, ast.Pow):
                n = number(node.right)
                if n is not None and abs(n) > MAX_EXPONENT:
                    shown = ast.get_source_segment(text, node.right) or ast.unparse(node.right)
                    raise FormulaError(
                        f"the exponent {_short(shown)} is too large (at most {MAX_EXPONENT} in "
                        "absolute value)"
                    )
                degree = base * math.ceil(abs(n)) if n is not None else base + exponent
            elif isinstance(node.op, (ast.Mult, ast.Div)):
                degree = base + exponent
            else:
                degree = max(base, exponent)
            if degree > MAX_DEGREE:
                raise FormulaError(
                    f"{quote(node)} has total degree {degree:g} (powers of powers multiply, "
                    f"products add); at most {MAX_DEGREE}"
                )
            return degree
        return max(degrees, default=0.0)

    measure(root, 1, 0)


def bounded_simplify(expr: sp.Expr) -> sp.Expr | None:
    """sympy.simplify(expr), or None when expr has more than MAX_SIMPLIFY_OPS operations."""
    if sp.count_ops(expr) > MAX_SIMPLIFY_OPS:
        return None
    return sp.simplify(expr)


def value_at(expr: sp.Expr, point: Mapping[sp.Symbol, sp.Expr]) -> sp.Expr:
    """`expr` at `point`, evaluated to a sympy number as far as sympy can (sigmoid and softplus
    written with exp, which sympy evaluates)."""
    # Simultaneous: e/sqrt(s) at e = s = 0 is 0*zoo = nan, as in floating point, whichever
    # symbol sympy would otherwise substitute first (e first would cancel it to 0). xreplace
    # replaces every symbol in one structural pass; subs(simultaneous=True) gives the same
    # value but searches for sub-expressions too, through sympy's assumption queries (about
    # 70 ms a point for log(cosh(e/a)), most of the time `miras validate` took).
    try:
        value = expr.xreplace({symbol: sp.sympify(at) for symbol, at in point.items()})
    except TypeError:  # a comparison with zoo (log(0) < y) has no truth value: undefined
        return sp.nan
    try:
        return _evaluate(value, {})
    except _Overflow:
        return OVERFLOW


# value_at's value when a term at the point leaves the float64 range (|x| > FLOAT64_MAX).
OVERFLOW = sp.Symbol("overflow")
TOO_LARGE = f"too large (a term overflows the float64 range, |x| > {FLOAT64_MAX:.3g})"


class _Overflow(Exception):
    pass


def _evaluate(node: sp.Basic, memo: dict) -> sp.Basic:
    """`node` evaluated from its leaves up: each term is a number before the term above it is
    evaluated, so a term beyond FLOAT64_MAX stops the evaluation (exp(exp(exp(exp(exp(2)))))
    would otherwise ask mpmath for a number with a 10**1600-bit exponent: an OverflowError, or
    no answer at all). Exact numbers stay exact (0 stays 0: 0/0 is nan, as in floating point);
    sigmoid and softplus are written with exp, which sympy evaluates, one term at a time."""
    if node in memo:
        return memo[node]
    result = node
    if node.args:
        args = [_evaluate(arg, memo) for arg in node.args]
        try:
            result = node.func(*args)
        except TypeError:  # a comparison with zoo or an imaginary value has no truth value
            result = sp.nan
        if isinstance(result, sp.Expr) and result.is_number and not result.is_Rational:
            if result.has(sigmoid, softplus):
                result = result.rewrite(sp.exp)
            try:
                result = sp.N(result)
            except OverflowError:
                raise _Overflow from None
    if isinstance(result, sp.Number) and result.is_finite and abs(result) > FLOAT64_MAX:
        raise _Overflow
    memo[node] = result
    return result


def not_finite(value: sp.Expr) -> str | None:
    """Why a value from `value_at` is not a finite real number ('undefined (NaN)', 'infinite',
    'not real', TOO_LARGE), or None: finite and real, or not a number sympy could evaluate."""
    if value == OVERFLOW:
        return TOO_LARGE
    if value.has(sp.nan):
        return "undefined (NaN)"
    if value.has(sp.zoo, sp.oo, sp.S.NegativeInfinity):
        return "infinite"
    if value.has(sp.I) or (value.is_number and value.is_real is False):
        return "not real"
    return None


# What sympy makes of a term that is not a real number, and why a user wrote one.
_NOT_FINITE = (
    (sp.nan, "undefined (NaN), e.g. 0/0 or 0*oo"),
    (sp.zoo, "infinite (sympy: zoo), e.g. a division by zero, log(0) or 0**-1"),
    (sp.oo, "infinite (sympy: oo)"),
    (sp.S.NegativeInfinity, "infinite (sympy: -oo)"),
    (sp.I, "not real (sympy: I), e.g. sqrt or log of a negative number"),
)


class _Walker:
    def __init__(self, symbols: Mapping[str, sp.Symbol], channel_sums: bool, text: str):
        self.symbols = dict(symbols)
        self.channel_sums = channel_sums
        self.text = text
        self.example = next(iter(self.symbols), "x")  # a symbol to write examples with
        self.inside_sum = False

    def visit(self, node: ast.AST) -> sp.Basic:
        method = getattr(self, "visit_" + type(node).__name__, None)
        if method is None:
            raise FormulaError(f"{_describe(node)} is not allowed in a formula")
        return method(node)

    def quote(self, node: ast.AST) -> str:
        return repr(ast.get_source_segment(self.text, node) or ast.unparse(node))

    def value(self, node: ast.AST) -> sp.Expr:
        """A term that must be a real, finite number (not a condition, not zoo/nan/I)."""
        result = self.visit(node)
        if not isinstance(result, sp.Expr):
            raise FormulaError(
                f"{self.quote(node)} is a condition (true or false), not a number; a comparison "
                "is only allowed as the condition of where(condition, a, b) or of a Piecewise "
                f"pair, e.g. where({self.example} > 0, {self.example}**2, 0)"
            )
        for atom, why in _NOT_FINITE:
            if result.has(atom):
                raise FormulaError(
                    f"{self.quote(node)} is {why}; every term must be finite and real"
                )
        return result

    def condition(self, node: ast.AST) -> sp.Basic:
        """The condition of where/Piecewise: a comparison (or True), never a number."""
        result = self.visit(node)
        if not isinstance(result, Boolean) or isinstance(result, sp.Expr):  # a Symbol is both
            raise FormulaError(
                f"the condition {self.quote(node)} is not a comparison; write one with "
                f"<, <=, > or >=, e.g. {self.example} > 0"
            )
        return result

    def visit_Constant(self, node: ast.Constant) -> sp.Basic:
        value = node.value
        if value is True:
            return sp.true  # the default condition of a Piecewise
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise FormulaError(f"only numbers are allowed as constants, got {value!r}")
        if abs(value) > MAX_LITERAL:
            raise FormulaError(
                f"the number {_short(repr(value))} is too large (at most {MAX_LITERAL:g})"
            )
        return sp.Integer(value) if isinstance(value, int) else sp.Float(value)

    def visit_Name(self, node: ast.Name) -> sp.Basic:
        name = node.id
        if name.startswith("__"):
            raise FormulaError(f"the name '{name}' is not allowed")
        if name in self.symbols:
            return self.symbols[name]
        if name in CONSTANTS:
            return CONSTANTS[name]
        allowed = sorted(self.symbols) + sorted(CONSTANTS)
        if name in FUNCTIONS or name in SPECIAL_FUNCTIONS:
            raise FormulaError(f"'{name}' is a function: call it as {name}(...)")
        raise FormulaError(
            f"unknown symbol '{name}'; allowed symbols: {', '.join(allowed)}{did_you_mean(name, allowed)}"
        )

    def visit_UnaryOp(self, node: ast.UnaryOp) -> sp.Basic:
        operand = self.value(node.operand)
        if isinstance(node.op, ast.USub):
            return -operand
        if isinstance(node.op, ast.UAdd):
            return operand
        raise FormulaError(f"the operator {type(node.op).__name__} is not allowed")

    def visit_BinOp(self, node: ast.BinOp) -> sp.Basic:
        if isinstance(node.op, ast.Pow):
            return self._power(node)
        if type(node.op) not in _BINARY:
            raise FormulaError(
                f"the operator {_OPERATOR_NAMES.get(type(node.op), type(node.op).__name__)} "
                "is not allowed; use + - * / **"
            )
        left, right = self.value(node.left), self.value(node.right)
        if isinstance(node.op, ast.Div) and right.is_zero:
            raise FormulaError(f"{self.quote(node)} divides by zero")
        return _BINARY[type(node.op)](left, right)

    def _power(self, node: ast.BinOp) -> sp.Basic:
        base = self.value(node.left)
        exponent = self.value(node.right)
        if exponent.is_number:
            if abs(float(exponent)) > MAX_EXPONENT:
                raise FormulaError(
                    f"the exponent {exponent} is too large (at most {MAX_EXPONENT} in absolute value)"
                )
        elif base.is_number and abs(float(base)) > 1 and not exponent.free_symbols:
            raise FormulaError("a constant power tower is not allowed")
        return base**exponent

    def visit_Compare(self, node: ast.Compare) -> sp.Basic:
        if len(node.ops) != 1:
            raise FormulaError("chained comparisons are not allowed; write one comparison")
        op = type(node.ops[0])
        if op not in _COMPARE:
            raise FormulaError("only <, <=, >, >= comparisons are allowed")
        return _COMPARE[op](self.value(node.left), self.value(node.comparators[0]))

    def visit_Tuple(self, node: ast.Tuple) -> sp.Basic:
        raise FormulaError("a tuple is only allowed as a (value, condition) pair of Piecewise")

    def visit_Call(self, node: ast.Call) -> sp.Basic:
        if not isinstance(node.func, ast.Name):
            raise FormulaError(f"{_describe(node.func)} cannot be called; only named functions")
        name = node.func.id
        if node.keywords:
            raise FormulaError(f"{name}() takes no keyword arguments")
        if name == "Piecewise":
            return self._piecewise(node)
        if name in ("sum", "norm"):
            return self._channel_reduction(name, node)
        if name not in FUNCTIONS:
            allowed = allowed_functions(self.channel_sums)
            raise FormulaError(
                f"the function '{name}' is not allowed; allowed functions: "
                f"{', '.join(allowed)}{did_you_mean(name, allowed)}"
            )
        arity, build = FUNCTIONS[name]
        if name == "where" and len(node.args) == 3:  # where(condition, value, value)
            args = [self.condition(node.args[0]), *map(self.value, node.args[1:])]
        else:
            args = [self.value(a) for a in node.args]
        if arity == -1 and len(args) < 2:
            raise FormulaError(f"{name}() takes two or more arguments, got {len(args)}")
        if arity != -1 and len(args) != arity:
            raise FormulaError(f"{name}() takes {arity} argument(s), got {len(args)}")
        return build(args)

    def _piecewise(self, node: ast.Call) -> sp.Basic:
        pieces = []
        for arg in node.args:
            if not (isinstance(arg, ast.Tuple) and len(arg.elts) == 2):
                raise FormulaError("Piecewise takes (value, condition) pairs")
            pieces.append((self.value(arg.elts[0]), self.condition(arg.elts[1])))
        if not pieces or pieces[-1][1] is not sp.true:
            raise FormulaError("the last Piecewise pair must have the condition True")
        return sp.Piecewise(*pieces)

    def _channel_reduction(self, name: str, node: ast.Call) -> sp.Basic:
        if not self.channel_sums:
            raise FormulaError(f"{name}() is only allowed in an attentional-bias loss")
        if self.inside_sum:
            raise FormulaError(f"{name}() cannot be nested inside sum() or norm()")
        if len(node.args) != 1:
            raise FormulaError(f"{name}() takes 1 argument, got {len(node.args)}")
        self.inside_sum = True
        try:
            term = self.value(node.args[0])
        finally:
            self.inside_sum = False
        if name == "sum":
            return ChannelSum(term)
        return sp.sqrt(ChannelSum(term**2) + NORM_EPS)


_OPERATOR_NAMES = {
    ast.FloorDiv: "//",
    ast.Mod: "%",
    ast.MatMult: "@",
    ast.BitAnd: "&",
    ast.BitOr: "|",
    ast.BitXor: "^",
    ast.LShift: "<<",
    ast.RShift: ">>",
}


def _describe(node: ast.AST) -> str:
    kinds = {
        "Attribute": "attribute access",
        "Subscript": "indexing",
        "Lambda": "a lambda",
        "ListComp": "a comprehension",
        "GeneratorExp": "a generator",
        "List": "a list",
        "Dict": "a dict",
        "BoolOp": "and/or",
        "IfExp": "an inline if (use where(cond, a, b))",
        "NamedExpr": "an assignment",
        "JoinedStr": "an f-string",
        "Starred": "a starred argument",
        "Await": "await",
        "Set": "a set",
    }
    return kinds.get(type(node).__name__, type(node).__name__)
