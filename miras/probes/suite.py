"""The six probes of the bare rule: capacity, interference, outliers, recency, nonlinear
associations and repeated presentations. Each is a function rule -> `ProbeResult`; `PROBES`
lists them by name (what `miras probe NAME` runs).

Streams are seeded by (seed, sweep point): the same seed gives the same keys and values in
every probe that draws them with `draw_pairs` (capacity, outliers, recency, repetition), so a
probe at its neutral point (no corruption, one presentation) reproduces capacity's number.
Sizes: keys and values [trials, N, d], float64; `d_v` = `d_k`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from miras.probes.base import Episode, ProbeResult, run_probe
from miras.tasks.capacity import draw_pairs

Common = dict  # d_k, trials, seeds, seed, gates, grid: the options every probe takes


def _stream_order(n: int, presentations: int, seed: int) -> torch.Tensor:
    """[presentations * n] indices: the pairs in order, then fresh random orders."""
    gen = torch.Generator().manual_seed(seed * 7919 + n)
    orders = [torch.arange(n)] + [
        torch.randperm(n, generator=gen) for _ in range(presentations - 1)
    ]
    return torch.cat(orders)


def presented(k: torch.Tensor, v: torch.Tensor, passes: int, seed: int) -> Episode:
    """The episode that writes pairs k [B, N, d_k], v [B, N, d_v] `passes` times (in order,
    then fresh random orders: `_stream_order`) and reads every pair back."""
    if isinstance(passes, bool) or not isinstance(passes, int) or passes < 1:
        raise ValueError(f"passes: expected a positive integer, got {passes!r}")
    order = _stream_order(k.shape[1], passes, seed)
    return Episode(k[:, order], v[:, order], k, v)


def capacity(
    rule,
    *,
    pair_counts: Sequence[int] | None = None,
    keys: str = "unit",
    passes: int = 1,
    d_k: int = 16,
    trials: int = 16,
    seeds: int = 5,
    seed: int = 0,
    gates: dict[str, float] | None = None,
    grid: dict | None = None,
) -> ProbeResult:
    """Recall error of all N pairs after `passes` passes over them (one: in-context), against N.

    keys: `unit` (random on the sphere) or `orthogonal` (exactly orthogonal up to N = d_k).
    An exact delta rule (lr 1) recalls d_k orthogonal pairs with error 0. Many passes approach
    the storage capacity (what miras.tasks.capacity measures with a decaying step)."""
    xs = list(pair_counts or (d_k // 4, d_k // 2, d_k, 2 * d_k, 4 * d_k))

    def make(n, s):
        k, v = draw_pairs(d_k, d_k, n, trials=trials, seed=s, keys=keys)
        return presented(k, v, passes, s)

    settings = {"keys": keys, "passes": passes, "d_k": d_k, "trials": trials}
    return run_probe(
        "capacity", rule, make, xs, x_name="pairs", seeds=seeds, seed=seed, gates=gates,
        grid=grid, settings=settings,
    )  # fmt: skip


def correlated_keys(
    d_k: int, n: int, *, trials: int, seed: int, correlation: float
) -> torch.Tensor:
    """[trials, n, d_k] unit keys sharing one random direction c per trial:
    k_i = normalize(sqrt(rho) c + sqrt(1 - rho) z_i), so E<k_i, k_j> ~ rho for i != j."""
    gen = torch.Generator().manual_seed(seed * 1_000_033 + n)
    c = torch.nn.functional.normalize(torch.randn(trials, 1, d_k, generator=gen).double(), dim=-1)
    z = torch.nn.functional.normalize(torch.randn(trials, n, d_k, generator=gen).double(), dim=-1)
    k = math.sqrt(correlation) * c + math.sqrt(1 - correlation) * z
    return torch.nn.functional.normalize(k, dim=-1)


def interference(
    rule,
    *,
    pair_counts: Sequence[int] | None = None,
    early: int = 4,
    correlation: float = 0.5,
    d_k: int = 16,
    trials: int = 16,
    seeds: int = 5,
    seed: int = 0,
    gates: dict[str, float] | None = None,
    grid: dict | None = None,
) -> ProbeResult:
    """Recall error of the first `early` pairs as correlated keys (pairwise cosine about
    `correlation`) are added after them, against the total N."""
    if not 0 <= correlation < 1:
        raise ValueError(f"correlation: expected a value in [0, 1), got {correlation!r}")
    xs = list(pair_counts or (early, d_k // 2, d_k, 2 * d_k, 4 * d_k))
    if min(xs) < early:
        raise ValueError(f"pair_counts: every N must be >= early = {early}, got {xs}")

    def make(n, s):
        k = correlated_keys(d_k, n, trials=trials, seed=s, correlation=correlation)
        v = torch.randn(trials, n, d_k, generator=torch.Generator().manual_seed(s), dtype=k.dtype)
        return Episode(k, v, k[:, :early], v[:, :early])

    settings = {"early": early, "correlation": correlation, "d_k": d_k, "trials": trials}
    return run_probe(
        "interference", rule, make, xs, x_name="pairs", seeds=seeds, seed=seed, gates=gates,
        grid=grid, settings=settings,
    )  # fmt: skip


def outliers(
    rule,
    *,
    fractions: Sequence[float] = (0.0, 0.125, 0.25, 0.375),
    n_pairs: int | None = None,
    scale: float = 10.0,
    keys: str = "unit",
    d_k: int = 16,
    trials: int = 16,
    seeds: int = 5,
    seed: int = 0,
    gates: dict[str, float] | None = None,
    grid: dict | None = None,
) -> ProbeResult:
    """Recall error of the clean pairs when a fraction of the N (default d_k / 2) written values
    is corrupted (v + scale * z, z ~ N(0, I)), against the fraction; round(fraction * N) pairs
    are corrupted, so the defaults corrupt 0, 1, 2 and 3 of 8. The clean targets are the drawn
    values; at fraction 0 this is capacity's error at the same N."""
    n = n_pairs or d_k // 2
    for f in fractions:
        if not 0 <= f < 1:
            raise ValueError(f"fractions: expected values in [0, 1), got {list(fractions)}")

    def make(f, s):
        k, v = draw_pairs(d_k, d_k, n, trials=trials, seed=s, keys=keys)
        bad = round(f * n)
        gen = torch.Generator().manual_seed(s * 104_729 + bad)
        corrupt = torch.rand(trials, n, generator=gen).argsort(-1) < bad  # [trials, N]
        noise = scale * torch.randn(trials, n, d_k, generator=gen, dtype=v.dtype)
        written = torch.where(corrupt[..., None], v + noise, v)
        # Clean pairs only: the same count in every trial, in stream order.
        clean = ~corrupt
        read_k = k[clean].reshape(trials, n - bad, d_k)
        read_v = v[clean].reshape(trials, n - bad, d_k)
        return Episode(k, written, read_k, read_v)

    settings = {"pairs": n, "scale": scale, "keys": keys, "d_k": d_k, "trials": trials}
    return run_probe(
        "outliers", rule, make, list(fractions), x_name="fraction", seeds=seeds, seed=seed,
        gates=gates, grid=grid, settings=settings,
    )  # fmt: skip


