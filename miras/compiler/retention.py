"""Retention pass: the closed-form argmin of MIRAS's Learning-Retaining objective.

    W_t = argmin_W <u_t, W> + (1/eta_t) D(W, W_{t-1}) + (1/alpha_t) G(W)

Each retention states its objective for one entry w of W (`objective()`) and how (eta, alpha)
become its gates (`reparameterization()`). This pass solves the stationarity condition with
sympy, one strategy per shape of objective:

    smooth, separable (none, l2, lq's accumulator)  solve d/dw = 0
    with |w| (elastic_net)                          subgradient cases w > 0, w < 0, w = 0
    on a scaled simplex per row (kl)                Lagrange multiplier, fixed by the row sum
    Bregman (bregman)                               invert F'(w) = F'(w0) - u (or Newton steps)

and emits `retention_step(w0, u, *gates)` and `retention_read(state)` as torch source.
`check_retention` tests the result against autograd and a numerical minimizer. The derivations
are written out in docs/retention.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import sympy as sp
import torch
from sympy.core.function import PoleError
from sympy.utilities.iterables import sift

from miras.check import CheckResult, max_relative_error
from miras.compiler.describe import latex_block, latex_math, latex_text
from miras.compiler.emit import function_source, load_module, module_source
from miras.compiler.printer import UnsupportedExpression, torch_code
from miras.components.base import Retention
from miras.errors import DerivationError
from miras.symbols import gate_symbol, sigmoid, sigmoid_rewrite, soft_threshold, u, w, w0

Step = tuple[str, sp.Basic | str]

# Display-only symbols of the derivations (never printed to torch).
J = sp.Symbol("J")  # the objective's value
mu = sp.Symbol("mu", real=True)  # KL: the Lagrange multiplier of one row's sum
S = sp.Symbol("S", positive=True)  # KL: sum_j exp(z_j) over one row
c = sp.Symbol("c", positive=True)  # KL: the row sum (`scale`)
z = sp.Symbol("z", real=True)  # the argument of a closed-form map (logits, F' value)
softmax = sp.Function("softmax")  # KL: over the row, shown in the derivation only


class inverse_slope(sp.Function):
    """(F')^{-1}(z), solved numerically (Bregman with `solver: newton`): the step of a
    potential sympy cannot invert. The torch source runs Newton's method; no printer knows it."""

    nargs = 1

    def _sympystr(self, printer):
        return "(F')^-1(" + printer._print(self.args[0]) + ")"

    def _latex(self, printer, exp=None):
        return r"(F')^{-1}\left(" + printer._print(self.args[0]) + r"\right)"


@dataclass(frozen=True)
class RetentionRule:
    """A derived retention: the derivation, the step, and its torch source."""

    kind: str
    steps: tuple[Step, ...]  # the derivation, in order: (label, equation or note)
    # The new state entry in w0, u and gate symbols (fixed values substituted). kl: the logits
    # z of W_t = c softmax(z) over the row; lq: the accumulator's step; bregman with newton:
    # inverse_slope(F'(w0) - u).
    step: sp.Expr
    gates: tuple[str, ...]  # the arguments of retention_step after w0, u
    # Defines retention_step(w0, u, *gates) and retention_read(state); no imports.
    source: str

    def text(self) -> str:
        """The objective, then one line per step: `label  value`."""
        width = max(len(label) for label, _ in self.steps)
        lines = [f"retention {self.kind}: W_t = argmin_W <u_t, W> + D(W, W_(t-1))/eta + G(W)/alpha"]
        lines += [f"  {label:<{width}}  {_plain(value)}" for label, value in self.steps]
        return "\n".join(lines)

    def latex(self) -> str:
        """The same lines as `text()`, as the rows of an `aligned` environment."""
        objective = (
            r"W_t = \arg\min_W \langle u_t, W \rangle + \frac{1}{\eta} D(W, W_{t-1}) "
            r"+ \frac{1}{\alpha} G(W)"
        )
        rows = [f"{latex_text(f'retention {self.kind}')} &: {objective}"]
        rows += [f"{latex_text(label)} &: {_latex(value)}" for label, value in self.steps]
        return latex_block(rows)


def _plain(value: sp.Basic | str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, sp.Tuple):
        return ", ".join(_plain(v) for v in value)
    if isinstance(value, sp.Equality):
        return f"{sp.sstr(value.lhs)} = {sp.sstr(value.rhs)}"
    return sp.sstr(value)


def _latex(value: sp.Basic | str) -> str:
    if isinstance(value, str):
        return latex_text(value)
    if isinstance(value, sp.Tuple):
        return ",\\quad ".join(_latex(v) for v in value)
    return latex_math(value)


def _equations(mapping: dict[sp.Symbol, sp.Expr]) -> sp.Tuple:
    return sp.Tuple(*(sp.Eq(k, v) for k, v in mapping.items()))


def _solve_unique(equation: sp.Expr, symbol: sp.Symbol, what: str) -> sp.Expr:
    """The one solution of `equation = 0` for `symbol`, or a DerivationError."""
    try:
        solutions = sp.solve(equation, symbol)
    except NotImplementedError as err:
        raise DerivationError(f"{what}: sympy cannot solve {equation} = 0 ({err})") from None
    if not solutions:
        raise DerivationError(f"{what}: sympy found no solution of {equation} = 0 for {symbol}")
    if len(solutions) > 1:
        listed = ", ".join(map(str, solutions))
        raise DerivationError(
            f"{what}: expected one solution of {equation} = 0 for {symbol}, sympy found "
            f"{len(solutions)}: {listed}"
        )
    return solutions[0]


# Derivations ---------------------------------------------------------------------------------
# Each returns (steps, step), with every gateable field still a symbol.


def _derive_separable(retention: Retention) -> tuple[list[Step], sp.Expr]:
    """A smooth objective, one entry at a time: solve dJ/dw = 0, then reparameterize."""
    objective = retention.objective()
    stationarity = sp.expand(sp.diff(objective, w))
    solution = _solve_unique(stationarity, w, f"retention {retention.kind}")
    reparameterization = retention.reparameterization()
    step = sp.simplify(solution.subs(reparameterization))
    steps: list[Step] = [
        ("objective", sp.Eq(J, objective)),
        ("stationarity", sp.Eq(stationarity, 0)),
        ("solution", sp.Eq(w, solution)),
        ("reparameterization", _equations(reparameterization)),
        ("step", sp.Eq(w, step)),
    ]
    if getattr(retention, "grad_at", "state") == "retained":
        steps.append(
            (
                "grad_at: retained",
                "the runtime takes the bias gradient (inside u_t) at the retained state "
                "decay*w0 instead of w0; the step above is unchanged",
            )
        )
    return steps, step


def _derive_lq(retention: Retention) -> tuple[list[Step], sp.Expr]:
    """The l2 step on the accumulator A, then Moneta's normalization as the read map."""
    steps, step = _derive_separable(retention)
    q = sp.nsimplify(retention.q)
    steps = [(label.replace("step", "accumulator step"), value) for label, value in steps]
    steps.append(
        (
            "read",
            f"W_t = A_t / ||A_t||_q^(q-2) with q = {q}, the norm over each matrix (last two axes); "
            "this is Moneta's declared normalization, not an argmin: W/||W||_q^(q-2) is not "
            "the gradient of any potential unless q = 2",
        )
    )
    return steps, step


def _derive_elastic_net(retention: Retention) -> tuple[list[Step], sp.Expr]:
    """Subgradient cases of J = smooth(w) + gamma |w|: w > 0, w < 0, and 0 in dJ(0)."""
    objective = retention.objective()
    reparameterization = retention.reparameterization()
    gated = objective.subs(reparameterization)
    smooth = gated.subs(sp.Abs(w), 0)
    weight = sp.simplify((gated - smooth) / sp.Abs(w))  # gamma, the l1 weight
    curvature = sp.simplify(sp.diff(smooth, w, 2))
    if weight.has(w) or curvature.has(w) or weight == 0:
        raise DerivationError(
            f"retention {retention.kind}: expected a quadratic plus gamma*|w|, got {gated}"
        )
    slope = sp.diff(smooth, w)
    positive = _solve_unique(slope + weight, w, "case w > 0")  # d|w|/dw = 1
    negative = _solve_unique(slope - weight, w, "case w < 0")  # d|w|/dw = -1
    at_zero = slope.subs(w, 0)  # 0 is optimal iff |smooth'(0)| <= gamma (d|w| at 0 is [-1, 1])
    assembled = sp.Piecewise((positive, positive > 0), (negative, negative < 0), (0, True))
    # A quadratic with curvature k: w = soft_threshold(-smooth'(0)/k, gamma/k). Confirm that the
    # three cases are exactly the branches of that soft thresholding.
    center, threshold = sp.simplify(-at_zero / curvature), sp.simplify(weight / curvature)
    branches = (positive - (center - threshold), negative - (center + threshold))
    if any(sp.simplify(b) != 0 for b in branches):
        raise DerivationError(f"retention {retention.kind}: the cases are not soft thresholding")
    step = soft_threshold(center, threshold)
    steps: list[Step] = [
        ("objective", sp.Eq(J, objective)),
        ("reparameterization", _equations(reparameterization)),
        ("objective (gates)", sp.Eq(J, gated)),
        ("case w > 0", sp.Eq(w, positive)),
        ("case w < 0", sp.Eq(w, negative)),
        ("case w = 0", sp.Abs(at_zero) <= weight),
        ("assembled", sp.Eq(w, assembled)),
        ("step", sp.Eq(w, step)),
    ]
    return steps, step


def _derive_kl(retention: Retention) -> tuple[list[Step], sp.Expr]:
    """Lagrange multiplier mu for the row sum: w = exp(z) * (a factor in mu alone), and the
    row sum fixes the factor, giving c softmax(z) over the row."""
    objective = retention.objective()
    reparameterization = retention.reparameterization()
    gated = objective.subs(reparameterization)
    lagrangian = gated + mu * w  # one mu per row: + mu (sum_j w_j - c)
    stationarity = sp.diff(lagrangian, w)
    solution = _solve_unique(stationarity, w, f"retention {retention.kind}")
    log_w = sp.expand(sp.expand_log(sp.log(solution), force=True))
    # Split log w into the row's common part (terms in mu, and numbers) and per-entry logits z.
    row_terms, entry_terms = sift(
        sp.Add.make_args(log_w), lambda t: t.has(mu) or t.is_number, binary=True
    )
    row_part, logits = sp.Add(*row_terms), sp.Add(*entry_terms)
    if row_part.free_symbols != {mu}:
        raise DerivationError(
            f"retention {retention.kind}: log w = {log_w} does not split into logits plus a "
            "factor that depends on the row's multiplier alone"
        )
    # sum_j w_j = exp(row_part) * S = c with S = sum_j exp(z_j).
    constraint = sp.Eq(sp.exp(row_part) * S, c)
    (multiplier,) = sp.solve(constraint, mu)
    w_row = sp.simplify(sp.exp(logits) * sp.exp(row_part.subs(mu, multiplier)))
    if sp.simplify(w_row - c * sp.exp(logits) / S) != 0:
        raise DerivationError(f"retention {retention.kind}: the row sum gives {w_row}")
    steps: list[Step] = [
        ("objective", sp.Eq(J, objective)),
        ("reparameterization", _equations(reparameterization)),
        ("lagrangian", sp.Eq(J, lagrangian)),
        ("stationarity", sp.Eq(stationarity, 0)),
        ("solution", sp.Eq(w, solution)),
        ("separated", sp.Eq(sp.log(w), sp.Add(logits, row_part, evaluate=False))),
        ("row sum", constraint),
        ("multiplier", sp.Eq(mu, multiplier)),
        ("solution (row)", sp.Eq(w, w_row)),
        ("step", sp.Eq(w, c * softmax(logits))),
        ("where", f"S = sum_j exp(z_j) over the row, c = {retention.scale:g}"),
    ]
    return steps, logits


# Bregman: sample points inside each domain, to pick sympy's branch of (F')^{-1} and to check
# convexity (F'' > 0).
SAMPLES = {
    "real": (-1.3, -0.4, 0.2, 0.9, 1.7),
    "positive": (0.1, 0.5, 1.3, 2.9),
    "unit_interval": (0.05, 0.3, 0.6, 0.93),
}


def _value(expr: sp.Expr) -> complex | None:
    """A numeric value of a closed expression, None if it has none (nan, zoo, symbols)."""
    try:
        value = complex(sp.N(expr, 30))
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value.real) and math.isfinite(value.imag) else None


