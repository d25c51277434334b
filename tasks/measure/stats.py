"""Paired-ratio statistics: how much faster one engine is than another, with a 95% confidence interval.

Engines compared are timed in interleaved rounds, so each round gives one paired observation
(one value per engine, taken within milliseconds of each other). A noisy neighbour slows every
engine in a round alike, which the ratio cancels. The estimator is Hodges-Lehmann on the log
ratios (the median of the Walsh averages) with the distribution-free confidence interval of the
Wilcoxon signed-rank test: robust to outlier rounds, no normality assumed, and deterministic
(no resampling), so the same samples always give the same decision.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

CONFIDENCE = 0.95
EXACT_UP_TO = 60  # rounds; beyond this the signed-rank distribution's normal approximation is used
# The fewest rounds with a 95% signed-rank interval: below 6, even the full range of the Walsh averages
# covers less than 95% (1 - 2/2^n), so no ratio is conclusive on fewer rounds, whatever the budget.
MIN_ROUNDS = 6
MAX_SERIAL_DECAY = 0.9  # beyond this, a few rounds cannot tell a trend from correlation: widen no further
METHOD = "Hodges-Lehmann estimate of paired log ratios, Wilcoxon signed-rank 95% interval"


@dataclass(frozen=True)
class Ratio:
    """`ratio` = how many times faster the first engine is than the second (>1: faster)."""

    ratio: float
    low: float
    high: float
    rounds: int
    widening: float = 1.0  # the factor the interval was widened by for consecutive rounds that are alike

    @property
    def half_width(self) -> float:
        """Half the interval's width relative to the estimate: 0.05 means about ±5%."""
        return (self.high - self.low) / (2 * self.ratio)

    def conclusive(self, precision: float) -> bool:
        """Within ±precision, on enough rounds for a real 95% interval (MIN_ROUNDS)."""
        return self.rounds >= MIN_ROUNDS and self.half_width <= precision

    def excludes(self, value: float) -> bool:
        return not self.low <= value <= self.high

    def text(self) -> str:
        return f"{self.ratio:.3g}x [{self.low:.3g}, {self.high:.3g}]"


@functools.cache
def _signed_rank_counts(n: int) -> tuple[int, ...]:
    """How many of the 2^n sign patterns give each signed-rank sum W+ = 0 .. n(n+1)/2."""
    counts = [1]
    for rank in range(1, n + 1):
        grown = counts + [0] * rank
        for total, ways in enumerate(counts):
            grown[total + rank] += ways
        counts = grown
    return tuple(counts)


def _interval_rank(n: int, confidence: float = CONFIDENCE) -> int:
    """k such that the k-th smallest and k-th largest Walsh averages bound the interval (1-based).

    The largest k with P(W+ < k) <= (1 - confidence) / 2; at least 1 (then the interval is the
    full range of the Walsh averages, which is what too few rounds deserve; below MIN_ROUNDS that
    range covers less than `confidence`, which is why such a ratio is never conclusive).
    """
    alpha = (1 - confidence) / 2
    if n <= EXACT_UP_TO:
        counts, total, below, k = _signed_rank_counts(n), 2 ** n, 0, 0
        while k < len(counts) and (below + counts[k]) / total <= alpha:
            below += counts[k]
            k += 1
        return max(k, 1)
    mean, sd = n * (n + 1) / 4, math.sqrt(n * (n + 1) * (2 * n + 1) / 24)
    z = _normal_quantile(1 - alpha)
    return max(int(math.floor(mean - z * sd)), 1)


def _normal_quantile(p: float) -> float:
    """Inverse of the standard normal CDF by bisection on erf: exact enough for a confidence bound."""
    low, high = -10.0, 10.0
    for _ in range(80):
        mid = (low + high) / 2
        if 0.5 * (1 + math.erf(mid / math.sqrt(2))) < p:
            low = mid
        else:
            high = mid
    return (low + high) / 2


