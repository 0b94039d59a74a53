"""The numerics every solve of the project shares: one definition of each routine.

    root finding (per entry, batched: any shape, float32 or float64)
        expand_bracket(f, lo, hi, step)          slide [lo, hi] by doubling steps until f changes sign
        monotone_bracket(value, start, ...)      the first bracket, on the root's side of a start
        safeguarded_newton(fn, lo, hi, x, ...)   Newton inside a bracket, bisection where it fails
                                                 (newton_start, newton_iteration: one step of it)
        monotone_root(fn, start, to_s, from_s)   both, from a start point, in a domain's coordinate
    the domains of a retention's state ("real", "positive", "unit_interval")
        COORDINATES[domain]                      (to_s, from_s): the domain onto all reals and back
        SAMPLES[domain], inside(domain, x)       sample points, membership
        select_branches(candidates, domain)      which of several solution branches hold on it
    minimizers of an objective (the checks' references; autograd, never a derived formula)
        argmin_separable(objective, w0, u, domain)   per entry: the root of the slope
        argmin_rows(objective, w0, u, row_sum)       per row on a scaled simplex: the multiplier
        golden_section_argmin(objective, w0, u, domain), lbfgs_argmin_rows(objective, w0, row_sum)
                                                     by values only (independent of the slope)
        newton_minimize(objective, start)            a smooth objective of one flat vector

Who calls what: the emitted Bregman `solver: newton` step (`miras.derive.retention_emit`) is
`monotone_root` on F'(w) - z; the end-to-end oracle (`miras.checks.end_to_end`) and the retention
check's range stage (`miras.derive.retention_check`) find W_t with `argmin_separable` /
`argmin_rows`, and the piece check with the value-based minimizers; the proximal oracle and
the exact optimizer's check with `newton_minimize`; Bregman's closed-form inverse and the
separable derivation's choice among several roots (a log barrier) with `select_branches`. A
component may call any of them (docs/architecture.md, "Numerics for components").

The emitted code stays self-contained: its module imports only torch (`miras.ir`: "no
imports"; docs/compiler.md: what runs is exactly what `miras derive --code` prints, and the
module is cached by the hash of that text). So the emitter does not import this module; it
prints the source of the functions it calls, `inspect.getsource` of `expand_bracket`,
`monotone_bracket`, `newton_start`, `newton_iteration` and the domain's coordinate pair
(`printed_functions`), and the emitted module runs these very definitions. Its solve is
`monotone_root` with `safeguarded_newton`'s four-line loop written out, so that the Newton cap
(`newton_steps`) reads as the loop's bound in the printed code. Those functions therefore read
only torch, their arguments and each other; tests/derive/test_numerics.py holds the printed
text to this file and the emitted solve to `monotone_root`, bit for bit.

Imports only torch, math and the standard library: this module sits below everything else
(miras.derive imports nothing of miras.spec or miras.compiler; this file nothing of miras).
torch is imported inside each function that runs it, as the components do: a derivation that
only chooses a branch (`select_branches`, `SAMPLES`) while a spec validates loads no torch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: each function imports torch where it runs
    import torch

# The domains of a state entry -------------------------------------------------------------------


def real_coordinate(x):
    """The real line's own coordinate: s = w, w = s."""
    return x


def log_coordinate(w):
    """w > 0 onto the reals: s = log w."""
    import torch

    return torch.log(w)


def exp_coordinate(s):
    """The inverse of `log_coordinate`: w = exp(s) > 0."""
    import torch

    return torch.exp(s)


def logit_coordinate(w):
    """0 < w < 1 onto the reals: s = log w - log(1 - w)."""
    import torch

    return torch.log(w) - torch.log1p(-w)


def sigmoid_coordinate(s):
    """The inverse of `logit_coordinate`: w = sigmoid(s) in (0, 1)."""
    import torch

    return torch.sigmoid(s)


# domain -> (to_s, from_s). A root near a bounded domain's end keeps its relative precision when
# bracketed and bisected in s.
COORDINATES: dict[str, tuple[Callable, Callable]] = {
    "real": (real_coordinate, real_coordinate),
    "positive": (log_coordinate, exp_coordinate),
    "unit_interval": (logit_coordinate, sigmoid_coordinate),
}
# s(w) as a derivation shows it.
COORDINATE_TEXT = {"real": "w", "positive": "log(w)", "unit_interval": "log(w) - log(1 - w)"}

