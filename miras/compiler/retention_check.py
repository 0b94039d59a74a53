"""Retention pass, verification: a derived step against the objective it minimizes.

`check_retention` runs the emitted `retention_step` on random inputs and tests it twice: the
autograd gradient of the printed objective vanishes there (projected for kl, the subgradient
condition at exact zeros for an l1 term), and it equals a numerical minimizer.
"""

from __future__ import annotations

import math

import torch

from miras.check import CheckResult, max_relative_error
from miras.compiler.emit import load_module, module_source
from miras.compiler.retention_emit import objective_source
from miras.components.base import Retention
from miras.ir import RetentionRule

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
            [rule.source, *objective_source(retention, rule.gates)],
        )
    )
    gen = torch.Generator().manual_seed(seed)
    w0_ = sample_state(retention, SHAPE, dtype, gen)
    u_ = 0.5 * torch.randn(SHAPE, dtype=dtype, generator=gen)
    gates = list(sample_gates(retention, SHAPE, dtype, gen).values())
    new = module.retention_step(w0_, u_, *gates)

    def objective(x: torch.Tensor) -> torch.Tensor:
        return module.retention_objective(x, w0_, u_, *gates)

    accumulator = retention.read_norm() is not None
    where = "accumulator A_t" if accumulator else "W_t"
    results = [_stationarity(retention, module, objective, new, w0_, u_, gates, stationary_tol)]
    if retention.simplex_rows:
        numeric = _argmin_rows(objective, w0_, retention.row_sum())
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
        numeric = _argmin_entries(objective, w0_, u_, retention.domain())
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
    return results


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
