"""Retention pass, verification: a derived step against the objective it minimizes.

`check_retention` runs the emitted `retention_step` on random inputs and tests it twice: the
autograd gradient of the printed objective vanishes there (projected for kl, the subgradient
condition at exact zeros for an l1 term), and it equals a numerical minimizer. Then, in float32
and in float64, the step at previous states across the whole range the dtype represents (tiny
and huge magnitudes of both signs, wherever the objective is finite) against a float64
minimizer: a step that cancels or overflows far from 0 fails there. A soft-thresholding step
is sampled on each of its branches, and the check says how many entries hit each.
"""

from __future__ import annotations

import math

import sympy as sp
import torch

from miras.derive import numerics
from miras.derive.check import CheckResult, max_relative_error
from miras.derive.emit import function_source, load_module, module_source
from miras.derive.memo import Memo
from miras.derive.protocols import RetentionParts
from miras.derive.retention_emit import objective_source
from miras.derive.symbols import soft_threshold, u
from miras.errors import DerivationError
from miras.ir import RetentionRule

SHAPE = (3, 4, 5, 6)  # [B, H, Dv, Dphi]: the last axis is a row (KL's simplex)
# (stationarity, argmin) tolerances: autograd is exact up to rounding; a numerical minimizer
# of a function that is flat at its minimum finds it to about sqrt(machine epsilon).
TOLERANCES = {torch.float64: (1e-8, 1e-6), torch.float32: (1e-3, 1e-2)}
# The range check: rows of ROW entries, one magnitude class per row (a row spans a factor 1.5
# for real states, a decade for positive ones, so kl's rows mix magnitudes).
ROW = SHAPE[-1]
RANGE_ROWS = 48  # magnitudes per sign (real) or per end (unit interval)
RANGE_DTYPES = (torch.float32, torch.float64)
# soft_threshold(z, t) branches: z = r t with r drawn per third of the entries from these.
BRANCHES = {"z > t": (1.1, 3.0), "z < -t": (-3.0, -1.1), "|z| <= t (W_t = 0)": (-0.9, 0.9)}


def check_retention(
    retention: RetentionParts, rule: RetentionRule, *, dtype=torch.float64, seed: int = 0
) -> list[CheckResult]:
    """The derived step against the objective it minimizes, on random inputs of shape SHAPE:
    the objective's autograd gradient vanishes at W_t (projected on the row constraint for kl,
    the subgradient condition at exact zeros for an l1 term), and W_t equals a numerical
    minimizer (golden section per entry; L-BFGS over each row's logits for kl). A
    soft-thresholding step gets a third of the entries on each branch ("branches" names the
    counts). Then, whatever `dtype`, "range (float32)" and "range (float64)": the step at
    `range_states` against a float64 minimizer. Every minimizer is `miras.derive.numerics`':
    by values (golden section, L-BFGS) here, independent of the stationarity piece; by the
    slope's root (safeguarded Newton, kl's row multiplier) in the range stage."""
    if dtype not in TOLERANCES:
        raise ValueError(f"dtype: expected one of {list(TOLERANCES)}, got {dtype}")
    stationary_tol, argmin_tol = TOLERANCES[dtype]
    threshold = _threshold_branches(rule)
    module = load_module(
        module_source(
            f"retention {rule.kind}: step and objective",
            [rule.source, *objective_source(retention, rule.gates), *threshold],
        )
    )
    gen = torch.Generator().manual_seed(seed)
    w0_ = sample_state(retention, SHAPE, dtype, gen)
    u_ = 0.5 * torch.randn(SHAPE, dtype=dtype, generator=gen)
    gates = list(sample_gates(retention, SHAPE, dtype, gen).values())
    if threshold:
        u_ = _branch_updates(module, w0_, gates, gen)
    new = module.retention_step(w0_, u_, *gates)

    def objective(x: torch.Tensor) -> torch.Tensor:
        return module.retention_objective(x, w0_, u_, *gates)

    accumulator = retention.read_norm() is not None
    where = "accumulator A_t" if accumulator else "W_t"
    results = [_stationarity(retention, module, objective, new, w0_, u_, gates, stationary_tol)]
    if retention.simplex_rows:
        numeric = numerics.lbfgs_argmin_rows(objective, w0_, retention.row_sum())
        method = "L-BFGS over each row's logits"
        row_sums = new.sum(-1)
        error = max_relative_error(row_sums, torch.full_like(row_sums, retention.row_sum()))
        results.append(
            CheckResult(
                f"rows: W_t > 0 and each row sums to c = {retention.row_sum():g}",
                error if bool((new > 0).all()) else math.inf,
                stationary_tol,
            )
        )
    else:
        numeric = numerics.golden_section_argmin(objective, w0_, u_, retention.domain())
        method = "golden section per entry"
    results.append(
        CheckResult(
            f"argmin: derived {where} vs a numerical minimizer ({method})",
            max_relative_error(new, numeric),
            argmin_tol,
        )
    )
    if accumulator:
        # The component's hand-written read, independent of the emitted source.
        results.append(
            CheckResult(
                "read: retention_read(A) vs A / ||A||_q^(q-2) per matrix",
                max_relative_error(module.retention_read(new), retention.reference_read(new)),
                stationary_tol,
            )
        )
    if threshold:
        results.append(_branch_counts(new))
    gen = torch.Generator().manual_seed(seed + 1)
    results += [
        _range_check(retention, module, where, range_dtype, gen) for range_dtype in RANGE_DTYPES
    ]
    return results


