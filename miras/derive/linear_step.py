"""The linear-step analysis: is the whole step, retention after optimizer, linear in the
memory state and the gradient? Then it is recorded once, as a `miras.ir.LinearStep`, and every
fast form (the exact chunk form, the chunk-start form's linear path, the dual form, the Triton
kernels) unrolls the record's recurrences instead of a step written by hand.

    W_t = a_t W_{t-1} - u_t,   u_t = p_t S_t + q_t g_t,   S_t = theta_t S_{t-1} + beta_t g_t

Proved from the sympy each component states:
- the retention's derived step (`RetentionRule.step`, in w0, u and its gates, fixed values
  substituted) is a_t w0 - u with a_t free of w0 and u, and the state is read as it is (no
  accumulator read, no simplex rows, not a numerical solve, the real domain);
- the optimizer's `update_expressions` give u_t linear in (S_t, g_t) and S_t linear in
  (S_{t-1}, g_t), every coefficient free of them;
- each coefficient is a constant times a product of gates (so a form evaluates it from the
  gates it reads, fixed or per token).
The memory's own linearity (W phi(k)) is a separate question each form asks.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import sympy as sp

from miras.derive.memo import Memo, component_key
from miras.derive.protocols import StepOptimizer, StepParts, StepRetention
from miras.derive.symbols import g, gate_symbol, s_new, s_prev, u, w0
from miras.ir import Coefficient, LinearStep

if TYPE_CHECKING:  # annotations only
    from miras.ir import RetentionRule


# (retention class, fields, its derived rule) -> its proved decay: the linear_step pass, the
# chunk_form pass and the Triton emission ask it of one retention; it is proved once.
_DECAYS: Memo[tuple[Coefficient | None, str]] = Memo("decay")


def retention_decay(spec: StepParts, retention: RetentionRule) -> tuple[Coefficient | None, str]:
    """(a_t, "") where the retention's step is W_t = a_t W_{t-1} - u_t, else (None, why not)."""
    kept = spec.retention
    key = (*component_key(kept), retention)
    return _DECAYS.get(key, lambda: _prove_decay(kept, retention))


def _prove_decay(kept: StepRetention, retention: RetentionRule) -> tuple[Coefficient | None, str]:
    not_read = _reads_state_as_is(kept)
    if not_read:
        return None, not_read
    names = {"retention": kept.gateable}
    a, why = _linear_in(retention.step, (w0, u), names)
    if a is None:
        return None, f"the {kept.kind} retention's step W_t = {retention.step} {why}"
    decay, minus_one = a
    if not (minus_one.constant == -1.0 and not minus_one.gates):
        return None, (
            f"the {kept.kind} retention's step W_t = {retention.step} scales u_t by "
            f"{minus_one.text()}, not -1"
        )
    return decay, ""


def derive_linear_step(spec: StepParts, retention: RetentionRule) -> tuple[LinearStep | None, str]:
    """(the record, "") where the composed step is linear, else (None, why not)."""
    decay, why = retention_decay(spec, retention)
    if decay is None:
        return None, why
    return linear_update(spec, decay)


def linear_update(
    spec: StepParts, decay: Coefficient | None = None
) -> tuple[LinearStep | None, str]:
    """The optimizer's half alone: (the record with `decay` as a_t, "") where the update is
    linear in the state and the gradient, whatever the retention (`decay` None: a_t = 1, for
    a reader of the update only, such as the Triton templates' optimizer lines)."""
    return optimizer_update(spec.optimizer, decay)


# (optimizer class, its fields as JSON) -> its proved update with a_t = 1: components ask
# for it (`Optimizer.linear_form`) on every compile.
_UPDATES: Memo[tuple[LinearStep | None, str]] = Memo("update")


def optimizer_update(
    opt: StepOptimizer, decay: Coefficient | None = None
) -> tuple[LinearStep | None, str]:
    """`linear_update` of one optimizer component."""
    step, why = _UPDATES.get(component_key(opt), lambda: _prove_update(opt))
    if step is None or decay is None:
        return step, why
    return replace(step, decay=decay), why


def _prove_update(opt: StepOptimizer) -> tuple[LinearStep | None, str]:
    decay = Coefficient(1.0)
    names = {"optimizer": opt.gateable}
    expressions = opt.update_expressions()
    if expressions is None:
        return None, f"the {opt.kind} optimizer's update is not one elementwise expression"
    update, state = expressions
    if (state is None) == opt.stateful:
        return None, (
            f"the {opt.kind} optimizer is {'' if opt.stateful else 'not '}stateful but its "
            f"update_expressions give {'no' if state is None else 'a'} state"
        )
    if state is None:
        found, why = _linear_in(update, (g,), names)
        if found is None:
            return None, f"the {opt.kind} optimizer's update u_t = {update} {why}"
        return LinearStep(decay, found[0]), ""
    found, why = _linear_in(update, (s_new, g), names)
    if found is None:
        return None, f"the {opt.kind} optimizer's update u_t = {update} {why}"
    kept_state, why = _linear_in(state, (s_prev, g), names)
    if kept_state is None:
        return None, f"the {opt.kind} optimizer's state s_t = {state} {why}"
    (p, q), (theta, beta) = found, kept_state
    return LinearStep(decay, q, from_state=p, state_decay=theta, state_input=beta), ""


def _reads_state_as_is(retention: StepRetention) -> str:
    """Why the forms cannot read the state a linear step keeps, or "" when they can."""
    if retention.read_norm() is not None:
        return f"the {retention.kind} retention's state is an accumulator read through a norm"
    if retention.simplex_rows or retention.domain() != "real":
        return f"the {retention.kind} retention keeps the state in the {retention.domain()} domain"
    if retention.solved_by_newton():
        return f"the {retention.kind} retention's step is solved numerically"
    return ""


def _linear_in(
    expr: sp.Expr, variables: tuple[sp.Symbol, ...], names: dict[str, dict]
) -> tuple[tuple[Coefficient, ...] | None, str]:
    """(one coefficient per variable, "") when `expr` = sum_i c_i x_i exactly, each c_i a
    constant times gates; else (None, why not)."""
    expr = sp.expand(expr)
    coefficients = []
    rest = expr
    for x in variables:
        c = sp.diff(expr, x)
        if c.free_symbols & set(variables):
            return None, f"is not linear in {x}"
        coefficients.append(c)
        rest = rest - c * x
    if sp.simplify(rest) != 0:
        return None, f"has a term {sp.simplify(rest)} free of {', '.join(map(str, variables))}"
    found = []
    for c in coefficients:
        monomial = _monomial(sp.simplify(c), names)
        if monomial is None:
            return None, f"has the coefficient {c}, not a constant times gates"
        found.append(monomial)
    return tuple(found), ""


def _monomial(c: sp.Expr, names: dict[str, dict]) -> Coefficient | None:
    """`c` as a constant times a product of gate symbols (integer powers), or None."""
    symbols = {gate_symbol(n): (field, n) for field, gateable in names.items() for n in gateable}
    constant, factors = c.as_coeff_mul()
    if not constant.is_number:
        return None
    gates: list[tuple[str, str]] = []
    for factor in factors:
        base, power = factor.as_base_exp()
        if base not in symbols or not (power.is_Integer and power > 0):
            return None
        gates += [symbols[base]] * int(power)
    return Coefficient(float(constant), tuple(gates))


__all__ = [
    "StepOptimizer",
    "StepParts",
    "StepRetention",
    "derive_linear_step",
    "linear_update",
    "optimizer_update",
    "retention_decay",
]
