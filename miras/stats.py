"""Small statistics over per-seed values, without numpy or scipy (the search report and the
probes use them; neither loads torch for this).

    mean, low, high = confidence_interval([0.91, 0.93, 0.90])   # two-sided 95% Student t
    p = welch_p([0.91, 0.93, 0.90], [0.80, 0.84, 0.79])          # Welch's two-sided t-test
"""

from __future__ import annotations

import math
from collections.abc import Sequence

# Two-sided 95% Student t quantiles t_{0.975, df} for df = 1..30 (scipy.stats.t.ppf, to six
# decimals); df > 30 uses df = 30's, which is conservative there.
T_975 = (
    12.706205, 4.302653, 3.182446, 2.776445, 2.570582, 2.446912,
    2.364624, 2.306004, 2.262157, 2.228139, 2.200985, 2.178813,
    2.160369, 2.144787, 2.131450, 2.119905, 2.109816, 2.100922,
    2.093024, 2.085963, 2.079614, 2.073873, 2.068658, 2.063899,
    2.059539, 2.055529, 2.051831, 2.048407, 2.045230, 2.042272,
)  # fmt: skip


def mean_and_variance(values: Sequence[float]) -> tuple[float, float]:
    """(mean, unbiased sample variance); the variance of one value is 0."""
    n = len(values)
    mean = sum(values) / n
    variance = sum((v - mean) ** 2 for v in values) / (n - 1) if n > 1 else 0.0
    return mean, variance


def confidence_interval(values: Sequence[float]) -> tuple[float, float, float]:
    """(mean, low, high): the mean and its two-sided 95% Student t interval over `values`
    (one per seed); a single value gives a zero-width interval. Any non-finite value (a seed
    on which the rule diverged) gives NaN for all three."""
    if not values:
        raise ValueError("confidence_interval: expected at least one value, got none")
    n = len(values)
    if not all(math.isfinite(v) for v in values):
        return float("nan"), float("nan"), float("nan")
    mean, variance = mean_and_variance(values)
    if n == 1:
        return mean, mean, mean
    half = T_975[min(n - 1, len(T_975)) - 1] * math.sqrt(variance / n)
    return mean, mean - half, mean + half


def welch_p(a: Sequence[float], b: Sequence[float]) -> float:
    """Two-sided p-value of Welch's t-test that `a` and `b` have the same mean (unequal
    variances; Welch-Satterthwaite degrees of freedom). Needs two values on each side. Two
    samples without any spread differ with p = 0 when their means differ, else p = 1."""
    if len(a) < 2 or len(b) < 2:
        raise ValueError(f"welch_p: expected at least 2 values per side, got {len(a)}, {len(b)}")
    (mean_a, var_a), (mean_b, var_b) = mean_and_variance(a), mean_and_variance(b)
    va, vb = var_a / len(a), var_b / len(b)  # squared standard errors of the means
    if va + vb == 0:
        return 0.0 if mean_a != mean_b else 1.0
    t = (mean_a - mean_b) / math.sqrt(va + vb)
    df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    # P(|T| > |t|) for Student's t with df degrees of freedom: I_{df / (df + t^2)}(df/2, 1/2).
    return _regularized_beta(df / (df + t * t), df / 2, 0.5)


def _regularized_beta(x: float, a: float, b: float) -> float:
    """I_x(a, b), the regularized incomplete beta function, by its continued fraction
    (Numerical Recipes, 6.4), on the side where it converges fast."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = (
        math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    )
    if x < (a + 1) / (a + b + 2):
        return math.exp(log_front) * _beta_fraction(x, a, b) / a
    return 1.0 - math.exp(log_front) * _beta_fraction(1.0 - x, b, a) / b


def _beta_fraction(x: float, a: float, b: float) -> float:
    """The continued fraction of I_x(a, b), evaluated by the modified Lentz method."""
    tiny = 1e-300

    def guard(value: float) -> float:
        return tiny if abs(value) < tiny else value

    c, d = 1.0, 1.0 / guard(1.0 - (a + b) * x / (a + 1.0))
    result = d
    for m in range(1, 500):
        for numerator in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),
        ):
            d = 1.0 / guard(1.0 + numerator * d)
            c = guard(1.0 + numerator / c)
            result *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return result
