"""Retention pass, emission: the torch source of a derived retention step.

    retention_step(w0, u, *gates)   the new state entry; kl: c softmax over the row; bregman
                                    with `solver: newton`: a safeguarded Newton solve
    retention_read(state)           the memory W seen by reads (lq: A / ||A||_q^(q-2))
    retention_objective(w, w0, u, *gates)   the objective, for the checks

The step expression comes from `miras.derive.retention_derive`.
"""

from __future__ import annotations

import sympy as sp

from miras.derive.emit import function_source
from miras.derive.printer import torch_code
from miras.derive.protocols import RetentionParts as Retention
from miras.derive.stabilize import stable_forms
from miras.derive.symbols import gate_symbol, sigmoid, w


def fixed_values(retention: Retention) -> dict[sp.Symbol, sp.Expr]:
    """The retention's fixed (not gated) parameters, as exact sympy numbers."""
    return {gate_symbol(n): sp.nsimplify(x) for n, x in retention.fixed().items()}


def retention_source(retention: Retention, step: sp.Expr, gates: tuple[str, ...]) -> str:
    """retention_step and retention_read, for the derived `step`."""
    return _step_source(retention, step, gates) + "\n\n" + _read_source(retention)


STEP_DOC = "New state from w0 and u [..., Dv, Dphi] (the last axis a row); gates broadcast."


def _step_source(retention: Retention, step: sp.Expr, gates: tuple[str, ...]) -> str:
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


# Bregman `solver: newton`: a coordinate s(w) that maps the domain onto all reals, (s(w), w(s)),
# where the root of F'(w) = z is bracketed and bisected; relative precision near 0 and 1.
_s = sp.Symbol("s", real=True)
COORDINATES = {
    "real": (w, _s),
    "positive": (sp.log(w), sp.exp(_s)),
    "unit_interval": (sp.log(w) - sp.log(1 - w), sigmoid(_s)),
}


def _newton_source(retention: Retention, target: sp.Expr, args: list[str]) -> str:
    """`retention_step` solves F'(w) = F'(w0) - u per entry by safeguarded Newton, and helpers
    `bregman_slope` (F'), `bregman_curvature` (F'') and `bregman_inverse_slope` (the solve).

    F' is increasing (F strictly convex, checked), so the root is bracketed in s(w) by doubling
    steps from s(w0) (F' runs from -oo to oo over the domain, checked); then Newton steps, each
    replaced by bisection in s where it leaves the bracket or does not halve the step before
    last (Numerical Recipes' rtsafe). No step divides by a vanishing F'' unguarded: such a step
    is not finite, so it is not inside the bracket. The iteration stops when every entry's step
    is below 2 eps |w| or its bracket below 4 eps (1 + |s|), after at most `newton_steps`.

    The solve runs on detached tensors; the returned w carries dw/dz = 1/F''(w) at the
    solution (implicit differentiation of F'(w) = z), 0 where F''(w) = 0 (the inverse's slope
    is unbounded there, like a cube root at 0)."""
    F = retention.potential_expr()
    slope, curvature = torch_code(sp.diff(F, w)), torch_code(sp.diff(F, w, 2))
    to_s, from_s = COORDINATES[retention.domain()]

    def s_of(name: str) -> str:
        return torch_code(to_s.subs(w, sp.Symbol(name, real=True)))

    def w_of(name: str) -> str:
        return torch_code(from_s.subs(_s, sp.Symbol(name, real=True)))

    cap = retention.newton_steps
    step_doc = (
        f"retention bregman: w = (F')^-1(F'(w0) - u) by safeguarded Newton (at most {cap} "
        f"iterations). {STEP_DOC}"
    )
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
    """(F')^-1(z) per entry from w0 (no autograd graph): bracket in s = {s_of("w")}, then
    Newton, bisecting in s where a step leaves the bracket or stalls; at most {cap} iterations."""
    eps = torch.finfo(z.dtype).eps
    s0 = {s_of("w0")}
    below = bregman_slope(w0) > z  # F' increases: the root lies below w0
    lo, hi = torch.where(below, s0 - 1, s0), torch.where(below, s0, s0 + 1)
    step = torch.ones_like(s0)
    # Doubling steps reach any float (2**1024 overflows float64) in at most 1100.
    for _ in range(1100):
        low, high = bregman_slope({w_of("lo")}) > z, bregman_slope({w_of("hi")}) < z
        if not bool((low | high).any()):
            break
        step = 2*step
        lo, hi = (
            torch.where(low, lo - step, torch.where(high, hi, lo)),
            torch.where(high, hi + step, torch.where(low, lo, hi)),
        )
    mid = (lo + hi)/2
    w = torch.where((lo <= s0) & (s0 <= hi), w0, {w_of("mid")})  # w0, unless the bracket moved
    before_last = last = ({w_of("hi")} - {w_of("lo")}).abs()
    done = torch.zeros_like(w, dtype=torch.bool)
    for _ in range({cap}):
        f = bregman_slope(w) - z
        s = {s_of("w")}
        lo, hi = torch.where(f < 0, s, lo), torch.where(f > 0, s, hi)
        newton = w - f/bregman_curvature(w)
        inside = (newton > {w_of("lo")}) & (newton < {w_of("hi")})
        fast = (newton - w).abs() <= before_last/2
        mid = (lo + hi)/2
        bisection = {w_of("mid")}
        # A Newton step below 2 eps |w| has converged: tested before the bracket, whose ends
        # went through s and back (a round trip that may cost more than that step).
        converged = (f == 0) | ((newton - w).abs() <= 2*eps*w.abs())
        proposal = torch.where(converged, w, torch.where(inside & fast, newton, bisection))
        moved = (proposal - w).abs()
        w = torch.where(done, w, proposal)
        done = done | converged | (moved <= 2*eps*w.abs()) | (hi - lo <= 4*eps*(1 + s.abs()))
        before_last, last = last, moved
        if bool(done.all()):
            break
    return w
'''


# The smallest norm lq's read divides by: a zero accumulator reads as zero, not nan.
NORM_FLOOR = 1e-12


def _read_source(retention: Retention) -> str:
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


def objective_source(retention: Retention, gates: tuple[str, ...]) -> list[str]:
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