def _derive_bregman(retention: Retention) -> tuple[list[Step], sp.Expr]:
    """Stationarity is F'(w) = F'(w0) - u; invert F' with sympy (or Newton)."""
    F = retention.potential_expr()
    slope, curvature = sp.diff(F, w), sp.diff(F, w, 2)
    domain = retention.domain()
    for point in SAMPLES[domain]:  # a necessary check of strict convexity: F'' > 0
        value = _value(curvature.subs(w, point))
        if value is None or abs(value.imag) > 1e-12 or value.real <= 0:
            shown = "undefined" if value is None else f"{value.real:.6g}"
            raise DerivationError(
                f"retention bregman: the potential F(w) = {F} is not strictly convex on its "
                f"domain ({domain}): F''(w) = {curvature} is {shown} at w = {point}"
            )
    _check_slope_is_onto(slope, domain)
    objective = retention.objective()
    reparameterization = retention.reparameterization()
    stationarity = sp.diff(objective.subs(reparameterization), w)
    target = sp.simplify(slope - stationarity)  # F'(w) = F'(w0) - u
    if target.has(w):
        raise DerivationError(
            f"retention bregman: stationarity {stationarity} = 0 is not F'(w) = z"
        )
    steps: list[Step] = [
        ("potential", sp.Eq(sp.Symbol("F"), F)),
        ("domain", domain),
        ("objective", sp.Eq(J, objective)),
        ("reparameterization", _equations(reparameterization)),
        ("stationarity", sp.Eq(stationarity, 0)),
        ("mirror step", sp.Eq(slope, target)),
    ]
    if retention.solver == "newton":
        steps += [
            ("F''", sp.Eq(sp.Symbol("F''"), curvature)),
            (
                "newton",
                f"z = F'(w0) - u; bracket the root in s = {sp.sstr(COORDINATES[domain][0])} "
                "from w0; then w <- w - (F'(w) - z)/F''(w), bisecting in s where that step "
                "leaves the bracket or does not halve; until converged (step < 2 eps |w|), at "
                f"most {retention.newton_steps} iterations",
            ),
            ("gradient", "dw/dz = 1/F''(w) at the solution (implicit differentiation)"),
            ("step", sp.Eq(w, inverse_slope(target))),
        ]
        return steps, inverse_slope(target)
    inverse = _invert_slope(slope, domain)
    step = inverse.subs(z, target)
    try:
        torch_code(step)
    except UnsupportedExpression as err:
        raise DerivationError(
            f"retention bregman: sympy inverts F'(w) = {slope} as {inverse}, which the torch "
            f"printer cannot emit ({err}); set `retention.solver: newton` to solve "
            "F'(w) = F'(w0) - u with Newton steps instead"
        ) from None
    steps += [("inverse", sp.Eq(w, inverse)), ("step", sp.Eq(w, step))]
    return steps, step


