"""The readable derivation `miras derive` prints: components, derived pieces, the step.

Every formula shown is a `Line` (`lhs = rhs`, an optional note) built from a small term tree
whose leaves are sympy expressions. Two printers render the same lines: `PlainPrinter` as
text and `LatexPrinter` as LaTeX. The update rule is built once, as lines, so its text and
its LaTeX state the same rule.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import sympy as sp
from sympy.printing.latex import LatexPrinter as SympyLatexPrinter
from sympy.printing.latex import greek_letters_set

from miras.derive.symbols import gate_symbol, u, w0
from miras.derive.terms import (
    PHI,
    Call,
    Dot,
    Frac,
    Juxt,
    Line,
    Math,
    Name,
    Norm,
    Plus,
    Power,
    Term,
    Times,
    Transpose,
    WindowSum,
    sym,
)

if TYPE_CHECKING:  # the spec by what it offers (`SpecParts`): the analyses that components
    # call render their derivations with this module's printers
    from miras.derive.protocols import SpecParts
    from miras.ir import BiasRule, Plan, RetentionRule


# Printers --------------------------------------------------------------------------------------


class _SympyLatex(SympyLatexPrinter):
    """sympy's LaTeX, with upright multi-letter names (`\\mathrm{decay}_{t}`, not an italic
    product of five letters) and the helper functions of the derivations."""

    def _print_Symbol(self, expr, style="plain"):
        base, _, sub = expr.name.partition("_")
        if len(base) > 1 and base.isalpha() and base.lower() not in greek_letters_set:
            sub = sub[1:-1] if sub.startswith("{") and sub.endswith("}") else sub
            return rf"\mathrm{{{base}}}" + (f"_{{{sub}}}" if sub else "")
        return super()._print_Symbol(expr, style=style)

    def _print_soft_threshold(self, expr, exp=None):
        args = ", ".join(self._print(a) for a in expr.args)
        body = r"\operatorname{soft\_threshold}\left(" + args + r"\right)"
        return body if exp is None else f"{{{body}}}^{{{exp}}}"


def latex_math(expr: sp.Basic) -> str:
    """A sympy expression as LaTeX (math mode), in ASCII: a character beyond ASCII (a symbol
    sympy names by itself) is written as its code point, \text{U+03B1}."""
    return "".join(
        ch if ord(ch) < 128 else rf"\text{{U+{ord(ch):04X}}}" for ch in _SympyLatex().doprint(expr)
    )


# Characters that are commands, or other glyphs, in LaTeX's text mode.
_TEXT_ESCAPES = {
    "\\": r"\textbackslash{}",
    "{": r"\{",
    "}": r"\}",
    "_": r"\_",
    "^": r"\^{}",
    "%": r"\%",
    "&": r"\&",
    "#": r"\#",
    "$": r"\$",
    "~": r"\~{}",
    "<": r"\textless{}",
    ">": r"\textgreater{}",
}


def latex_text(text: str) -> str:
    """Plain words as a LaTeX `\\text{...}` that shows them verbatim."""
    return r"\text{" + "".join(_text_char(ch) for ch in text) + "}"


def _text_char(ch: str) -> str:
    """One character in text mode, in ASCII (pdflatex has no glyph for most of Unicode): a
    character beyond ASCII is written as its code point, U+00E9."""
    if ord(ch) > 127:
        return f"U+{ord(ch):04X}"
    return _TEXT_ESCAPES.get(ch, ch)


class _Printer:
    """Dispatch to `_print_<Term class>`; a term without a method raises (no half lines)."""

    def doprint(self, term: Term) -> str:
        method = getattr(self, f"_print_{type(term).__name__}", None)
        if method is None:
            raise TypeError(f"{type(self).__name__} cannot print {term!r}")
        return method(term)

    def _grouped(self, term: Term) -> str:
        """A factor of a product, parenthesized when it is a sum."""
        text = self.doprint(term)
        is_sum = isinstance(term, Plus) or (isinstance(term, Math) and term.expr.is_Add)
        return self._parens(text) if is_sum else text


class PlainPrinter(_Printer):
    """Lines as text; leaves by sympy's str printer."""

    def _parens(self, text: str) -> str:
        return f"({text})"

    def _print_Math(self, t: Math) -> str:
        return sp.sstr(t.expr)

    def _print_Name(self, t: Name) -> str:
        return t.text

    def _print_Times(self, t: Times) -> str:
        return " * ".join(self._grouped(f) for f in t.factors)

    def _print_Juxt(self, t: Juxt) -> str:
        return " ".join(self._grouped(f) for f in t.factors)

    def _print_Plus(self, t: Plus) -> str:
        return " + ".join(self.doprint(a) for a in t.terms)

    def _print_Call(self, t: Call) -> str:
        return f"{self.doprint(t.fn)}({', '.join(self.doprint(a) for a in t.args)})"

    def _print_WindowSum(self, t: WindowSum) -> str:
        return f"sum_{{i={t.lo}..t}} {self.doprint(t.body)}"

    def _print_Frac(self, t: Frac) -> str:
        return f"{self._grouped(t.num)} / {self._grouped(t.den)}"

    def _print_Norm(self, t: Norm) -> str:
        return f"||{self.doprint(t.arg)}||_{t.q}"

    def _print_Power(self, t: Power) -> str:
        return f"{self._grouped(t.base)}^{t.exp}"

    def _print_Transpose(self, t: Transpose) -> str:
        return f"{self._grouped(t.arg)}^T"

    def _print_Dot(self, t: Dot) -> str:
        return f"{self.doprint(t.a)} . {self.doprint(t.b)}"

    def line(self, line: Line) -> str:
        note = f"    {line.note}" if line.note else ""
        if line.lhs is not None:
            return f"{self.doprint(line.lhs)} = {self.doprint(line.rhs)}{note}"
        if line.rhs is not None:
            return f"    = {self.doprint(line.rhs)}{note}"
        return f"    {line.note}"


