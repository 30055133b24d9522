"""Paired, stratified bootstrap confidence intervals: the uncertainty of every reported figure.

The unit of resampling is a prompt (turns of one prompt are not independent, so offline figures
resample prompts too, with all their turns); the strata are benchmarks (or reports): a replicate
draws, within each stratum, as many prompts as the stratum has, with replacement. One draw serves
every method (*paired*): a ratio or difference of two methods evaluated on the same prompts then
varies only with how their difference varies from prompt to prompt, not with how hard the prompts are.

A replicate is a row of integer weights, ``w[i]`` = how often unit ``i`` was drawn, so every
statistic is a function of weighted sums (``w @ x``), vectorised over all replicates at once, and
the point estimate is the same function at ``w = 1``. Intervals are percentile intervals.

Why numpy and not ``scipy.stats.bootstrap``: scipy resamples paired samples, but neither within
strata nor whole clusters, and its statistic sees one sample at a time, not the per-benchmark sums
of several methods that our tables are ratios of. (A test checks this module against scipy's
percentile interval on a case both can do.) With a handful of prompts per stratum, percentile
intervals are too narrow rather than too wide: read a CI from 2 prompts a benchmark as a lower bound
on the uncertainty.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Hashable, Sequence

import numpy as np

__all__ = ["Interval", "bootstrap_weights", "interval", "ratio_of_sums", "DEFAULT_RESAMPLES", "DEFAULT_LEVEL"]

DEFAULT_RESAMPLES = 2000
DEFAULT_LEVEL = 0.95


@dataclass(frozen=True)
class Interval:
    """A point estimate with its bootstrap CI and the number of units (prompts) behind it."""

    value: float
    low: float
    high: float
    n: int
    level: float = DEFAULT_LEVEL

    @property
    def half_width(self) -> float:
        return (self.high - self.low) / 2

    def excludes(self, x: float) -> bool:
        """True when the whole CI lies on one side of ``x``."""
        return self.low > x or self.high < x

    def format(self, fmt: str = "{:.2f}") -> str:
        """``1.23 [1.10, 1.35]``; ``1.23 [no CI]`` where the CI is undefined (one prompt a benchmark)."""
        if self.value != self.value:
            return "--"
        if self.low != self.low:
            return f"{fmt.format(self.value)} [no CI]"
        return f"{fmt.format(self.value)} [{fmt.format(self.low)}, {fmt.format(self.high)}]"

    def __str__(self) -> str:
        return self.format()


def bootstrap_weights(strata: Sequence[Hashable], n_resamples: int = DEFAULT_RESAMPLES, seed: int = 0) -> np.ndarray:
    """[n_resamples, N] resampling counts of N units: within each stratum, as many draws with
    replacement as the stratum has units (so every replicate keeps every stratum's size)."""
    strata = np.asarray(list(strata), dtype=object)
    if n_resamples < 1:
        raise ValueError(f"n_resamples must be >= 1, got {n_resamples}")
    rng = np.random.default_rng(seed)
    weights = np.zeros((n_resamples, len(strata)), dtype=np.float64)
    for stratum in dict.fromkeys(strata.tolist()):
        idx = np.flatnonzero(strata == stratum)
        draws = rng.integers(0, len(idx), size=(n_resamples, len(idx)))
        counts = np.zeros((n_resamples, len(idx)))
        np.add.at(counts, (np.arange(n_resamples)[:, None], draws), 1.0)
        weights[:, idx] = counts
    return weights


def interval(statistic: Callable[[np.ndarray], np.ndarray], weights: np.ndarray, n: int | None = None,
             level: float = DEFAULT_LEVEL) -> Interval:
    """The percentile CI of ``statistic``, a function of weight rows ``[K, N] -> [K]``, over the
    replicates ``weights`` [R, N]; the point estimate is ``statistic`` at all-one weights.
    Replicates where the statistic is undefined (NaN) are dropped. Where no replicate differs from the
    sample (every stratum holds one unit: one prompt a benchmark) there is nothing to resample and the
    CI is undefined (NaN), not a zero-width interval."""
    ones = np.ones((1, weights.shape[1]))
    value = float(np.asarray(statistic(ones), dtype=np.float64)[0])
    reps = np.asarray(statistic(weights), dtype=np.float64)
    reps = reps[np.isfinite(reps)]
    n = weights.shape[1] if n is None else n
    if value != value or not len(reps) or np.all(weights == 1):
        return Interval(value, float("nan"), float("nan"), n, level)
    alpha = (1 - level) / 2
    low, high = np.quantile(reps, [alpha, 1 - alpha])
    return Interval(value, float(low), float(high), n, level)


def ratio_of_sums(numerator: np.ndarray, denominator: np.ndarray) -> Callable[[np.ndarray], np.ndarray]:
    """The statistic ``sum(w * a) / sum(w * b)`` (speedup = ar's total time / the method's, AL = accepted
    tokens / turns), for :func:`interval`."""
    a, b = np.asarray(numerator, np.float64), np.asarray(denominator, np.float64)
    return lambda w: (w @ a) / (w @ b)
