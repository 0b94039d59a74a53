"""The affine analysis: is the whole step affine in the memory state? Then `backend="chunk"`
solves each chunk exactly (docs/chunking.md, "The exact form"); otherwise it takes every
gradient in a chunk at the chunk-start state.

The step is affine in (W, S) when
- the memory is a matrix, so y = W phi(k) is linear in W;
- the bias's dL/dy_j is affine in y_j: its derivative in y (the slope d2L/dy_j^2, proved
  symbolically from the derived gradient) does not depend on y, and no channel sum of the
  error enters it (that would couple the value channels);
- the retention step is W_t = a_t W_{t-1} - u_t and the optimizer's update is linear in the
  gradient, as the compiler proved and recorded (`miras.derive.linear_step`, the IR's
  `LinearStep`: none or l2, either gradient point; gd, momentum, Nesterov; Muon's
  Newton-Schulz is not linear);
- the feature map reads only the keys and queries (every feature map does);
- the window (any c, gamma fixed or gated) sums affine terms.
Gates may be per head or per value channel: a per-channel gate scales rows of W [Dv, Dphi],
and a per-channel slope scales rows of the prediction, so each row of W runs its own affine
recurrence and the exact form solves one system per channel.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import sympy as sp

from miras.derive.bias_derive import derive_bias
from miras.derive.formula import MAX_SIMPLIFY_OPS, bounded_simplify, not_finite, value_at
from miras.derive.linear_step import derive_linear_step, retention_decay
from miras.derive.memo import Memo, component_key
from miras.derive.symbols import e, gate_symbol, v, y
from miras.ir import BiasRule, ChunkForm, LinearStep, RetentionRule

if TYPE_CHECKING:  # annotations only: a bias's own slope (`slope_of`) is asked for while
    # its spec is validated, so this module names the spec by what it offers (`SpecParts`)
    from miras.derive.protocols import BiasParts, SpecParts


def _start(reason: str) -> ChunkForm:
    return ChunkForm("start", reason)


def bias_slope(spec: SpecParts, rule: BiasRule) -> tuple[sp.Expr | None, str]:
    """(slope, "") with slope = d(dL/dy_j)/dy_j free of y, fixed parameters substituted; or
    (None, why not) when dL/dy is not affine in y or couples the value channels."""
    return slope_of(spec.bias, rule)


# (bias class, fields, its derived rule) -> its slope: validation (a formula's constant
# slope), the plan and the chunk_form pass ask it of one bias; it is proved once.
SLOPES: Memo[tuple[sp.Expr | None, str]] = Memo("slope")


def slope_of(bias: BiasParts, rule: BiasRule) -> tuple[sp.Expr | None, str]:
    """`bias_slope` of one bias and its derived rule; proved once per (bias, rule)."""
    return SLOPES.get((*component_key(bias), rule), lambda: _slope(bias, rule))


def _slope(bias: BiasParts, rule: BiasRule) -> tuple[sp.Expr | None, str]:
    name = bias.label()
    fixed = {gate_symbol(n): sp.nsimplify(x) for n, x in bias.fixed().items()}
    gradient = rule.gradient.subs(fixed).subs(e, y - v)
    for _, term in rule.sums:  # a sum of v alone is a per-vector constant: allowed
        if term.subs(e, y - v).has(y):
            return None, (
                f"the gradient of {name} reads sum_j({term}), a channel sum of the "
                "prediction, so it couples the value channels"
            )
    not_affine = f"the gradient of {name}, dL/dy = {rule.gradient}, is not affine in y"
    slope = sp.diff(gradient, y)
    # Most gradients that are not affine show it at a few numbers, cheaply; simplify (which can
    # take minutes on a large slope) only proves that one which looks constant in y is so.
    if slope.has(y) and _varies_in_y(slope):
        return None, not_affine
    simplified = bounded_simplify(slope)
    if simplified is None and slope.has(y):
        return None, f"{not_affine} (too large to prove affine: over {MAX_SIMPLIFY_OPS} operations)"
    slope = slope if simplified is None else simplified
    if slope.has(y):
        return None, not_affine
    # A numerically tiny y term (e**4 * 1e-9) is still a y term: the check above is exact.
    rest = gradient - slope * y
    if rest.has(y):
        rest = bounded_simplify(rest)
        if rest is None or rest.has(y):
            return None, not_affine
    return slope, ""


# (y, v, each gate or channel sum) points where a slope that depends on y shows it.
_PROBES = ((0.3, 0.4, 0.7), (1.7, 0.4, 0.7), (-1.1, 0.4, 0.7))


def linear_record(spec: SpecParts) -> tuple[LinearStep | None, str]:
    """`derive_linear_step` of `spec`, for a caller without the compiled rule (the linear_step
    pass has it already); its retention's step is the cached derivation."""
    return derive_linear_step(spec, _retention_rule(spec))


