"""Every evaluation figure with its paired bootstrap CI (``treegraft.stats``), from the saved records.

:class:`PromptTable` lays the records out one row per prompt (benchmark, question id) with each
(pair, method)'s per-prompt totals beside each other, so one resampling of prompts within
benchmarks serves every method and pair (paired). The figures are those of the tables:

- speedup of a (pair, benchmark, method) cell = ar's total wall time / the method's on the same
  prompts; a mean over cells (benchmarks, pairs) is the mean of the cells' speedups;
- AL = accepted draft tokens / turns; call rate = middle calls / drafting steps;
- gain over a set of rivals = mean speedup / the best rival's mean speedup - 1, in percent; the best
  rival is chosen again in every replicate (a rival that wins only by luck widens the CI downwards);
- the gain across pairs (:meth:`PromptTable.gain_over_pairs`): every pair's gain recomputed in each
  replicate of one draw of prompts, then their mean, max and min, so the CIs are those of the
  cross-pair figures (not a pair's CI relabelled).

A method evaluated on fewer prompts (the ablations' first k of each benchmark) is resampled over its
own prompts; methods on the same prompts get the same replicates.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np
import pandas as pd

from ..stats import DEFAULT_RESAMPLES, Interval, bootstrap_weights, interval

__all__ = ["PromptTable", "OverPairs", "method_intervals", "offline_prompt_intervals", "FIELDS"]

# per-prompt totals read from the records (read_records' columns)
FIELDS = ["wall_time", "new_tokens", "accepted_sum", "turns", "middle_calls", "steps"]
_NAN = Interval(float("nan"), float("nan"), float("nan"), 0)


class OverPairs(NamedTuple):
    """A per-pair figure summarized over pairs, each with its CI from one shared draw of prompts;
    ``argmax`` / ``argmin``: the pair at the max / min on the point estimate."""

    mean: Interval
    max: Interval
    min: Interval
    argmax: str | None
    argmin: str | None
    pairs: list[str]


class PromptTable:
    """Per-prompt totals of every (pair, method) side by side; bootstrap intervals over prompts."""

    def __init__(self, records: pd.DataFrame, n_resamples: int = DEFAULT_RESAMPLES, seed: int = 0):
        wide = records.pivot_table(index=["benchmark", "question_id"], columns=["pair", "method"], values=FIELDS,
                                   aggfunc="sum")
        self.wide = wide
        self.units = wide.index
        self.strata = np.asarray(self.units.get_level_values("benchmark"))
        self.n_resamples, self.seed = n_resamples, seed
        self._weights: dict[bytes, np.ndarray] = {}

    def _col(self, field: str, pair: str, method: str) -> np.ndarray:
        key = (field, pair, method)
        if key not in self.wide.columns:
            return np.full(len(self.units), np.nan)
        return self.wide[key].to_numpy(np.float64)

    def _present(self, pair: str, method: str) -> np.ndarray:
        return np.isfinite(self._col("wall_time", pair, method))

    def _weights_for(self, mask: np.ndarray) -> np.ndarray:
        key = mask.tobytes()
        if key not in self._weights:  # same prompts -> same strata -> the same replicates (paired)
            self._weights[key] = bootstrap_weights(self.strata[mask], self.n_resamples, self.seed)
        return self._weights[key]

    def _mask(self, pairs: Sequence[str], methods: Sequence[str], benchmarks: Sequence[str] | None) -> np.ndarray:
        mask = np.ones(len(self.units), bool) if benchmarks is None else np.isin(self.strata, list(benchmarks))
        for pair in pairs:
            for method in methods:
                mask &= self._present(pair, method)
        return mask

    def _cells(self, mask: np.ndarray, pairs: Sequence[str]) -> list[tuple[str, np.ndarray]]:
        strata = self.strata[mask]
        return [(p, strata == b) for p in pairs for b in dict.fromkeys(strata.tolist())]

    def _speedup_stat(self, method: str, pairs: Sequence[str], mask: np.ndarray):
        cells = self._cells(mask, pairs)
        ar = {p: self._col("wall_time", p, "ar")[mask] for p in pairs}
        own = {p: self._col("wall_time", p, method)[mask] for p in pairs}
        return lambda w: np.mean([(w[:, s] @ ar[p][s]) / (w[:, s] @ own[p][s]) for p, s in cells], axis=0)

    def _ratio_stat(self, num: str, den: str, method: str, pairs: Sequence[str], mask: np.ndarray):
        cells = self._cells(mask, pairs)
        a = {p: self._col(num, p, method)[mask] for p in pairs}
        b = {p: self._col(den, p, method)[mask] for p in pairs}
        return lambda w: np.mean([(w[:, s] @ a[p][s]) / (w[:, s] @ b[p][s]) for p, s in cells], axis=0)

    def _interval(self, stat_of_mask, pairs: Sequence[str], methods: Sequence[str],
                  benchmarks: Sequence[str] | None) -> Interval:
        return self._interval_on(stat_of_mask, self._mask(pairs, methods, benchmarks))

    def _interval_on(self, stat_of_mask, mask: np.ndarray) -> Interval:
        """The CI of ``stat_of_mask(mask)`` over the replicates of the prompts in ``mask`` (one draw per
        mask: every statistic on the same prompts is resampled together)."""
        if not mask.any():
            return _NAN
        with np.errstate(invalid="ignore", divide="ignore"):
            return interval(stat_of_mask(mask), self._weights_for(mask), int(mask.sum()))

    def speedup(self, method: str, pairs: Sequence[str], benchmarks: Sequence[str] | None = None) -> Interval:
        """Mean over (pair, benchmark) cells of ar's time / the method's on the same prompts."""
        return self._interval(lambda m: self._speedup_stat(method, pairs, m), pairs, ["ar", method], benchmarks)

    def al(self, method: str, pairs: Sequence[str], benchmarks: Sequence[str] | None = None) -> Interval:
        """Mean over cells of accepted draft tokens per turn (the bonus token not counted)."""
        return self._interval(lambda m: self._ratio_stat("accepted_sum", "turns", method, pairs, m), pairs, [method],
                              benchmarks)

    def call_rate(self, method: str, pairs: Sequence[str], benchmarks: Sequence[str] | None = None) -> Interval:
        return self._interval(lambda m: self._ratio_stat("middle_calls", "steps", method, pairs, m), pairs, [method],
                              benchmarks)

    def gain(self, method: str, rivals: Sequence[str], pairs: Sequence[str],
             benchmarks: Sequence[str] | None = None) -> Interval:
        """100 * (mean speedup of ``method`` / the best rival's mean speedup - 1), on the prompts all of
        them ran; the best rival is picked per replicate."""
        rivals = self._rivals(rivals, pairs)
        if not rivals:
            return _NAN
        return self._interval(lambda mask: self._gain_stat(method, rivals, pairs, mask), pairs, ["ar", method, *rivals],
                              benchmarks)

    def _rivals(self, rivals: Sequence[str], pairs: Sequence[str]) -> list[str]:
        return [r for r in rivals if all(self._present(p, r).any() for p in pairs)]

    def _gain_stat(self, method: str, rivals: Sequence[str], pairs: Sequence[str], mask: np.ndarray):
        own = self._speedup_stat(method, pairs, mask)
        others = [self._speedup_stat(r, pairs, mask) for r in rivals]
        return lambda w: 100 * (own(w) / np.max([o(w) for o in others], axis=0) - 1)

    def gain_over_pairs(self, method: str, rivals: Sequence[str], pairs: Sequence[str],
                        benchmarks: Sequence[str] | None = None) -> OverPairs:
        """:meth:`gain` of ``method`` in each of ``pairs`` (over the rivals that pair ran), and its mean, max
        and min over the pairs, with CIs: in every replicate of one draw of prompts each pair's gain is
        recomputed (its best rival picked again) before the mean / max / min is taken. On the prompts
        every pair ran with ``ar``, ``method`` and its rivals; pairs without ``method`` or any rival are
        left out. With one pair, each of the three is that pair's :meth:`gain`."""
        per_pair = {p: self._rivals(rivals, [p]) for p in pairs if self._present(p, method).any()}
        per_pair = {p: r for p, r in per_pair.items() if r}
        if not per_pair:
            return OverPairs(_NAN, _NAN, _NAN, None, None, [])
        mask = np.logical_and.reduce([self._mask([p], ["ar", method, *r], benchmarks) for p, r in per_pair.items()])

        def gains(mask):  # [pairs, replicates]
            stats = [self._gain_stat(method, r, [p], mask) for p, r in per_pair.items()]
            return lambda w: np.stack([s(w) for s in stats])

        def over(reduce):  # the same replicates for every pair, reduced over pairs within each replicate
            def stat_of_mask(mask):
                g = gains(mask)
                return lambda w: reduce(g(w), axis=0)
            return stat_of_mask

        names = list(per_pair)
        with np.errstate(invalid="ignore", divide="ignore"):
            point = gains(mask)(np.ones((1, int(mask.sum()))))[:, 0] if mask.any() else np.full(len(names), np.nan)
        finite = np.isfinite(point)
        argmax = names[int(np.nanargmax(point))] if finite.any() else None
        argmin = names[int(np.nanargmin(point))] if finite.any() else None
        return OverPairs(self._interval_on(over(np.mean), mask), self._interval_on(over(np.max), mask),
                         self._interval_on(over(np.min), mask), argmax, argmin, names)

    def run_difference(self, method: str, pair_a: str, pair_b: str,
                       benchmarks: Sequence[str] | None = None) -> Interval:
        """Mean speedup of ``method`` under ``pair_b`` minus under ``pair_a`` on the prompts both ran, one
        resampling for both (two runs of the same pair, relabelled, on the same prompts)."""
        def stat_of_mask(mask):
            a, b = self._speedup_stat(method, [pair_a], mask), self._speedup_stat(method, [pair_b], mask)
            return lambda w: b(w) - a(w)

        mask = self._mask([pair_a], ["ar", method], benchmarks) & self._mask([pair_b], ["ar", method], benchmarks)
        return self._interval_on(stat_of_mask, mask)

    def best(self, rivals: Sequence[str], pairs: Sequence[str], benchmarks: Sequence[str] | None = None) -> str | None:
        """The rival with the highest mean speedup (point estimate) on ``benchmarks``, or None."""
        values = {r: self.speedup(r, pairs, benchmarks).value for r in rivals}
        values = {r: v for r, v in values.items() if v == v}
        return max(values, key=values.get) if values else None


def method_intervals(records: pd.DataFrame, n_resamples: int = DEFAULT_RESAMPLES, seed: int = 0,
                     table: PromptTable | None = None) -> pd.DataFrame:
    """One row per (pair, benchmark, method), benchmark ``mean`` included: speedup, AL and call rate, each
    with ``_lo`` / ``_hi`` (95% CI) and ``n`` prompts. ``table``: the records' :class:`PromptTable`, when
    the caller has one (its replicates are reused)."""
    table = table or PromptTable(records, n_resamples, seed)
    rows = []
    for pair in dict.fromkeys(records["pair"]):
        methods = list(dict.fromkeys(records.loc[records["pair"] == pair, "method"]))
        benches = list(dict.fromkeys(records.loc[records["pair"] == pair, "benchmark"]))
        for bench in [*benches, "mean"]:
            scope = None if bench == "mean" else [bench]
            for method in methods:
                row = {"pair": pair, "benchmark": bench, "method": method}
                for name, fn in (("speedup", table.speedup), ("al", table.al), ("call_rate", table.call_rate)):
                    ci = fn(method, [pair], scope)
                    row.update({name: ci.value, f"{name}_lo": ci.low, f"{name}_hi": ci.high})
                    row.setdefault("n", ci.n)
                rows.append(row)
    return pd.DataFrame(rows)


def offline_prompt_intervals(turns: pd.DataFrame, n_resamples: int = DEFAULT_RESAMPLES, seed: int = 0,
                             contrasts: Sequence[tuple[str, str]] = ()) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Offline shares of the oracle with prompt-resampled CIs.

    ``turns``: one row per (turn, policy) with ``pair``, ``report``, ``question_id``, ``turn``, ``policy``
    and ``tau`` (the turn's tokens/s under the policy's schedule); the policy ``oracle`` must be there.
    A prompt carries all its turns (they are not independent); prompts are resampled within reports.
    Returns (per pair, and ``all pairs`` pooled, x policy: ``pct_of_oracle`` [CI], ``turns``, ``prompts``; per pair x contrast
    (a, b): ``a - b`` in points of the oracle [CI])."""
    share_rows, contrast_rows = [], []
    scopes = [*turns.groupby("pair", sort=False), ("all pairs", turns)]
    for pair, t in scopes:
        per_prompt = t.pivot_table(index=["report", "question_id"], columns="policy", values="tau", aggfunc="sum")
        n_turns = t.drop_duplicates(["report", "question_id", "turn"]).shape[0]
        w = bootstrap_weights(per_prompt.index.get_level_values("report"), n_resamples, seed)
        oracle = per_prompt["oracle"].to_numpy(np.float64)
        for policy in per_prompt.columns:
            own = per_prompt[policy].to_numpy(np.float64)
            ci = interval(lambda w, a=own: 100 * (w @ a) / (w @ oracle), w, len(per_prompt))
            share_rows.append({"pair": pair, "policy": policy, "pct_of_oracle": ci.value, "pct_of_oracle_lo": ci.low,
                               "pct_of_oracle_hi": ci.high, "turns": n_turns, "prompts": len(per_prompt)})
        for a, b in contrasts:
            if a not in per_prompt or b not in per_prompt:
                continue
            diff = per_prompt[a].to_numpy(np.float64) - per_prompt[b].to_numpy(np.float64)
            ci = interval(lambda w, d=diff: 100 * (w @ d) / (w @ oracle), w, len(per_prompt))
            contrast_rows.append({"pair": pair, "contrast": f"{a} - {b}", "points_of_oracle": ci.value,
                                  "points_lo": ci.low, "points_hi": ci.high, "turns": n_turns,
                                  "prompts": len(per_prompt)})
    return pd.DataFrame(share_rows), pd.DataFrame(contrast_rows)
