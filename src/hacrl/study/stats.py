"""Statistics for comparisons between contenders run on the same seeds (paired designs).

Every function takes the per-seed differences ``d_i = better_i - worse_i`` of one endpoint
(points of held-out accuracy, or its area under the curve against rollouts) and says what they
support:

- :func:`paired_t`: the mean difference with its t-based confidence interval and the interval's
  degrees of freedom (n - 1); a verdict ``holds`` / ``reversed`` only when the interval excludes 0.
- :func:`holm`: Holm's step-down correction of a report's secondary claims (family-wise error
  at ``alpha``): the adjusted p-values, in the claims' order.
- :func:`tost`: an "equal" claim as an equivalence test with a stated margin (two one-sided t
  tests): equivalence is shown only when the 1 - 2 alpha interval lies inside (-margin, margin);
  failing to reject a difference is never taken as equality.
- :func:`detectable_effect`: the smallest true mean difference the design detects with the given
  power (two-sided paired t test), from the observed spread and the number of seeds.

The formulas are written out in docs/ALGORITHMS.md ("Comparing contenders"). Uses scipy's t
distribution.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from scipy import stats


@dataclass(frozen=True)
class PairedT:
    """A paired comparison of one endpoint: ``mean`` difference, its standard error, the
    ``level`` interval ``[lo, hi]`` with ``df`` degrees of freedom, the two-sided p-value."""

    n: int
    mean: float
    se: float
    df: int
    lo: float
    hi: float
    p: float
    level: float

    @property
    def verdict(self) -> str:
        """``holds`` (interval above 0), ``reversed`` (below 0) or ``not resolved``."""
        if self.lo > 0:
            return "holds"
        if self.hi < 0:
            return "reversed"
        return "not resolved"

    def text(self, unit: str = " points") -> str:
        """``+1.6 [+0.4, +2.8]{unit} (95 % t interval, df 7)``."""
        return (f"{self.mean:+.1f} [{self.lo:+.1f}, {self.hi:+.1f}]{unit} ({100 * self.level:.0f} % t interval, "
                f"df {self.df})")


def paired_t(diffs: Sequence[float], level: float = 0.95) -> PairedT:
    """The mean of ``diffs`` with its t interval (at least two differences)."""
    n = len(diffs)
    if n < 2:
        raise ValueError(f"a paired t interval needs at least 2 differences, got {n}")
    mean = sum(diffs) / n
    sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (n - 1))
    se = sd / math.sqrt(n)
    df = n - 1
    q = float(stats.t.ppf(0.5 + level / 2, df))
    p = (1.0 if mean == 0 else 0.0) if se == 0 else float(2 * stats.t.sf(abs(mean) / se, df))
    return PairedT(n, mean, se, df, mean - q * se, mean + q * se, p, level)


def holm(pvalues: Sequence[float]) -> list[float]:
    """Holm-adjusted p-values, in the order given: a claim holds at family-wise level alpha when
    its adjusted p-value is <= alpha."""
    m = len(pvalues)
    order = sorted(range(m), key=lambda i: pvalues[i])
    adjusted = [0.0] * m
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * pvalues[i]))
        adjusted[i] = running
    return adjusted


@dataclass(frozen=True)
class Equivalence:
    """Two one-sided tests of |true difference| < ``margin``: ``p`` is the larger of the two
    one-sided p-values; ``lo``/``hi`` the 1 - 2 alpha interval, which lies inside the margin
    exactly when ``equivalent``."""

    margin: float
    p: float
    lo: float
    hi: float
    equivalent: bool


def tost(diffs: Sequence[float], margin: float, alpha: float = 0.05) -> Equivalence:
    """Equivalence within +- ``margin`` (the same units as ``diffs``) at level ``alpha``."""
    if margin <= 0:
        raise ValueError(f"an equivalence margin must be > 0, got {margin}")
    r = paired_t(diffs, 1 - 2 * alpha)
    t = stats.t
    if r.se == 0:
        p = 0.0 if abs(r.mean) < margin else 1.0
    else:
        p_lower = float(t.sf((r.mean + margin) / r.se, r.df))  # H0: difference <= -margin
        p_upper = float(t.cdf((r.mean - margin) / r.se, r.df))  # H0: difference >= +margin
        p = max(p_lower, p_upper)
    return Equivalence(margin, p, r.lo, r.hi, p < alpha)


def detectable_effect(sd: float, n: int, power: float = 0.8, alpha: float = 0.05) -> float:
    """The smallest true mean difference a two-sided paired t test at ``alpha`` detects with
    probability ``power`` from ``n`` differences of standard deviation ``sd`` (the noncentral t
    distribution, solved by bisection)."""
    if n < 2:
        raise ValueError(f"needs at least 2 differences, got {n}")
    df = n - 1
    crit = float(stats.t.ppf(1 - alpha / 2, df))
    se = sd / math.sqrt(n)
    if se == 0:
        return 0.0

    def achieved(effect: float) -> float:
        nc = effect / se
        return float(stats.nct.sf(crit, df, nc) + stats.nct.cdf(-crit, df, nc))

    lo, hi = 0.0, se * (crit + 10)
    while achieved(hi) < power:
        hi *= 2
    for _ in range(100):
        mid = (lo + hi) / 2
        if achieved(mid) < power:
            lo = mid
        else:
            hi = mid
    return hi


def seeds_for(effect: float, sd: float, power: float = 0.8, alpha: float = 0.05, most: int = 200) -> int | None:
    """The fewest seeds whose paired t test detects a true difference ``effect`` with ``power``
    (None when more than ``most`` would be needed)."""
    for n in range(2, most + 1):
        if detectable_effect(sd, n, power, alpha) <= effect:
            return n
    return None