# The ends of each domain, approached from inside.
ENDS = {
    "real": ((-sp.oo, "+"), (sp.oo, "-")),
    "positive": ((0, "+"), (sp.oo, "-")),
    "unit_interval": ((0, "+"), (1, "-")),
}


def _check_slope_is_onto(slope: sp.Expr, domain: str) -> None:
    """F' must run from -oo to oo over the domain (F of Legendre type): otherwise F'(w0) - u
    leaves F's range for some u, where the objective has no minimizer (F = exp(w): F' > 0, and
    u > exp(w0) sends w to -oo). A limit sympy cannot find is not held against F."""
    (lo, lo_dir), (hi, hi_dir) = ENDS[domain]
    for end, direction, want in ((lo, lo_dir, -sp.oo), (hi, hi_dir, sp.oo)):
        try:
            limit = sp.limit(slope, w, end, direction)
        except (NotImplementedError, ValueError, PoleError):
            continue
        if limit.is_number and limit.is_finite:
            raise DerivationError(
                f"retention bregman: F'(w) = {slope} tends to {limit} at w -> {end}, not to "
                f"{want}: F'(w0) - u leaves the range of F' for some u, where the objective has "
                "no minimizer; use a potential whose F' runs from -oo to oo on its domain"
            )


def _invert_slope(slope: sp.Expr, domain: str) -> sp.Expr:
    """(F')^{-1}(z) in closed form, named with sigmoid where sympy wrote the logistic out.

    F is strictly convex, so F' is one-to-one and the inverse is unique on F's range; of the
    branches sympy returns, keep those that give back w at sample points w_k of the domain:
    candidate(F'(w_k)) = w_k."""
    advice = "set `retention.solver: newton` to solve F'(w) = F'(w0) - u with Newton steps instead"
    try:
        candidates = sp.solve(sp.Eq(slope, z), w)
    except NotImplementedError as err:
        reason = str(err).splitlines()[-1] if str(err) else "no algorithm"
        raise DerivationError(
            f"retention bregman: sympy cannot invert F'(w) = {slope} in closed form "
            f"({reason}); {advice}"
        ) from None
    valid = []
    for candidate in candidates:
        back = [_value(candidate.subs(z, slope.subs(w, p))) for p in SAMPLES[domain]]
        if all(
            b is not None and abs(b - p) < 1e-9 for b, p in zip(back, SAMPLES[domain], strict=True)
        ):
            valid.append(candidate)
    if not valid:
        if candidates:
            found = (
                f"none of its solutions for w ({', '.join(map(str, candidates))}) is a real "
                "inverse at every sample point"
            )
        else:
            found = "sympy found no closed-form solution for w"
        raise DerivationError(
            f"retention bregman: sympy cannot invert F'(w) = {slope} on the whole domain "
            f"({domain}): {found}; {advice}"
        )
    # Several valid branches agree on the domain: keep the simplest.
    return sigmoid_rewrite(min(valid, key=sp.count_ops))