def recency(
    rule,
    *,
    distances: Sequence[int] | None = None,
    length: int | None = None,
    d_k: int = 16,
    trials: int = 16,
    seeds: int = 5,
    seed: int = 0,
    gates: dict[str, float] | None = None,
    grid: dict | None = None,
) -> ProbeResult:
    """Recall error of the pair written d tokens before the end of a stream of `length`
    (default 4 d_k) random pairs, against d (d = 1: the last pair)."""
    t = length or 4 * d_k
    xs = list(distances or (1, 2, 4, 8, 16, 32, 64))
    if any(not 1 <= d <= t for d in xs):
        raise ValueError(f"distances: expected values in 1..{t} (the length), got {xs}")

    def make(d, s):
        k, v = draw_pairs(d_k, d_k, t, trials=trials, seed=s)
        return Episode(k, v, k[:, t - d : t - d + 1], v[:, t - d : t - d + 1])

    settings = {"length": t, "d_k": d_k, "trials": trials}
    return run_probe(
        "recency", rule, make, xs, x_name="distance", seeds=seeds, seed=seed, gates=gates,
        grid=grid, settings=settings,
    )  # fmt: skip


def teacher_values(k: torch.Tensor, *, seed: int, hidden: int = 32):
    """v = B ((A k)^2 - 1) / rms: a random one-hidden-layer network with a square activation,
    keys [trials, N, d_k] -> values [trials, N, d_k], one teacher per trial, scaled to unit mean
    square. The map is even (v(-k) = v(k)) and centred, so on keys uniform on the sphere it has
    no linear part: past d_k pairs a matrix memory has nothing to fit, a degree-2 feature map
    fits it exactly and a deep memory can approximate it."""
    trials, _, d = k.shape
    gen = torch.Generator().manual_seed(seed * 15_485_863 + 1)
    a = torch.randn(trials, hidden, d, generator=gen, dtype=k.dtype)  # (A k)_j ~ N(0, 1)
    b = torch.randn(trials, d, hidden, generator=gen, dtype=k.dtype) / math.sqrt(hidden)
    v = ((k @ a.transpose(-1, -2)).pow(2) - 1) @ b.transpose(-1, -2)
    return v / v.pow(2).mean().sqrt()


