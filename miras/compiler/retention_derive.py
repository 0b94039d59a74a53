"""Retention pass, derivation: the closed-form argmin of MIRAS's Learning-Retaining objective.

    W_t = argmin_W <u_t, W> + (1/eta_t) D(W, W_{t-1}) + (1/alpha_t) G(W)

Each retention states its objective for one entry w of W (`objective()`) and how (eta, alpha)
become its gates (`reparameterization()`). This pass solves the stationarity condition with
sympy, one strategy per shape of objective:

    smooth, separable (none, l2, lq's accumulator)  solve d/dw = 0
    with |w| (elastic_net)                          subgradient cases w > 0, w < 0, w = 0
    on a scaled simplex per row (kl)                Lagrange multiplier, fixed by the row sum
    Bregman (bregman)                               invert F'(w) = F'(w0) - u (or Newton steps)

The result is a `miras.ir.RetentionRule`: the derivation's steps (and their display), the
step, and the torch source of `retention_step(w0, u, *gates)` and `retention_read(state)`
(written by `miras.compiler.retention_emit`); `miras.compiler.retention_check` tests it against
autograd and a numerical minimizer. The derivations are written out in docs/retention.md.
"""

from __future__ import annotations

import math

import sympy as sp
from sympy.core.function import PoleError
from sympy.utilities.iterables import sift

from miras.compiler.describe import latex_block, latex_math, latex_text
from miras.compiler.printer import UnsupportedExpression, torch_code
from miras.compiler.retention_emit import COORDINATES, fixed_values, retention_source
from miras.components.base import Retention
from miras.errors import DerivationError
from miras.formula import OVERFLOW, bounded_simplify, value_at
from miras.ir import RetentionRule, Step
from miras.symbols import gate_symbol, sigmoid_rewrite, soft_threshold, u, w, w0

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


OBJECTIVE_TEXT = "W_t = argmin_W <u_t, W> + D(W, W_(t-1))/eta + G(W)/alpha"
OBJECTIVE_LATEX = (
    r"W_t = \arg\min_W \langle u_t, W \rangle + \frac{1}{\eta} D(W, W_{t-1}) "
    r"+ \frac{1}{\alpha} G(W)"
)


def retention_text(kind: str, steps: tuple[Step, ...]) -> str:
    """The objective, then one line per step: `label  value`."""
    width = max(len(label) for label, _ in steps)
    lines = [f"retention {kind}: {OBJECTIVE_TEXT}"]
    lines += [f"  {label:<{width}}  {_plain(value)}" for label, value in steps]
    return "\n".join(lines)


def retention_latex(kind: str, steps: tuple[Step, ...]) -> str:
    """The same lines as `retention_text`, as the rows of an `aligned` environment."""
    rows = [f"{latex_text(f'retention {kind}')} &: {OBJECTIVE_LATEX}"]
    rows += [f"{latex_text(label)} &: {_latex(value)}" for label, value in steps]
    return latex_block(rows)


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
    step = solution.subs(reparameterization)
    simplified = bounded_simplify(step)
    step = step if simplified is None else simplified  # a large solution is kept as solved
    steps: list[Step] = [
        ("objective", sp.Eq(J, objective)),
        ("stationarity", sp.Eq(stationarity, 0)),
        ("solution", sp.Eq(w, solution)),
        ("reparameterization", _equations(reparameterization)),
        ("step", sp.Eq(w, step)),
    ]
    if retention.retained_factor() is not None:
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


def _exact(point: float) -> sp.Rational:
    """A sample point as an exact number: a Float substituted into exp(exp(...)) is evaluated
    on the spot by sympy, with no bound on the size of the result."""
    return sp.Rational(str(point))


def _value(expr: sp.Expr) -> complex | None:
    """A numeric value of a closed expression, None if it has none (nan, zoo, symbols) or a
    term of it leaves the float64 range (evaluated from the leaves up first: sp.N alone of
    exp(exp(exp(w**16))) at w = 1.7 builds a number with a 4000-digit exponent)."""
    if value_at(expr, {}) == OVERFLOW:
        return None
    try:
        value = complex(sp.N(expr, 30))
    except (TypeError, ValueError, OverflowError):
        return None
    return value if math.isfinite(value.real) and math.isfinite(value.imag) else None