def _retention_rule(spec: SpecParts) -> RetentionRule:
    from miras.derive.retention_derive import derive_retention

    return derive_retention(spec.retention)


def _varies_in_y(slope: sp.Expr) -> bool:
    """True when `slope` takes two different finite values at the probes (one v, several y)."""
    others = slope.free_symbols - {y, v}
    values = []
    for at_y, at_v, at_other in _PROBES:
        value = value_at(slope, {y: at_y, v: at_v, **{s: at_other for s in others}})
        if not_finite(value) is None and value.is_number and value.is_real:
            values.append(float(value))
    return any(abs(a - values[0]) > 1e-9 * (1 + abs(a)) for a in values)


def start_path(spec: SpecParts, step: LinearStep | None) -> str:
    """How the chunk-start form runs `spec`: "linear" (masked matmuls, no per-token state)
    when the memory is linear in its weights and the whole step is linear (`step`, the
    compiler's record); "general" otherwise, and for a step size per key channel (the
    preconditioned optimizer's), which scales W's columns where the linear path scales rows."""
    if spec.optimizer.preconditioned:
        return "general"
    return "linear" if spec.memory.linear and step is not None else "general"


_DERIVE = object()  # `analyze`'s default: derive the linear step here


def analyze(
    spec: SpecParts,
    bias: BiasRule | None = None,
    step=_DERIVE,
    retention: RetentionRule | None = None,
) -> ChunkForm:
    """Decide the chunk form of `spec` from its components, derived bias gradient, linear
    step (`LinearStep` or None, as the linear_step pass recorded it) and derived retention
    step, with the path its chunk-start form takes (also run when `chunk_mode="start"` asks
    for it). The chunk_form pass gives all three from the compiled rule; a caller without
    one gets the cached derivations."""
    if step is _DERIVE:
        retention = retention or _retention_rule(spec)
        step, _ = derive_linear_step(spec, retention)
    return replace(_form(spec, bias, step, retention), start_path=start_path(spec, step))


def _form(
    spec: SpecParts,
    bias: BiasRule | None,
    step: LinearStep | None,
    retention_rule: RetentionRule | None,
) -> ChunkForm:
    memory = spec.memory
    if (closed := memory.closed_form()) is not None:
        return ChunkForm("exact", f"{closed} is computed in closed form; nothing to chunk")
    if not memory.linear:
        return _start(f"the {memory.kind} memory's prediction is not linear in its weights")
    retention = spec.retention
    optimizer = spec.optimizer
    if step is None and retention_decay(spec, retention_rule or _retention_rule(spec))[0] is None:
        return _start(
            f"the {retention.kind} retention's step is not one the exact form solves (none or "
            "l2: W_t = a_t W_(t-1) - u_t)"
        )
    if step is None:
        return _start(
            f"the {optimizer.kind} optimizer's update is not one the exact form solves (gd, "
            "momentum or nesterov: linear in the gradient)"
        )
    rule = derive_bias(spec.bias) if bias is None else bias
    slope, why = bias_slope(spec, rule)
    if slope is None:
        return _start(why)

    reads_v = bool(slope.free_symbols - {gate_symbol(n) for n in spec.bias.gates()})
    constant = float(slope) if slope.is_number else None
    if constant == 0.0:
        pieces = ["dL/dy does not depend on W (a Hebbian update)"]
    else:
        pieces = [f"dL/dy is affine in y with slope {slope}"]
    pieces.append(f"retention {retention.kind}")
    pieces.append(f"optimizer {optimizer.kind}")
    if spec.window.c != 1:
        pieces.append(f"window c = {spec.window.c}")
    reason = "the step is affine in W: matrix memory, " + ", ".join(pieces)
    return ChunkForm("exact", reason, slope=constant, slope_reads_v=reads_v)