# Branches of a soft-thresholding step -----------------------------------------------------------


# A derived rule -> its branch updates' source: solved once, however often the rule is checked
# (the compile's check pass, `rule.check()`, `miras check`).
_BRANCH_UPDATES: Memo[list[str]] = Memo("branch updates")


def _threshold_branches(rule: RetentionRule) -> list[str]:
    """For a step soft_threshold(z, t): the source of `check_branch_update(w0, r, *gates)`, the
    u that puts z at r t (z is affine in u: the objective's <u, W>). Empty for other steps."""
    if not isinstance(rule.step, soft_threshold):
        return []
    return list(_BRANCH_UPDATES.get(rule, lambda: _branch_update_source(rule)))


def _branch_update_source(rule: RetentionRule) -> list[str]:
    z, t = rule.step.args
    r = sp.Symbol("r", real=True)
    solutions = sp.solve(z - r * t, u)
    if len(solutions) != 1:
        raise DerivationError(
            f"retention {rule.kind}: the check needs the u that puts {z} at r*{t}; sympy found "
            f"{len(solutions)} solutions"
        )
    args = ["w0", "r", *rule.gates]
    return [function_source("check_branch_update", args, solutions[0])]


def _branch_updates(module, w0_: torch.Tensor, gates, generator) -> torch.Tensor:
    """u per entry such that a third of the entries fall on each branch of BRANCHES."""
    flat = torch.rand(w0_.numel(), dtype=w0_.dtype, generator=generator)
    which = torch.arange(w0_.numel()) % len(BRANCHES)
    r = torch.empty_like(flat)
    for i, (lo, hi) in enumerate(BRANCHES.values()):
        r[which == i] = lo + (hi - lo) * flat[which == i]
    return module.check_branch_update(w0_, r.reshape(w0_.shape), *gates)


def _branch_counts(new: torch.Tensor) -> CheckResult:
    """How many entries of W_t = soft_threshold(z, t) came from each branch (z > t gives
    W_t > 0, z < -t gives W_t < 0, |z| <= t gives 0); fails if a branch got none."""
    counts = [int((new > 0).sum()), int((new < 0).sum()), int((new == 0).sum())]
    shown = ", ".join(f"{name} at {n}" for name, n in zip(BRANCHES, counts, strict=True))
    piece = (
        f"branches: soft_threshold(z, t) sampled on every branch: {shown} of {new.numel()} entries"
    )
    return CheckResult(piece, 0.0 if min(counts) > 0 else math.inf, 0.0)


# The whole range of states ---------------------------------------------------------------------


def range_states(retention: RetentionParts, dtype) -> torch.Tensor:
    """Previous states [2 RANGE_ROWS, ROW] across what `dtype` represents in the retention's
    domain: magnitudes log-spaced from 1e-3 to near the largest float (and 1 to 100 linearly),
    both signs (real); from near the smallest normal float to near the largest (positive);
    p and 1 - p for p from the smallest normal float to 1/2 (unit interval)."""
    info = torch.finfo(dtype)
    top, bottom = math.log10(info.max) - 0.5, math.log10(info.tiny) + 0.5
    j = torch.arange(ROW, dtype=torch.float64)
    domain = retention.domain()
    if domain == "real":
        dense = RANGE_ROWS // 4  # rows from 1 to 100, where exponentials overflow
        magnitudes = torch.cat(
            [
                torch.logspace(-3, top, RANGE_ROWS - dense, dtype=torch.float64),
                torch.linspace(1, 100, dense, dtype=torch.float64),
            ]
        )
        rows = magnitudes[:, None] * (1 + j / 10)
        states = torch.cat([rows, -rows])
    elif domain == "positive":
        # kl's rows lie on the simplex scaled by c: its entries are at most c.
        if retention.simplex_rows:
            top = math.log10(retention.row_sum()) - 1
        magnitudes = torch.logspace(bottom, top - 1, 2 * RANGE_ROWS, dtype=torch.float64)
        states = magnitudes[:, None] * 10 ** (j / (ROW - 1))
    else:
        p = torch.logspace(bottom, math.log10(0.5), RANGE_ROWS, dtype=torch.float64)
        rows = p[:, None] * (1 - j / (2 * ROW))
        states = torch.cat([rows, 1 - rows])
    return states.to(dtype)