# Sample points inside each domain: where a branch of a solution is tested (`select_branches`),
# and where Bregman's potential is checked strictly convex.
SAMPLES: dict[str, tuple[float, ...]] = {
    "real": (-1.3, -0.4, 0.2, 0.9, 1.7),
    "positive": (0.1, 0.5, 1.3, 2.9),
    "unit_interval": (0.05, 0.3, 0.6, 0.93),
}


def inside(domain: str, x):
    """Whether x (a float, or a tensor elementwise) is a finite point of the domain."""
    if isinstance(x, (int, float)):
        if not math.isfinite(x):
            return False
        if domain == "positive":
            return x > 0
        if domain == "unit_interval":
            return 0 < x < 1
        return True
    import torch

    finite = torch.isfinite(x)
    if domain == "positive":
        return finite & (x > 0)
    if domain == "unit_interval":
        return finite & (x > 0) & (x < 1)
    return finite


def select_branches(
    candidates: Sequence[Callable[[object], complex | float | None]],
    domain: str,
    *,
    points: Sequence[object] | None = None,
    expected: Callable[[object], float] | None = None,
    tolerance: float = 1e-9,
) -> list[int]:
    """The indices of the branches that hold on the whole domain: at every sample point p
    (`points`, by default the domain's `SAMPLES`) `candidates[i](p)` is a number (None: the
    branch is undefined there), real to `tolerance`, a point of the domain and, given
    `expected`, within `tolerance` of `expected(p)`.

    A solve with several roots keeps those whose value lies in the retention's domain (a log
    barrier's quadratic stationarity has a positive and a negative root); an inverse keeps
    the branches that give the point back (Bregman's (F')^-1: candidate(F'(w_k)) = w_k). The
    caller evaluates its branches (sympy, torch) at the points; a point may be anything
    its candidates read (a float, a dict of symbol values)."""
    points = SAMPLES[domain] if points is None else points
    kept = []
    for index, candidate in enumerate(candidates):
        for point in points:
            value = candidate(point)
            if value is None:
                break
            value = complex(value)
            if abs(value.imag) > tolerance or not inside(domain, value.real):
                break
            if expected is not None and not abs(value - expected(point)) < tolerance:
                break
        else:
            kept.append(index)
    return kept


# Root finding ------------------------------------------------------------------------------------
# Printed into emitted modules (`PRINTED`): these read only torch, their arguments and each other.


def expand_bracket(f, lo, hi, step, iterations=1100):
    """Per entry, move [lo, hi] until f(lo) <= 0 <= f(hi), for f nondecreasing: where f(lo) > 0
    the bracket slides down to [lo - 2 step, lo], where f(hi) < 0 up to [hi, hi + 2 step], the
    step doubling each time (so any float is reached: 2**1024 overflows float64 within 1100
    doublings). f is evaluated at the ends only.

    An end where f is NaN while the other's is not (slid past the last point inside the
    domain: sigmoid(40) is 1.0, where log(1 - w) is -inf) comes back halfway, and the next slide
    is a quarter as long, so the bracket closes in on that edge instead of stopping on it; an
    entry whose f is NaN at both ends stays where it is."""
    import torch

    for _ in range(iterations):
        f_lo, f_hi = f(lo), f(hi)
        low, high = f_lo > 0, f_hi < 0
        mid = (lo + hi) / 2
        inner = (mid != lo) & (mid != hi)
        back_lo = torch.isnan(f_lo) & ~torch.isnan(f_hi) & ~high & inner
        back_hi = torch.isnan(f_hi) & ~torch.isnan(f_lo) & ~low & inner
        if not bool((low | high | back_lo | back_hi).any()):
            break
        step = torch.where(low | high, 2 * step, torch.where(back_lo | back_hi, step / 4, step))
        lo, hi = (
            torch.where(low, lo - step, torch.where(high, hi, torch.where(back_lo, mid, lo))),
            torch.where(high, hi + step, torch.where(low, lo, torch.where(back_hi, mid, hi))),
        )
    return lo, hi


def newton_start(lo, hi, x, from_s):
    """The state `newton_iteration` carries, at x inside the bracket [lo, hi] (in s):
    (x, lo, hi, the step before last, the last step, done). A NaN x is done at once."""
    import torch

    width = (from_s(hi) - from_s(lo)).abs()
    return x, lo, hi, width, width, torch.isnan(x)


