"""Statistics of the results table: mean with a 95 % Student-t confidence interval, and a paired comparison.

For ``n`` values ``x_1..x_n`` (one per seed): ``mean = sum(x) / n``, ``s = sqrt(sum((x - mean)^2) / (n - 1))``,
95 % CI = ``mean -+ t_{0.975, n-1} * s / sqrt(n)``. Two variants run with the same seeds (same initial weights,
same prompts and sampling seeds per step) are compared per seed: ``d_i = x_i - y_i``, CI of ``mean(d)`` as above;
the difference is *significant at 5 %* when that interval excludes 0 (the two-sided paired t-test).

A table of many such comparisons makes some of them significant by chance (40 tests at 5 %: about 2). The
two-sided p-value of each (:attr:`Interval.p`, ``t = mean / (s / sqrt(n))`` on ``n - 1`` degrees of freedom) goes
through Holm's step-down correction (:func:`holm`), which keeps the chance of any false ``significant`` in the
family at 5 %: sort the ``m`` p-values ascending, ``p_(1) <= ... <= p_(m)``; the adjusted value of the i-th is
``max_{j <= i} min(1, (m - j + 1) * p_(j))``; a comparison survives when its adjusted value is <= 0.05.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

#: two-sided 95 % quantiles t_{0.975, df} of Student's t for df = 1..30 (df > 30: the normal 1.96 is within 2 %)
_T975 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip


def t975(df: int) -> float:
    """``t_{0.975, df}`` (two-sided 95 %); ``df >= 1``."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    return _T975[df - 1] if df <= len(_T975) else 1.96


@dataclass(frozen=True)
class Interval:
    """Mean and its 95 % confidence interval over ``n`` values (``half = nan`` when ``n < 2``)."""

    mean: float
    half: float
    n: int

    @property
    def low(self) -> float:
        return self.mean - self.half

    @property
    def high(self) -> float:
        return self.mean + self.half

    @property
    def excludes_zero(self) -> bool:
        return self.n >= 2 and (self.low > 0 or self.high < 0)

    @property
    def p(self) -> float:
        """Two-sided p-value of the t-test of ``mean = 0`` (``nan`` for ``n < 2``; 0 for a nonzero mean with no
        spread, 1 for a zero mean with none)."""
        if self.n < 2 or not math.isfinite(self.half):
            return float("nan")
        se = self.half / t975(self.n - 1)
        if se == 0:
            return 0.0 if self.mean != 0 else 1.0
        return t_two_sided_p(self.mean / se, self.n - 1)


def mean_ci(values: list[float]) -> Interval:
    """Mean of the finite ``values`` with the t-based 95 % half width (see module docstring)."""
    x = [v for v in values if math.isfinite(v)]
    if not x:
        return Interval(float("nan"), float("nan"), 0)
    if len(x) == 1:
        return Interval(x[0], float("nan"), 1)
    return Interval(statistics.mean(x), t975(len(x) - 1) * statistics.stdev(x) / math.sqrt(len(x)), len(x))


def paired_difference(a: dict[int, float], b: dict[int, float]) -> Interval:
    """CI of ``mean(a[s] - b[s])`` over the seeds ``s`` present (and finite) in both."""
    return mean_ci([a[s] - b[s] for s in sorted(a.keys() & b.keys()) if math.isfinite(a[s] - b[s])])


def _betainc(a: float, b: float, x: float) -> float:
    """Regularized incomplete beta ``I_x(a, b)``, ``0 <= x <= 1``, by its continued fraction (modified Lentz),
    evaluated on the side of ``x = (a + 1) / (a + b + 2)`` where it converges fast."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    if x > (a + 1.0) / (a + b + 2.0):
        return 1.0 - _betainc(b, a, 1.0 - x)
    log_front = a * math.log(x) + b * math.log1p(-x) + math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b)
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    f = d
    for m in range(1, 500):
        for num in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),  # even term d_{2m}
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),  # odd term d_{2m+1}
        ):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            f *= c * d
        if abs(c * d - 1.0) < 1e-15:
            break
    return math.exp(log_front) * f / a


def t_two_sided_p(t: float, df: int) -> float:
    """``P(|T| >= |t|)`` for Student's t with ``df`` degrees of freedom: ``I_{df / (df + t^2)}(df / 2, 1 / 2)``."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    if not math.isfinite(t):
        return 0.0 if math.isinf(t) else float("nan")
    return min(1.0, _betainc(df / 2.0, 0.5, df / (df + t * t)))


def holm(pvalues: list[float]) -> list[float]:
    """Holm-adjusted p-values, in the order given (see module docstring); ``nan`` entries stay ``nan`` and do
    not count in ``m``. A comparison survives the correction at level ``alpha`` when its value is <= alpha."""
    order = sorted((p, i) for i, p in enumerate(pvalues) if math.isfinite(p))
    for p, _ in order:
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"p-values must lie in [0, 1], got {p}")
    m = len(order)
    out = [float("nan")] * len(pvalues)
    running = 0.0
    for rank, (p, i) in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p))
        out[i] = running
    return out


def sign_test_p(k: int, n: int) -> float:
    """Two-sided sign test: the probability, with no effect (each of ``n`` paired seeds goes either way with
    probability 1/2), of a split at least as uneven as ``k`` of ``n``: ``min(1, 2 * sum_{i <= min(k, n - k)}
    C(n, i) / 2^n)``. All of 3 seeds the same way: 0.25; all of 6: 0.031."""
    if not 0 <= k <= n or n < 1:
        raise ValueError(f"sign test needs 0 <= k <= n and n >= 1, got k={k}, n={n}")
    tail = sum(math.comb(n, i) for i in range(min(k, n - k) + 1))
    return min(1.0, 2.0 * tail / 2.0**n)