class LatexPrinter(_Printer):
    """Lines as rows of an `aligned` environment; leaves by sympy's LaTeX printer."""

    def _parens(self, text: str) -> str:
        return rf"\left({text}\right)"

    def _print_Math(self, t: Math) -> str:
        return latex_math(t.expr)

    def _print_Name(self, t: Name) -> str:
        return t.text if t.latex is None else t.latex

    def _print_Times(self, t: Times) -> str:
        return " ".join(self._grouped(f) for f in t.factors)

    _print_Juxt = _print_Times

    def _print_Plus(self, t: Plus) -> str:
        return " + ".join(self.doprint(a) for a in t.terms)

    def _print_Call(self, t: Call) -> str:
        args = ", ".join(self.doprint(a) for a in t.args)
        return rf"{self.doprint(t.fn)}\left({args}\right)"

    def _print_WindowSum(self, t: WindowSum) -> str:
        return rf"\sum_{{i={t.lo}}}^{{t}} {self.doprint(t.body)}"

    def _print_Frac(self, t: Frac) -> str:
        return rf"\frac{{{self.doprint(t.num)}}}{{{self.doprint(t.den)}}}"

    def _print_Norm(self, t: Norm) -> str:
        return rf"\left\lVert {self.doprint(t.arg)} \right\rVert_{{{t.q}}}"

    def _print_Power(self, t: Power) -> str:
        return f"{{{self._grouped(t.base)}}}^{{{t.exp}}}"

    def _print_Transpose(self, t: Transpose) -> str:
        return rf"{{{self._grouped(t.arg)}}}^{{\top}}"

    def _print_Dot(self, t: Dot) -> str:
        return rf"{self.doprint(t.a)} \cdot {self.doprint(t.b)}"

    def line(self, line: Line) -> str:
        note = rf" \quad {latex_text(line.note)}" if line.note else ""
        if line.lhs is not None:
            return f"{self.doprint(line.lhs)} &= {self.doprint(line.rhs)}{note}"
        if line.rhs is not None:
            return f"&= {self.doprint(line.rhs)}{note}"
        return rf"&\quad {latex_text(line.note)}"


def plain_lines(lines: list[Line] | tuple[Line, ...]) -> list[str]:
    printer = PlainPrinter()
    return [printer.line(line) for line in lines]