DERIVATIONS = {
    "none": _derive_separable,
    "l2": _derive_separable,
    "lq": _derive_lq,
    "kl": _derive_kl,
    "elastic_net": _derive_elastic_net,
    "bregman": _derive_bregman,
}


def derive_retention(retention: Retention) -> RetentionRule:
    """The closed-form step of `retention` and its torch source.

    Raises `DerivationError` when the step cannot be derived (e.g. a Bregman potential whose
    F' sympy cannot invert under `solver: closed_form`)."""
    if retention.kind not in DERIVATIONS:
        raise DerivationError(
            f"no derivation for retention {retention.kind!r}; known: {', '.join(DERIVATIONS)}"
        )
    steps, step = DERIVATIONS[retention.kind](retention)
    fixed = _fixed_values(retention)
    if fixed:
        steps.append(("fixed values", _equations(fixed)))
        step = step.subs(fixed)
    gates = tuple(retention.gates())
    allowed = {w0, u, *(gate_symbol(g) for g in gates)}
    stray = step.free_symbols - allowed
    if stray:
        raise DerivationError(
            f"retention {retention.kind}: the step {step} has unexpected symbols "
            f"{sorted(map(str, stray))}"
        )
    source = _step_source(retention, step, gates) + "\n\n" + _read_source(retention)
    return RetentionRule(retention.kind, tuple(steps), step, gates, source)