def newton_iteration(fn, state, to_s, from_s, scale=0.0):
    """One iteration of `safeguarded_newton` on every entry that is not done: the state of
    `newton_start` in, the next state out."""
    import torch

    x, lo, hi, before_last, last, done = state
    eps = torch.finfo(x.dtype).eps
    f, df = fn(x)
    s = to_s(x)
    # x = from_s(mid) overflowed onto the domain's end (exp(800), sigmoid(40)): mid is its s.
    s = torch.where(torch.isinf(s), (lo + hi) / 2, s)
    lo, hi = torch.where(f < 0, s, lo), torch.where(f > 0, s, hi)
    newton = x - f / df
    # An infinite f' (1/w at a subnormal w in float32) makes the step 0, not converged.
    inside = (newton > from_s(lo)) & (newton < from_s(hi)) & torch.isfinite(df)
    fast = (newton - x).abs() <= before_last / 2
    bisection = from_s((lo + hi) / 2)
    # A Newton step below 2 eps |x| has converged: tested before the bracket, whose ends went
    # through s and back (a round trip that may cost more than that step).
    converged = (newton - x).abs() <= 2 * eps * torch.clamp(x.abs(), min=scale)
    converged = (f == 0) | (converged & torch.isfinite(df))
    proposal = torch.where(converged, x, torch.where(inside & fast, newton, bisection))
    moved = (proposal - x).abs()
    x = torch.where(done, x, proposal)
    small = moved <= 2 * eps * torch.clamp(x.abs(), min=scale)
    done = done | converged | small | (hi - lo <= 4 * eps * (1 + s.abs())) | torch.isnan(x)
    return x, lo, hi, last, moved, done


def safeguarded_newton(fn, lo, hi, x, to_s, from_s, scale=0.0, iterations=100):
    """Per entry, the root of f nondecreasing, bracketed by [lo, hi] in the coordinate
    s = to_s(x) (f(from_s(lo)) <= 0 <= f(from_s(hi))), from x inside it. `fn(x)` -> (f, f').

    Newton steps x - f/f' in x, each replaced by bisection in s where it leaves the bracket or
    does not halve the step before last (Numerical Recipes' rtsafe): it converges whatever f'
    does (f' = 0 or not finite gives a step that is not taken), and bisecting
    in s keeps relative precision near a bounded domain's end. Every iterate stays inside the
    bracket. Stops when every entry's Newton step is below 2 eps max(|x|, scale) (scale: an
    absolute floor, for roots near 0 on the scale of the problem), its move below that, or its
    bracket below 4 eps (1 + |s|) in s; after at most `iterations`.

    NaN: an entry whose iterate is NaN (a NaN start or bracket) stops at once and comes back
    NaN; one whose f is NaN at a finite iterate stops where it is (f tells no side: a root that
    rounds onto the domain's end, sigmoid(40) = 1.0 where log(1 - w) is -inf, comes back as
    that end). Neither holds up, nor changes, the other entries."""
    state = newton_start(lo, hi, x, from_s)
    for _ in range(iterations):
        state = newton_iteration(fn, state, to_s, from_s, scale)
        if bool(state[-1].all()):
            break
    return state[0]


def monotone_bracket(value, start, to_s, from_s, step=1.0, iterations=1100):
    """(lo, hi, x): a bracket in s of the root of f nondecreasing (`value(x)` -> f), and the
    point to start Newton from. The bracket starts on the side of s0 = to_s(start) where the
    root lies, [s0 - step, s0] or [s0, s0 + step], and grows by `expand_bracket`; x is the
    start, or the bracket's middle if the bracket moved off it. A start on the domain's edge
    (s0 infinite: a state that underflowed to 0) starts from s = 0."""
    import torch

    s0 = to_s(start)
    edge = torch.isinf(s0)
    s0 = torch.where(edge, torch.zeros_like(s0), s0)
    start = torch.where(edge, from_s(s0), start)
    step = step * torch.ones_like(s0)
    below = value(start) > 0  # f increases: the root lies below the start
    lo, hi = torch.where(below, s0 - step, s0), torch.where(below, s0, s0 + step)
    lo, hi = expand_bracket(lambda s: value(from_s(s)), lo, hi, step, iterations)
    return lo, hi, torch.where((lo <= s0) & (s0 <= hi), start, from_s((lo + hi) / 2))


def monotone_root(
    fn, start, to_s, from_s, value=None, step=1.0, scale=0.0, iterations=100, bracket_steps=1100
):
    """Per entry, the root of f nondecreasing over a domain, from `start` in it: `fn(x)` ->
    (f, f'); `value(x)` -> f alone where that is cheaper (the bracket needs no f'); (to_s,
    from_s) map the domain onto all reals (`COORDINATES`). `monotone_bracket`, then
    `safeguarded_newton`. `step`, `scale`: a number or a tensor per entry (the problem's scale
    for a real root); `iterations`: the Newton cap."""
    if value is None:

        def value(x):
            return fn(x)[0]

    lo, hi, x = monotone_bracket(value, start, to_s, from_s, step, bracket_steps)
    return safeguarded_newton(fn, lo, hi, x, to_s, from_s, scale, iterations)