def nonlinear(
    rule,
    *,
    pair_counts: Sequence[int] | None = None,
    passes: int = 1,
    d_k: int = 8,
    trials: int = 16,
    seeds: int = 5,
    seed: int = 0,
    gates: dict[str, float] | None = None,
    grid: dict | None = None,
) -> ProbeResult:
    """Recall error of N stored pairs whose values are a nonlinear function of the keys
    (`teacher_values`), after `passes` passes, against N (past d_k a matrix memory cannot fit
    it)."""
    xs = list(pair_counts or (d_k // 2, d_k, 2 * d_k, 4 * d_k, 8 * d_k))

    def make(n, s):
        k, _ = draw_pairs(d_k, 1, n, trials=trials, seed=s)
        return presented(k, teacher_values(k, seed=s), passes, s)

    settings = {"passes": passes, "d_k": d_k, "trials": trials, "teacher": "B((Ak)^2-1)"}
    return run_probe(
        "nonlinear", rule, make, xs, x_name="pairs", seeds=seeds, seed=seed, gates=gates,
        grid=grid, settings=settings,
    )  # fmt: skip


def repetition(
    rule,
    *,
    presentations: Sequence[int] = (1, 2, 3, 4),
    n_pairs: int | None = None,
    d_k: int = 16,
    trials: int = 16,
    seeds: int = 5,
    seed: int = 0,
    gates: dict[str, float] | None = None,
    grid: dict | None = None,
) -> ProbeResult:
    """Recall error of N random pairs (default d_k) presented R times (in order, then fresh
    orders), against R. An Omega window c > 1 revisits each pair c times in one presentation;
    this probe says what that buys next to presenting the stream again."""
    n = n_pairs or d_k
    if any(not isinstance(r, int) or r < 1 for r in presentations):
        raise ValueError(f"presentations: expected positive integers, got {list(presentations)}")

    def make(r, s):
        k, v = draw_pairs(d_k, d_k, n, trials=trials, seed=s)
        return presented(k, v, r, s)

    settings = {"pairs": n, "d_k": d_k, "trials": trials}
    return run_probe(
        "repetition", rule, make, list(presentations), x_name="presentations", seeds=seeds,
        seed=seed, gates=gates, grid=grid, settings=settings,
    )  # fmt: skip


PROBES: dict[str, Callable[..., ProbeResult]] = {
    "capacity": capacity,
    "interference": interference,
    "outliers": outliers,
    "recency": recency,
    "nonlinear": nonlinear,
    "repetition": repetition,
}