def _fixed_values(retention: Retention) -> dict[sp.Symbol, sp.Expr]:
    return {gate_symbol(n): sp.nsimplify(x) for n, x in retention.fixed().items()}


# Torch source ----------------------------------------------------------------------------------

STEP_DOC = "New state from w0 and u [..., Dv, Dphi] (the last axis a row); gates broadcast."


def _step_source(retention: Retention, step: sp.Expr, gates: tuple[str, ...]) -> str:
    args = ["w0", "u", *gates]
    if retention.kind == "bregman" and retention.solver == "newton":
        return _newton_source(retention, step.args[0], args)
    source = function_source(
        "retention_step", args, step, doc=f"retention {retention.kind}. {STEP_DOC}"
    )
    if retention.kind != "kl":
        return source
    # function_source ends with `    return <logits>`: the row softmax wraps that expression.
    head, _, logits = source.rstrip("\n").rpartition("\n    return ")
    return f"{head}\n    z = {logits}\n    return {retention.scale!r} * torch.softmax(z, dim=-1)\n"


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
    if retention.kind != "lq":
        return f'def retention_read(state):\n    """{doc}"""\n    return state\n'
    q = float(retention.q)
    return (
        "def retention_read(state):\n"
        f'    """{doc} W = A / ||A||_q^(q-2), q = {q:g}, per matrix."""\n'
        f"    # ||A||_q over each matrix (the last two axes), floored at {NORM_FLOOR:g}.\n"
        f"    norm = torch.linalg.vector_norm(state, ord={q!r}, dim=(-2, -1), keepdim=True)\n"
        f"    return state / norm.clamp_min({NORM_FLOOR!r}) ** {q - 2!r}\n"
    )


# Checks ----------------------------------------------------------------------------------------

