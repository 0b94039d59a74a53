"""Retention pass, derivation: the closed-form argmin of MIRAS's Learning-Retaining objective.

    W_t = argmin_W <u_t, W> + (1/eta_t) D(W, W_{t-1}) + (1/alpha_t) G(W)

Each retention states its objective for one entry w of W (`objective()`), how (eta, alpha)
become its gates (`reparameterization()`), and derives its step with sympy (`derive_step()`),
one strategy per shape of objective, each written with its retention:

    smooth, separable (none, l2, f_divergence)  solve d/dw = 0 (the default,
                                                miras.derive.retention_solve)
    lq                                          the l2 step on an accumulator, then its read
    with |w| (elastic_net)                      subgradient cases w > 0, w < 0, w = 0
    on a scaled simplex per row (kl)            Lagrange multiplier, fixed by the row sum
    Bregman (bregman)                           invert F'(w) = F'(w0) - u (or Newton steps)

This pass runs the component's strategy, substitutes the fixed values and emits the step.

The result is a `miras.ir.RetentionRule`: the derivation's steps (and their display), the
step, and the torch source of `retention_step(w0, u, *gates)` and `retention_read(state)`
(written by `miras.derive.retention_emit`); `miras.derive.retention_check` tests it against
autograd and a numerical minimizer. The derivations are written out in docs/retention.md.
"""

from __future__ import annotations

import sympy as sp

from miras.derive.describe import latex_block, latex_math, latex_text
from miras.derive.memo import Memo, component_key
from miras.derive.printer import UnsupportedExpression
from miras.derive.protocols import RetentionParts
from miras.derive.retention_emit import fixed_values, retention_source
from miras.derive.retention_solve import equations
from miras.derive.retention_solve import solve_unique as _solve_unique  # noqa: F401 (tests)
from miras.derive.symbols import gate_symbol, u, w, w0
from miras.errors import DerivationError
from miras.ir import RetentionRule, Step


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


# Retention (class, fields) -> its derived rule or refusal: validation (`check_derivable`),
# the passes and every spec with an equal retention share one derivation (miras.derive.memo).
RETENTIONS: Memo[RetentionRule] = Memo("retention")


def derive_retention(retention: RetentionParts) -> RetentionRule:
    """The closed-form step of `retention` and its torch source; derived once per retention
    (its class and fields), then read from `RETENTIONS`.

    Raises `DerivationError` when the step cannot be derived (e.g. a Bregman potential whose
    F' sympy cannot invert under `solver: closed_form`)."""
    return RETENTIONS.get(component_key(retention), lambda: _derive(retention))


def _derive(retention: RetentionParts) -> RetentionRule:
    steps, step = retention.derive_step()
    fixed = fixed_values(retention)
    if fixed:
        steps.append(("fixed values", equations(fixed)))
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


# Retention (class, fields) -> derive's refusal, or None: a spec is validated again on every
# load and copy. A retention that passes is derived in `RETENTIONS`, where compile finds it.
_DERIVABLE: Memo[str | None] = Memo("derivable")


def check_derivable(retention: RetentionParts) -> None:
    """Raise a ValueError with derive's message when `retention`'s step cannot be derived, so
    that validating a spec refuses what `miras derive` would (a retention's model validator
    calls it). No torch: derivation is sympy alone."""

    key = component_key(retention)

    def refusal() -> str | None:
        try:
            if RETENTIONS.peek(key) is None:  # derived already: nothing to screen
                _screen(retention)
            derive_retention(retention)
        except DerivationError as err:
            return str(err)
        return None

    why = _DERIVABLE.get(key, refusal)
    if why is not None:
        raise ValueError(why)


def _screen(retention: RetentionParts) -> None:
    """Refuse at once a separable step that no torch form can write: a solve without sympy's
    checks or simplification (tenths of a second), reparameterized and printed. Only the
    full derivation (seconds: `solve` verifies every solution) decides that a step works; this
    decides only that none does, as for a generator whose step needs LambertW."""
    if not retention.derives_separably():
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