def _range_check(retention, module, where: str, dtype, generator) -> CheckResult:
    """The step in `dtype` at `range_states`, against a float64 minimizer of the objective at
    the same (rounded) inputs, over the rows where the objective is finite in `dtype`."""
    w0_ = range_states(retention, dtype)
    shape = w0_.shape
    u_ = 0.5 * torch.randn(shape, dtype=dtype, generator=generator)
    # u is not aimed at soft_threshold's branches here: u = a w0 - r t would cancel in the
    # inputs at large w0 (the core sample covers the branches).
    gates = list(sample_gates(retention, shape, dtype, generator).values())
    keep = _representable(retention, module, w0_, u_, gates)
    name = str(dtype).removeprefix("torch.")
    tolerance = TOLERANCES[dtype][1]
    if not bool(keep.any()):
        piece = f"range ({name}): no previous state where the objective is finite"
        return CheckResult(piece, math.inf, tolerance)
    w0_, u_ = w0_[keep], u_[keep]
    gates = [g[keep] for g in gates]
    new = module.retention_step(w0_, u_, *gates)
    wide = [x.double() for x in (w0_, u_, *gates)]

    def objective(x: torch.Tensor) -> torch.Tensor:
        return module.retention_objective(x, *wide)

    if retention.simplex_rows:
        numeric = numerics.argmin_rows(objective, wide[0], wide[1], retention.row_sum())
    else:
        numeric = numerics.argmin_separable(objective, wide[0], wide[1], retention.domain())
    method = "safeguarded Newton on dJ/dw per entry"
    if retention.simplex_rows:
        method += " + mu, and on mu for each row sum"
    finite = torch.isfinite(new)
    error = max_relative_error(new.double(), numeric) if bool(finite.all()) else math.inf
    lo, hi = float(w0_.min()), float(w0_.max())
    bad = "" if bool(finite.all()) else f"; {int((~finite).sum())} non-finite entries"
    piece = (
        f"range ({name}): derived {where} at {w0_.numel()} previous states in "
        f"[{lo:.3g}, {hi:.3g}] (where the objective is finite in {name}) vs a float64 "
        f"numerical minimizer ({method}){bad}"
    )
    return CheckResult(piece, error, tolerance)


def _representable(retention, module, w0_, u_, gates) -> torch.Tensor:
    """Rows [R] where the objective and its gradient are finite at w0 and at w0 -+ (1 + |w0| +
    |u|) (real states; positive ones: above), in the check's dtype and in float64."""
    spread = 1 + w0_.abs() + u_.abs()
    points = [w0_]
    domain = retention.domain()
    if domain == "real":
        points += [w0_ - spread, w0_ + spread]
    elif domain == "positive":
        points += [w0_ + spread]
    ok = torch.ones(w0_.shape[0], dtype=torch.bool)
    for cast in (lambda x: x, torch.Tensor.double):
        args = [cast(x) for x in (w0_, u_, *gates)]
        for point in points:
            x = cast(point).detach().requires_grad_()
            value = module.retention_objective(x, *args)
            (grad,) = torch.autograd.grad(value.sum(), x)
            finite = torch.isfinite(value) & torch.isfinite(grad) & torch.isfinite(x)
            ok &= finite.all(-1)
    return ok


def sample_state(retention: RetentionParts, shape, dtype, generator) -> torch.Tensor:
    """A random previous state inside the retention's domain."""
    x = torch.randn(shape, dtype=dtype, generator=generator)
    domain = retention.domain()
    if domain == "positive":
        return torch.exp(0.5 * x)
    if domain == "unit_interval":
        return torch.sigmoid(x)
    return x


def sample_gates(retention: RetentionParts, shape, dtype, generator) -> dict[str, torch.Tensor]:
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
    if retention.simplex_rows:
        # Lagrangian J + mu (sum_j w_j - c): at the optimum dJ/dw_j = -mu on the whole row, so
        # the gradient minus its row mean (the projection on the constraint) vanishes.
        error = float((grad - grad.mean(-1, keepdim=True)).abs().max())
        piece = "stationarity: autograd grad of the objective at W_t, projected on each row sum"
        return CheckResult(piece, error, tolerance)
    if not hasattr(module, "retention_l1_weight"):
        what = "A_t" if retention.read_norm() is not None else "W_t"
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