SHAPE = (3, 4, 5, 6)  # [B, H, Dv, Dphi]: the last axis is a row (KL's simplex)
# (stationarity, argmin) tolerances: autograd is exact up to rounding; a numerical minimizer
# of a function that is flat at its minimum finds it to about sqrt(machine epsilon).
TOLERANCES = {torch.float64: (1e-8, 1e-6), torch.float32: (1e-3, 1e-2)}
GOLDEN = (math.sqrt(5) - 1) / 2


def check_retention(
    retention: Retention, rule: RetentionRule, *, dtype=torch.float64, seed: int = 0
) -> list[CheckResult]:
    """The derived step against the objective it minimizes, on random inputs of shape SHAPE:
    the objective's autograd gradient vanishes at W_t (projected on the row constraint for kl,
    the subgradient condition at exact zeros for an l1 term), and W_t equals a numerical
    minimizer (golden section per entry; L-BFGS over each row's logits for kl)."""
    if dtype not in TOLERANCES:
        raise ValueError(f"dtype: expected one of {list(TOLERANCES)}, got {dtype}")
    stationary_tol, argmin_tol = TOLERANCES[dtype]
    module = load_module(
        module_source(
            f"retention {rule.kind}: step and objective",
            [rule.source, *_objective_source(retention, rule.gates)],
        )
    )
    gen = torch.Generator().manual_seed(seed)
    w0_ = sample_state(retention, SHAPE, dtype, gen)
    u_ = 0.5 * torch.randn(SHAPE, dtype=dtype, generator=gen)
    gates = list(sample_gates(retention, SHAPE, dtype, gen).values())
    new = module.retention_step(w0_, u_, *gates)

    def objective(x: torch.Tensor) -> torch.Tensor:
        return module.retention_objective(x, w0_, u_, *gates)

    where = "accumulator A_t" if rule.kind == "lq" else "W_t"
    results = [_stationarity(retention, module, objective, new, w0_, u_, gates, stationary_tol)]
    if rule.kind == "kl":
        numeric = _argmin_rows(objective, w0_, retention.scale)
        method = "L-BFGS over each row's logits"
        row_sums = new.sum(-1)
        error = max_relative_error(row_sums, torch.full_like(row_sums, retention.scale))
        results.append(
            CheckResult(
                f"rows: W_t > 0 and each row sums to c = {retention.scale:g}",
                error if bool((new > 0).all()) else math.inf,
                stationary_tol,
            )
        )
    else:
        numeric = _argmin_entries(objective, w0_, u_, retention.domain())
        method = "golden section per entry"
    results.append(
        CheckResult(
            f"argmin: derived {where} vs a numerical minimizer ({method})",
            max_relative_error(new, numeric),
            argmin_tol,
        )
    )
    if rule.kind == "lq":
        # Moneta's read, written independently of the emitted source.
        q = float(retention.q)
        norm = new.abs().pow(q).sum(dim=(-2, -1), keepdim=True).pow(1 / q)
        results.append(
            CheckResult(
                "read: retention_read(A) vs A / ||A||_q^(q-2) per matrix",
                max_relative_error(module.retention_read(new), new / norm ** (q - 2)),
                stationary_tol,
            )
        )
    return results


def _objective_source(retention: Retention, gates: tuple[str, ...]) -> list[str]:
    """retention_objective(w, w0, u, *gates): the objective per entry, gates substituted for
    (eta, alpha); and, for an objective with |w|, retention_l1_weight(w0, u, *gates)."""
    fixed = _fixed_values(retention)
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


def sample_state(retention: Retention, shape, dtype, generator) -> torch.Tensor:
    """A random previous state inside the retention's domain."""
    x = torch.randn(shape, dtype=dtype, generator=generator)
    domain = retention.domain()
    if domain == "positive":
        return torch.exp(0.5 * x)
    if domain == "unit_interval":
        return torch.sigmoid(x)
    return x


def sample_gates(retention: Retention, shape, dtype, generator) -> dict[str, torch.Tensor]:
    """Random in-range values of each gate, one per entry (the most general broadcast)."""
    gates = {}
    for name in retention.gates():
        allowed = retention.gateable[name]
        r = torch.rand(shape, dtype=dtype, generator=generator)
        if math.isfinite(allowed.lo) and math.isfinite(allowed.hi):
            # Away from the open end: a decay in [0.2, 1).
            gates[name] = allowed.lo + (allowed.hi - allowed.lo) * (0.2 + 0.8 * r)
        elif math.isfinite(allowed.lo):
            gates[name] = allowed.lo + 0.05 + 0.45 * r  # e.g. a threshold in [0.05, 0.5)
        else:
            gates[name] = 2 * r - 1
    return gates