def paired_ratio(slower: Sequence[float], faster: Sequence[float], confidence: float = CONFIDENCE,
                 widen_at_least: float = 1.0) -> Ratio:
    """How many times faster `faster` is than `slower`, from paired per-round times.

    `slower[i]` and `faster[i]` are the two engines' times in round i (the names only say which
    way the ratio reads: the result is below 1 when `faster` is in fact slower). `widen_at_least`: the
    widening for alike consecutive rounds is never below this (a measurement that looks after every round
    passes the largest it has seen, see tasks/measure/rounds.py).
    """
    a = np.asarray(slower, dtype=np.float64)
    b = np.asarray(faster, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 1 or a.size == 0:
        raise ValueError(f"paired_ratio needs two equal-length, non-empty series, got {a.shape} and {b.shape}")
    if not (np.all(a > 0) and np.all(b > 0) and np.all(np.isfinite(a)) and np.all(np.isfinite(b))):
        raise ValueError("paired_ratio needs positive, finite times")
    d = np.log(a) - np.log(b)
    n = d.size
    i, j = np.triu_indices(n)
    walsh = np.sort((d[i] + d[j]) / 2)
    k = _interval_rank(n, confidence)
    centre, widen = float(np.median(walsh)), max(serial_inflation(d), widen_at_least)
    return Ratio(ratio=math.exp(centre), low=math.exp(centre - widen * (centre - walsh[k - 1])),
                 high=math.exp(centre + widen * (walsh[-k] - centre)), rounds=n, widening=widen)


def recent_widest(looks: dict[int, float], rounds: int) -> float:
    """The largest widening estimated by the looks (rounds -> widening) over the last half of `rounds`."""
    return max((widening for seen, widening in looks.items() if 2 * seen >= rounds), default=1.0)


def looked_ratio(slower: Sequence[float], faster: Sequence[float], first_look: int) -> Ratio:
    """The ratio as rounds that looked after every round from `first_look` on report it (tasks/measure/rounds.py): its
    widening at least the largest estimated at a look over the last half of the rounds. A function of the samples
    alone, for a reader who recomputes a published interval from the samples table."""
    d = np.log(np.asarray(slower, dtype=np.float64)) - np.log(np.asarray(faster, dtype=np.float64))
    looks = {m: serial_inflation(d[:m]) for m in range(max(first_look, 1), len(d))}
    return paired_ratio(slower, faster, widen_at_least=recent_widest(looks, len(d)))


# Small-sample corrections of serial_inflation (seeded simulation, benchmarks/interval_coverage.py): with the
# plain plug-in estimate, AR(1) rounds (rho .5) covered 90-92% at n = 7-20. The autocorrelations of a short
# series are noisy and, worse, low exactly when the sample's centre is far off (both come from the same few
# persistent rounds), so the plug-in factor is too small when it matters most.
SERIAL_DECAY_FLOOR = 0.5  # a lag-2 estimate is mostly noise at small n; once lag 1 is seen, assume it persists
SERIAL_LAG1_MARGIN = 0.3  # lag 1 raised by this / sqrt(n) (about its standard error's third) once it is seen
SERIAL_DF_POWER = 2  # t-like widening with n / factor^(2 * this) degrees of freedom: the factor is itself estimated
# ... on at least this many effective rounds: with 2.5 a factor of 3 on a few dozen rounds widened ~8x (int8 vs fp32
# at batch 1 read [0.03, 0.71] on a quiet machine); with 4, at most ~4.8x, and correlated rounds still cover
# 93.8% where they stop (benchmarks/interval_coverage.py --trials 2000; 93.4% with 6)
SERIAL_MIN_EFFECTIVE = 4.0


def _t_quantile(df: float, p: float = 0.975) -> float:
    """Student-t quantile by the Cornish-Fisher expansion around the normal one (ample for df >= 1.5)."""
    z = _normal_quantile(p)
    return (z + (z ** 3 + z) / (4 * df) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * df ** 2)
            + (3 * z ** 7 + 19 * z ** 5 + 17 * z ** 3 - 15 * z) / (384 * df ** 3))


def serial_inflation(d: np.ndarray) -> float:
    """How much wider the interval must be because consecutive rounds are alike (the signed-rank interval
    assumes independent rounds; an engine whose state persists for a few rounds, through clocks, caches or
    another process, would otherwise get a "95%" interval that covers 85%).

    The square root of the long-run variance factor 1 + 2 * sum of the autocorrelations, those taken as
    decaying geometrically from lag 1 at the rate lag 2 shows (at least SERIAL_DECAY_FLOOR); autocorrelations
    of the ranks (so one descheduled round can neither fake nor hide them), corrected for their small-sample
    bias towards zero and, once lag 1 is seen (> 0.05), raised by a margin for its sampling error. Because
    the factor is estimated from the same few rounds, the result is widened further like a t interval on the
    effective number of rounds (n / factor^(2 * SERIAL_DF_POWER)). Exactly 1 when no
    correlation is seen (independent rounds keep the plain signed-rank interval); at most 3 before the
    t-like widening.
    """
    n = d.size
    if n < 5:
        return 1.0
    ranks = np.argsort(np.argsort(d, kind="stable"), kind="stable").astype(np.float64)
    ranks -= ranks.mean()
    scale = float(np.dot(ranks, ranks))
    if scale == 0:
        return 1.0
    lag1, lag2 = (float(np.dot(ranks[:-k], ranks[k:]) / scale) + 1.0 / n for k in (1, 2))
    lag1, lag2 = max(lag1, 0.0) * (1 + 3.0 / n), max(lag2, 0.0) * (1 + 3.0 / n)
    if lag1 <= 0.05:
        return 1.0
    lag1 += SERIAL_LAG1_MARGIN / math.sqrt(n)
    decay = min(max(lag2 / lag1, SERIAL_DECAY_FLOOR), MAX_SERIAL_DECAY)
    factor = math.sqrt(min(max(1 + 2 * min(lag1, MAX_SERIAL_DECAY) / (1 - decay), 1.0), 9.0))
    effective = max(n / factor ** (2 * SERIAL_DF_POWER), SERIAL_MIN_EFFECTIVE)
    return factor * _t_quantile(effective - 1) / _t_quantile(n - 1)


def wilson_interval(hits: int, n: int, confidence: float = CONFIDENCE) -> tuple[float, float]:
    """Wilson score interval of a proportion (hits of n): honest near 0 and 1, where the normal one is not."""
    if n <= 0:
        raise ValueError("a proportion needs at least one trial")
    z = _normal_quantile(0.5 + confidence / 2)
    p = hits / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)
