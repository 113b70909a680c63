"""Statistics of the results table: mean with a 95 % Student-t confidence interval, and a paired comparison.

For ``n`` values ``x_1..x_n`` (one per seed): ``mean = sum(x) / n``, ``s = sqrt(sum((x - mean)^2) / (n - 1))``,
95 % CI = ``mean -+ t_{0.975, n-1} * s / sqrt(n)``. Two variants run with the same seeds (same initial weights,
same prompts and sampling seeds per step) are compared per seed: ``d_i = x_i - y_i``, CI of ``mean(d)`` as above;
the difference is *significant at 5 %* when that interval excludes 0 (the two-sided paired t-test).
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
