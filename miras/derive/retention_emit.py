"""Retention pass, emission: the torch source of a derived retention step.

    retention_step(w0, u, *gates)   the new state entry; kl: c softmax over the row; bregman
                                    with `solver: newton`: a safeguarded Newton solve
    retention_read(state)           the memory W seen by reads (lq: A / ||A||_q^(q-2))
    retention_objective(w, w0, u, *gates)   the objective, for the checks

The step expression comes from `miras.derive.retention_derive`.
"""

from __future__ import annotations

import inspect

import sympy as sp

from miras.derive import numerics
from miras.derive.emit import function_source
from miras.derive.printer import torch_code
from miras.derive.protocols import RetentionParts
from miras.derive.stabilize import stable_forms
from miras.derive.symbols import gate_symbol, w


def fixed_values(retention: RetentionParts) -> dict[sp.Symbol, sp.Expr]:
    """The retention's fixed (not gated) parameters, as exact sympy numbers."""
    return {gate_symbol(n): sp.nsimplify(x) for n, x in retention.fixed().items()}


def retention_source(retention: RetentionParts, step: sp.Expr, gates: tuple[str, ...]) -> str:
    """retention_step and retention_read, for the derived `step`."""
    return _step_source(retention, step, gates) + "\n\n" + _read_source(retention)


STEP_DOC = "New state from w0 and u [..., Dv, Dphi] (the last axis a row); gates broadcast."


def _step_source(retention: RetentionParts, step: sp.Expr, gates: tuple[str, ...]) -> str:
    args = ["w0", "u", *gates]
    # Before common subexpressions are hoisted, which could split log(z + sqrt(z**2 + 1)).
    step = stable_forms(step)
    if retention.solved_by_newton():
        return _newton_source(retention, step.args[0], args)
    source = function_source(
        "retention_step", args, step, doc=f"retention {retention.kind}. {STEP_DOC}"
    )
    if not retention.simplex_rows:
        return source
    # function_source ends with `    return <logits>`: the row softmax wraps that expression.
    head, _, logits = source.rstrip("\n").rpartition("\n    return ")
    scale = retention.row_sum()
    return f"{head}\n    z = {logits}\n    return {scale!r} * torch.softmax(z, dim=-1)\n"


def _newton_source(retention: RetentionParts, target: sp.Expr, args: list[str]) -> str:
    """`retention_step` solves F'(w) = F'(w0) - u per entry by safeguarded Newton, and helpers
    `bregman_slope` (F'), `bregman_curvature` (F'') and `bregman_inverse_slope` (the solve).

    F' is increasing (F strictly convex, checked) and runs from -oo to oo over the domain
    (checked), so the solve is `miras.derive.numerics.monotone_root` on F'(w) - z from w0:
    bracketed by doubling steps in the domain's coordinate s(w), then Newton steps, each
    replaced by bisection in s where it leaves the bracket or does not halve the step before
    last (Numerical Recipes' rtsafe), until every entry's step is below 2 eps |w| or its
    bracket below 4 eps (1 + |s|), after at most `newton_steps`. The emitted module stays
    self-contained (it imports torch only, and runs what `miras derive --code` prints): it
    holds the library's own source of the routines `monotone_root` is made of and the
    domain's coordinate pair (`numerics.printed_functions`), printed here verbatim, not a
    copy; only `safeguarded_newton`'s loop is written out, so that its bound is the cap.

    The solve runs on detached tensors; the returned w carries dw/dz = 1/F''(w) at the
    solution (implicit differentiation of F'(w) = z), 0 where F''(w) = 0 (the inverse's slope
    is unbounded there, like a cube root at 0)."""
    F = retention.potential_expr()
    slope, curvature = torch_code(sp.diff(F, w)), torch_code(sp.diff(F, w, 2))
    domain = retention.domain()
    to_s, from_s = numerics.COORDINATES[domain]
    cap = retention.newton_steps
    step_doc = (
        f"retention bregman: w = (F')^-1(F'(w0) - u) by safeguarded Newton (at most {cap} "
        f"iterations). {STEP_DOC}"
    )
    library = "\n\n".join(inspect.getsource(f) for f in numerics.printed_functions(domain))
    return f'''def retention_step({", ".join(args)}):
    """{step_doc}"""
    z = {torch_code(target)}
    w = bregman_inverse_slope(z.detach(), w0.detach())
    # dw/dz = 1/F''(w) at the solution (implicit differentiation of F'(w) = z); the value is w.
    dw_dz = 1/bregman_curvature(w)
    dw_dz = torch.where(torch.isfinite(dw_dz), dw_dz, 0)
    return w + (z - z.detach())*dw_dz


def bregman_slope(w):
    """F'(w)"""
    return {slope}


def bregman_curvature(w):
    """F''(w)"""
    return {curvature}


def bregman_inverse_slope(z, w0):
    """(F')^-1(z) per entry from w0, no autograd graph: monotone_root (miras.derive.numerics,
    its pieces printed below) on F'(w) - z, at most {cap} Newton iterations; bracketed and
    bisected in s = {numerics.COORDINATE_TEXT[domain]}."""

    def slope_and_curvature(w):
        return bregman_slope(w) - z, bregman_curvature(w)

    def slope(w):
        return bregman_slope(w) - z

    lo, hi, w = monotone_bracket(slope, w0, {to_s.__name__}, {from_s.__name__})
    state = newton_start(lo, hi, w, {from_s.__name__})
    for _ in range({cap}):
        state = newton_iteration(slope_and_curvature, state, {to_s.__name__}, {from_s.__name__})
        if bool(state[-1].all()):
            break
    return state[0]


# miras.derive.numerics, printed from its source:


{library}'''


# The smallest norm lq's read divides by: a zero accumulator reads as zero, not nan.
NORM_FLOOR = 1e-12


def _read_source(retention: RetentionParts) -> str:
    doc = "The memory W seen by reads and gradients, from the state [..., Dv, Dphi]."
    q = retention.read_norm()
    if q is None:
        return f'def retention_read(state):\n    """{doc}"""\n    return state\n'
    return (
        "def retention_read(state):\n"
        f'    """{doc} W = A / ||A||_q^(q-2), q = {q:g}, per matrix."""\n'
        f"    # ||A||_q over each matrix (the last two axes), floored at {NORM_FLOOR:g}.\n"
        f"    norm = torch.linalg.vector_norm(state, ord={q!r}, dim=(-2, -1), keepdim=True)\n"
        f"    return state / norm.clamp_min({NORM_FLOOR!r}) ** {q - 2!r}\n"
    )


def objective_source(retention: RetentionParts, gates: tuple[str, ...]) -> list[str]:
    """retention_objective(w, w0, u, *gates): the objective per entry, gates substituted for
    (eta, alpha); and, for an objective with |w|, retention_l1_weight(w0, u, *gates)."""
    fixed = fixed_values(retention)
    objective = retention.objective().subs(retention.reparameterization()).subs(fixed)
    sources = [
        function_source(
            "retention_objective",
            ["w", "w0", "u", *gates],
            objective,
            doc="The Learning-Retaining objective of each entry (kl: before the row constraint).",
        )
    ]
    if objective.has(sp.Abs(w)):
        weight = sp.simplify((objective - objective.subs(sp.Abs(w), 0)) / sp.Abs(w))
        # zeros_like: the weight may be a literal (a fixed threshold).
        body = f"torch.zeros_like(w0) + {torch_code(weight)}"
        sources.append(
            f"def retention_l1_weight({', '.join(['w0', 'u', *gates])}):\n    return {body}\n"
        )
    return sources