def _stationarity(retention, module, objective, new, w0_, u_, gates, tolerance) -> CheckResult:
    """|dJ/dW| at the derived W_t, by autograd of the printed objective."""
    point = new.detach().requires_grad_()
    (grad,) = torch.autograd.grad(objective(point).sum(), point)
    if retention.kind == "kl":
        # Lagrangian J + mu (sum_j w_j - c): at the optimum dJ/dw_j = -mu on the whole row, so
        # the gradient minus its row mean (the projection on the constraint) vanishes.
        error = float((grad - grad.mean(-1, keepdim=True)).abs().max())
        piece = "stationarity: autograd grad of the objective at W_t, projected on each row sum"
        return CheckResult(piece, error, tolerance)
    if not hasattr(module, "retention_l1_weight"):
        what = "A_t" if retention.kind == "lq" else "W_t"
        piece = f"stationarity: autograd grad of the objective at the derived {what}"
        return CheckResult(piece, float(grad.abs().max()), tolerance)
    # At exact zeros |w| has the subdifferential gamma [-1, 1], and torch's d|w|/dw there is 0:
    # the autograd gradient is the smooth part's, and 0 is optimal iff it is at most gamma.
    weight = module.retention_l1_weight(w0_, u_, *gates)
    zero = new == 0
    off = grad[~zero].abs().max() if (~zero).any() else grad.new_zeros(())
    on = (grad[zero].abs() - weight[zero]).clamp_min(0).max() if zero.any() else grad.new_zeros(())
    piece = (
        "stationarity: autograd grad of the objective at W_t, and |smooth grad| <= gamma "
        f"at the {int(zero.sum())} of {zero.numel()} entries that are exactly 0"
    )
    return CheckResult(piece, float(torch.maximum(off, on)), tolerance)


def _golden_section(f, lo: torch.Tensor, hi: torch.Tensor, iterations: int = 120) -> torch.Tensor:
    """Per-entry minimizer of an elementwise convex f over [lo, hi] (evaluated inside only)."""
    for _ in range(iterations):
        left, right = hi - GOLDEN * (hi - lo), lo + GOLDEN * (hi - lo)
        keep_left = f(left) < f(right)  # then the minimum lies in [lo, right]
        lo, hi = torch.where(keep_left, lo, left), torch.where(keep_left, right, hi)
    return (lo + hi) / 2


def _argmin_entries(objective, w0_: torch.Tensor, u_: torch.Tensor, domain: str) -> torch.Tensor:
    """Golden section per entry over the domain, widening the bracket where the minimizer is
    found at an edge that is not the domain's."""
    spread = 1 + w0_.abs() + u_.abs()
    if domain == "unit_interval":
        lo, hi = torch.zeros_like(w0_), torch.ones_like(w0_)
    elif domain == "positive":
        lo, hi = torch.zeros_like(w0_), w0_ + spread
    else:
        lo, hi = w0_ - spread, w0_ + spread
    with torch.no_grad():
        for _ in range(20):
            x = _golden_section(objective, lo, hi)
            width = hi - lo
            low = (x - lo < 1e-3 * width) & (domain == "real")
            high = (hi - x < 1e-3 * width) & (domain != "unit_interval")
            if not (low.any() or high.any()):
                break
            lo, hi = torch.where(low, lo - width, lo), torch.where(high, hi + width, hi)
    return x


def _argmin_rows(objective, w0_: torch.Tensor, scale: float) -> torch.Tensor:
    """KL: minimize over W = c softmax(theta) (every row on the scaled simplex) with L-BFGS."""
    theta = torch.zeros_like(w0_, requires_grad=True)
    opt = torch.optim.LBFGS(
        [theta],
        max_iter=500,
        tolerance_grad=1e-14,
        tolerance_change=0.0,
        history_size=20,
        line_search_fn="strong_wolfe",
    )

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = objective(scale * torch.softmax(theta, dim=-1)).sum()
        loss.backward()
        return loss

    for _ in range(4):
        opt.step(closure)
    return (scale * torch.softmax(theta, dim=-1)).detach()