def _derive_bregman(retention: Retention) -> tuple[list[Step], sp.Expr]:
    """Stationarity is F'(w) = F'(w0) - u; invert F' with sympy (or Newton)."""
    F = retention.potential_expr()
    slope, curvature = sp.diff(F, w), sp.diff(F, w, 2)
    domain = retention.domain()
    for point in SAMPLES[domain]:  # a necessary check of strict convexity: F'' > 0
        value = _value(curvature.xreplace({w: _exact(point)}))  # exact: subs would evalf
        if value is None or abs(value.imag) > 1e-12 or value.real <= 0:
            shown = "undefined or beyond float64" if value is None else f"{value.real:.6g}"
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
        back = [_value(candidate.subs(z, slope.xreplace({w: _exact(p)}))) for p in SAMPLES[domain]]
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


# By the component's `derivation`: a new retention with a smooth objective is "separable" and
# needs no entry here.
DERIVATIONS = {
    "separable": _derive_separable,
    "lq": _derive_lq,
    "kl": _derive_kl,
    "elastic_net": _derive_elastic_net,
    "bregman": _derive_bregman,
}


def derive_retention(retention: Retention) -> RetentionRule:
    """The closed-form step of `retention` and its torch source.

    Raises `DerivationError` when the step cannot be derived (e.g. a Bregman potential whose
    F' sympy cannot invert under `solver: closed_form`)."""
    if retention.derivation not in DERIVATIONS:
        raise DerivationError(
            f"retention {retention.kind!r}: no derivation {retention.derivation!r}; known: "
            f"{', '.join(DERIVATIONS)}"
        )
    steps, step = DERIVATIONS[retention.derivation](retention)
    fixed = fixed_values(retention)
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
    steps = tuple(steps)
    try:
        source = retention_source(retention, step, gates)
    except UnsupportedExpression as err:
        raise DerivationError(
            f"retention {retention.kind}: the step W_t = {_short(step)} has no torch form ({err})"
        ) from None
    return RetentionRule(
        retention.kind,
        steps,
        step,
        gates,
        source=source,
        display=retention_text(retention.kind, steps),
        display_latex=retention_latex(retention.kind, steps),
    )


def _short(expr: sp.Basic, keep: int = 200) -> str:
    text = sp.sstr(expr)
    return text if len(text) <= keep else text[:keep] + "..."


# (retention class, its fields as JSON) -> derive's refusal, or None: a spec is validated
# again on every load and copy.
_DERIVABLE: dict[tuple[type, str], str | None] = {}


def check_derivable(retention: Retention) -> None:
    """Raise a ValueError with derive's message when `retention`'s step cannot be derived, so
    that validating a spec refuses what `miras derive` would (a retention's model validator
    calls it). No torch: derivation is sympy alone."""
    key = (type(retention), retention.model_dump_json())
    if key not in _DERIVABLE:
        try:
            _screen(retention)
            derive_retention(retention)
            _DERIVABLE[key] = None
        except DerivationError as err:
            _DERIVABLE[key] = str(err)
    if _DERIVABLE[key] is not None:
        raise ValueError(_DERIVABLE[key])


def _screen(retention: Retention) -> None:
    """Refuse at once a separable step that no torch form can write: a solve without sympy's
    checks or simplification (tenths of a second), reparameterized and printed. Only the
    full derivation (seconds: `solve` verifies every solution) decides that a step works; this
    decides only that none does, as for a generator whose step needs LambertW."""
    if retention.derivation != "separable":
        return
    stationarity = sp.expand(sp.diff(retention.objective(), w))
    try:
        solutions = sp.solve(stationarity, w, check=False, simplify=False)
    except NotImplementedError:
        return  # the full derivation words the refusal
    gates = tuple(retention.gates())
    reparameterization = retention.reparameterization()
    errors = []
    for solution in solutions:
        step = solution.subs(reparameterization).subs(fixed_values(retention))
        try:
            retention_source(retention, step, gates)
        except UnsupportedExpression as err:
            errors.append((step, err))
        else:
            return
    if solutions and len(errors) == len(solutions):
        step, err = errors[0]
        raise DerivationError(
            f"retention {retention.kind}: the step W_t = {_short(step)} has no torch form ({err})"
        )
