"""The display terms of the update rule: a small tree whose leaves are sympy expressions.

Components build their lines of the step from these (`update_lines` hooks); the printers in
`miras.derive.describe` render the same lines as text and as LaTeX. A leaf: it imports only
sympy, so a component may build lines without reaching into the compiler.
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy as sp

# Terms -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Math:
    """A sympy expression: a derived step, a gradient, a symbol such as W_{t-1}."""

    expr: sp.Basic


@dataclass(frozen=True)
class Name:
    """An atom drawn differently in text and in LaTeX (`dL/dy`, `grad_W L`); `latex`
    defaults to the text."""

    text: str
    latex: str | None = None


@dataclass(frozen=True)
class Times:
    """A product with a scalar: `a * b`."""

    factors: tuple[Term, ...]


@dataclass(frozen=True)
class Juxt:
    """Matrix and vector products, written side by side: `W_e phi(k_t)`."""

    factors: tuple[Term, ...]


@dataclass(frozen=True)
class Plus:
    terms: tuple[Term, ...]


@dataclass(frozen=True)
class Call:
    """A function applied to arguments: `softmax_row(z)`, `M_{W_t}(phi(q_t))`."""

    fn: Name
    args: tuple[Term, ...]


@dataclass(frozen=True)
class WindowSum:
    """`sum_{i=lo..t} body`: the Omega window, or the tokens softmax attention reads."""

    lo: str
    body: Term


@dataclass(frozen=True)
class Frac:
    num: Term
    den: Term


@dataclass(frozen=True)
class Norm:
    """`||arg||_q` over a whole matrix."""

    arg: Term
    q: str


@dataclass(frozen=True)
class Power:
    base: Term
    exp: str


@dataclass(frozen=True)
class Transpose:
    arg: Term


@dataclass(frozen=True)
class Dot:
    """The inner product of two vectors."""

    a: Term
    b: Term


Term = Math | Name | Times | Juxt | Plus | Call | WindowSum | Frac | Norm | Power | Transpose | Dot


@dataclass(frozen=True)
class Line:
    """`lhs = rhs    note`. Without lhs, a continuation `= rhs` of the line above; without
    either, a note on the line above."""

    lhs: Term | None
    rhs: Term | None
    note: str = ""


# Helpers -------------------------------------------------------------------------------------------


def sym(name: str) -> Math:
    return Math(sp.Symbol(name))


def times(*factors: Term | None) -> Term:
    """The product of the factors that are not None (None: a fixed factor of 1)."""
    kept = tuple(f for f in factors if f is not None)
    if not kept:
        return Name("1")
    return kept[0] if len(kept) == 1 else Times(kept)


PHI = Name("phi", r"\phi")
GRAD_L = Name("grad_W L", r"\nabla_W \mathcal{L}")
DL_DY = Name("dL/dy", r"\frac{\partial \mathcal{L}}{\partial y}")
SOFTMAX_ROW = Name("softmax_row", r"\operatorname{softmax}_{\mathrm{row}}")
SOFTMAX_I = Name("softmax_i", r"\operatorname{softmax}_{i}")
MLP_BACKWARD = "(the explicit backward through the MLP: dL/dy, then the layers)"
NEWTON_NOTE = "(solved per entry by Newton's method, not in closed form)"


def scalar(value, name: str, index: str = "t") -> Term | None:
    """`name_t` for a gate, the number for a fixed value, None for a fixed 1."""
    if value == "gate":
        return sym(f"{name}_{index}")
    return None if value == 1 else Name(f"{value:g}")