# What an emitted module prints to run `monotone_root`'s two phases in a domain, with its
# Newton loop written out so that the cap is printed as the loop's bound (the emitter prints
# each function's source, in this order, after the functions that call it).
PRINTED = (expand_bracket, monotone_bracket, newton_start, newton_iteration)


def printed_functions(domain: str) -> tuple[Callable, ...]:
    """The functions whose source an emitted module holds to solve in `domain`: the
    coordinate pair (once, for the real line's identity), then `PRINTED`."""
    to_s, from_s = COORDINATES[domain]
    return (*dict.fromkeys((to_s, from_s)), *PRINTED)


# Minimizers of an objective, by autograd ---------------------------------------------------------


def slope(objective, point: torch.Tensor) -> torch.Tensor:
    """dJ/dw per entry of a separable objective (J summed), by autograd."""
    import torch

    with torch.enable_grad():
        point = point.detach().requires_grad_()
        (grad,) = torch.autograd.grad(objective(point).sum(), point)
    return grad


def slope_and_curvature(objective, point: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """dJ/dw and d2J/dw2 per entry of a separable objective, by autograd."""
    import torch

    with torch.enable_grad():
        point = point.detach().requires_grad_()
        (first,) = torch.autograd.grad(objective(point).sum(), point, create_graph=True)
        if not first.requires_grad:  # J linear in w: no curvature
            return first.detach(), torch.zeros_like(first)
        (second,) = torch.autograd.grad(first.sum(), point, allow_unused=True)
    second = torch.zeros_like(first) if second is None else second
    return first.detach(), second.detach()


def argmin_separable(
    objective, w0: torch.Tensor, u: torch.Tensor, domain: str, iterations: int = 400
) -> torch.Tensor:
    """The minimizer of a convex objective, entry by entry, as the root of its autograd slope
    (nondecreasing, J being convex) inside the domain ("real", "positive", "unit_interval"):
    `monotone_root` from w0, bracketed in the domain's coordinate (log w, logit w: a root near
    0 or 1 keeps its relative precision; sought in w, a binary-entropy state of 7e-18 came out
    as 2.8e-14, the bisection's floor). On the real line the bracket's first step and the
    Newton floor are the problem's scale 1 + |w0| + |u|."""
    import torch

    to_s, from_s = COORDINATES[domain]
    spread = 1 + w0.abs() + u.abs()
    real = domain == "real"
    start = w0.detach()
    if not real:  # a state saturated onto the domain's end starts just inside it
        eps, tiny = torch.finfo(w0.dtype).eps, torch.finfo(w0.dtype).tiny
        start = start.clamp(tiny, 1 - eps) if domain == "unit_interval" else start.clamp(tiny)
    return monotone_root(
        lambda x: slope_and_curvature(objective, x),
        start,
        to_s,
        from_s,
        value=lambda x: slope(objective, x),
        step=spread if real else 1.0,
        scale=spread if real else 0.0,
        iterations=iterations,
    )


def argmin_rows(
    objective, w0: torch.Tensor, u: torch.Tensor, row_sum: float, iterations: int = 400
) -> torch.Tensor:
    """The per-row multiplier solve: the minimizer of sum_j J(w_j) over w > 0 with each row
    (the last axis) summing to c = `row_sum` (KL retention's simplex). With the row's
    multiplier mu, w_j(mu) = argmin_w J(w) + mu w (`argmin_separable`), and the row sum falls
    as mu grows, with dw_j/dmu = -1/J''(w_j) (implicit differentiation): mu is the root of
    f(mu) = log c - log sum_j w_j(mu), nondecreasing and close to linear, by `monotone_root`
    from the root of the line through f(-1) and f(1) (a wide first bracket would reach the mu
    where entries underflow and f is flat). w0, u [..., n]."""
    import torch

    def entries(mu: torch.Tensor) -> torch.Tensor:
        return argmin_separable(lambda x: objective(x) + mu * x, w0, u, "positive", iterations)

    def value(mu: torch.Tensor) -> torch.Tensor:
        return math.log(row_sum) - torch.log(entries(mu).sum(-1, keepdim=True))

    def fn(mu: torch.Tensor):
        w = entries(mu)
        _, curvature = slope_and_curvature(objective, w)
        total = w.sum(-1, keepdim=True)
        return math.log(row_sum) - torch.log(total), (1 / curvature).sum(-1, keepdim=True) / total

    one = torch.ones_like(w0[..., :1])
    f_minus, f_plus = value(-one), value(one)
    guess = torch.where(f_plus > f_minus, -1 - 2 * f_minus / (f_plus - f_minus), 0 * one)
    to_s, from_s = COORDINATES["real"]
    mu = monotone_root(fn, guess, to_s, from_s, value=value, scale=1.0, iterations=iterations)
    return entries(mu)


def golden_section(f, lo: torch.Tensor, hi: torch.Tensor, iterations: int = 120) -> torch.Tensor:
    """Per-entry minimizer of an elementwise convex f over [lo, hi], by comparing values
    (evaluated inside only)."""
    import torch

    ratio = (math.sqrt(5) - 1) / 2
    for _ in range(iterations):
        left, right = hi - ratio * (hi - lo), lo + ratio * (hi - lo)
        keep_left = f(left) < f(right)  # then the minimum lies in [lo, right]
        lo, hi = torch.where(keep_left, lo, left), torch.where(keep_left, right, hi)
    return (lo + hi) / 2


def golden_section_argmin(
    objective, w0: torch.Tensor, u: torch.Tensor, domain: str
) -> torch.Tensor:
    """The minimizer of an elementwise convex objective per entry from its values alone (no
    slope: independent of a stationarity check), by `golden_section` over the domain, widening
    the bracket where the minimizer is found at an edge that is not the domain's. Positive
    states are searched in s = log w from the smallest normal float up: as precise for a
    minimizer at 1e-30 or 1e30 as at 1 (a bracket [0, 1e55] resolves only 1e30 in 120 steps)."""
    import torch

    spread = 1 + w0.abs() + u.abs()
    f = objective
    if domain == "unit_interval":
        lo, hi = torch.zeros_like(w0), torch.ones_like(w0)
    elif domain == "positive":
        lo = torch.full_like(w0, math.log(torch.finfo(w0.dtype).tiny))
        hi = torch.log(w0 + spread)

        def f(s: torch.Tensor) -> torch.Tensor:
            return objective(torch.exp(s))
    else:
        lo, hi = w0 - spread, w0 + spread
    with torch.no_grad():
        for _ in range(20):
            x = golden_section(f, lo, hi)
            width = hi - lo
            low = (x - lo < 1e-3 * width) & (domain == "real")
            high = (hi - x < 1e-3 * width) & (domain != "unit_interval")
            if not (low.any() or high.any()):
                break
            lo, hi = torch.where(low, lo - width, lo), torch.where(high, hi + width, hi)
    return torch.exp(x) if domain == "positive" else x


def lbfgs_argmin_rows(objective, w0: torch.Tensor, row_sum: float) -> torch.Tensor:
    """The minimizer over W = c softmax(theta) (every row on the simplex scaled by c =
    `row_sum`) from its values and gradient, with torch's L-BFGS from theta = 0: independent
    of the multiplier (`argmin_rows`)."""
    import torch

    theta = torch.zeros_like(w0, requires_grad=True)
    opt = torch.optim.LBFGS(
        [theta],
        max_iter=500,
        tolerance_grad=1e-14,
        tolerance_change=0.0,
        history_size=20,
        line_search_fn="strong_wolfe",
    )
    # Floored at the smallest normal float: an entry that underflows to 0 would make w log w
    # NaN (its share of the objective is below rounding anyway).
    tiny = torch.finfo(w0.dtype).tiny

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = objective((row_sum * torch.softmax(theta, dim=-1)).clamp_min(tiny)).sum()
        loss.backward()
        return loss

    for _ in range(4):
        opt.step(closure)
    return (row_sum * torch.softmax(theta, dim=-1)).detach()


def newton_minimize(objective, start: torch.Tensor, iterations: int = 20) -> torch.Tensor:
    """The minimizer of a smooth objective of one flat vector, by Newton's method on its
    autograd gradient and full autograd Hessian (a torch.linalg.solve), from `start` until a
    step is below 4 eps max(|x|, 1) or after `iterations` (1: one step, exact for a quadratic).
    L-BFGS, which compares objective values, stops near sqrt(eps) of the minimizer."""
    import torch

    flat = start.detach()
    eps = torch.finfo(flat.dtype).eps
    with torch.enable_grad():
        for _ in range(iterations):
            point = flat.detach().requires_grad_()
            (gradient,) = torch.autograd.grad(objective(point), point)
            hessian = torch.autograd.functional.hessian(objective, point.detach())
            step = torch.linalg.solve(hessian, gradient)
            flat = flat - step
            if float(step.abs().max()) <= 4 * eps * float(flat.abs().max().clamp_min(1)):
                break
    return flat.detach()