def latex_block(rows: list[str]) -> str:
    """Rows (with `&` alignment marks) as one `aligned` environment."""
    return "\\begin{aligned}\n" + " \\\\\n".join(rows) + "\n\\end{aligned}"


def latex_lines(lines: list[Line] | tuple[Line, ...]) -> str:
    printer = LatexPrinter()
    return latex_block([printer.line(line) for line in lines])


# The update rule -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Derivation:
    """The derived update rule, as text (`str()`) and LaTeX (`.latex`); `update` holds the
    lines of one step that both render."""

    text: str
    latex: str
    update: tuple[Line, ...] = field(default=())

    def __str__(self) -> str:
        return self.text


def _step_expr(spec: SpecParts, rule: RetentionRule, previous: str = "W_{t-1}") -> sp.Expr:
    """The retention step in the previous state and u_t, fixed values substituted."""
    fixed = {gate_symbol(n): sp.nsimplify(x) for n, x in spec.retention.fixed().items()}
    per_token = {gate_symbol(n): sp.Symbol(f"{n}_t") for n in spec.retention.gates()}
    names = {w0: sp.Symbol(previous), u: sp.Symbol("u_t")}
    return rule.step.subs(fixed).subs({**names, **per_token})


def update_lines(spec: SpecParts, rule: RetentionRule) -> list[Line]:
    """One step t of the exact recurrence, each component contributing its lines: the
    gradient point (retention), g_t (memory), u_t (optimizer), W_t (retention), the read."""
    memory = spec.memory
    for component in (memory, spec.optimizer):  # a closed form; an optimizer that solves
        whole = component.whole_step_lines(spec)
        if whole is not None:
            return whole
    retention = spec.retention
    return [
        *retention.gradient_point_lines(),
        *memory.update_lines(spec.window),
        *spec.optimizer.update_lines(),
        *retention.update_lines(lambda previous: _step_expr(spec, rule, previous)),
        Line(sym("o_t"), Call(Name("M_{W_t}"), (Call(PHI, (sym("q_t"),)),))),
    ]


def describe(spec: SpecParts, bias: BiasRule, retention: RetentionRule, plan: Plan) -> Derivation:
    components = []
    for name in ("memory", "feature_map", "bias", "retention", "optimizer"):
        component = getattr(spec, name)
        params = ", ".join(f"{k}={v}" for k, v in component.parameters().items() if v is not None)
        components.append(f"  {name:12s} {component.kind}" + (f" ({params})" if params else ""))
        components.append(f"  {'':12s} {component.spec_equation()}")  # lq: the spec's q
    components.append(f"  {'window':12s} c = {spec.window.c}, gamma = {spec.window.gamma}")

    def indent(text: str) -> list[str]:
        return ["  " + line for line in text.splitlines()]

    update = tuple(update_lines(spec, retention))
    headings = {
        "bias": "Attentional bias (derived: chain rule through the channel sums)",
        "retention": (
            "Retention (derived: Newton solve of the Learning-Retaining stationarity condition "
            "F'(W_t) = F'(W_{t-1}) - u_t)"
            if spec.retention.solved_by_newton()
            else "Retention (derived: closed-form argmin of the Learning-Retaining objective)"
        ),
        "update": "Update rule, one step t (the exact recurrence; chunk size 1)",
    }
    text = [
        f"spec {spec.name}  (digest {spec.digest()[:12]})",
        "",
        "Components",
        *components,
        "",
        headings["bias"],
        *indent(bias.text()),
        "",
        headings["retention"],
        *indent(retention.text()),
        "",
        headings["update"],
        *indent("\n".join(plain_lines(update))),
        "",
        "Plan",
        *indent(plan.text()),
    ]
    # One display per section, each an `aligned` block (amsmath), with the text's headings as
    # comments.
    latex = [f"% spec {spec.name}  (digest {spec.digest()[:12]})"]
    for key, block in (
        ("bias", bias.latex()),
        ("retention", retention.latex()),
        ("update", latex_lines(update)),
    ):
        latex += [f"% {headings[key]}", r"\[", block, r"\]"]
    return Derivation("\n".join(text), "\n".join(latex), update)
