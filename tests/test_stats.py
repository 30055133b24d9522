"""The bootstrap behind every CI (treegraft.stats, pipeline/estimates.py), checked against known answers."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from scipy import stats as scipy_stats

from treegraft.pipeline.estimates import PromptTable, method_intervals, offline_prompt_intervals
from treegraft.pipeline.common import fold_intervals
from treegraft.stats import Interval, bootstrap_weights, interval, ratio_of_sums


def test_weights_keep_every_stratum_size_and_are_reproducible():
    strata = ["a"] * 3 + ["b"] * 5 + ["c"]
    w = bootstrap_weights(strata, 500, seed=3)
    assert w.shape == (500, 9)
    assert (w[:, :3].sum(axis=1) == 3).all() and (w[:, 3:8].sum(axis=1) == 5).all() and (w[:, 8] == 1).all()
    assert np.array_equal(w, bootstrap_weights(strata, 500, seed=3))
    assert not np.array_equal(w, bootstrap_weights(strata, 500, seed=4))


def test_mean_ci_matches_the_normal_theory_interval():
    """For the mean of n = 400 normal draws the percentile CI is mean +- 1.96 s / sqrt(n) (to ~5%)."""
    x = np.random.default_rng(0).normal(10.0, 2.0, 400)
    ci = interval(lambda w: (w @ x) / w.sum(axis=1), bootstrap_weights(["s"] * 400, 4000, seed=1))
    half = 1.96 * x.std(ddof=1) / np.sqrt(len(x))
    assert ci.value == pytest.approx(x.mean())
    assert ci.low == pytest.approx(x.mean() - half, abs=0.06 * half)
    assert ci.high == pytest.approx(x.mean() + half, abs=0.06 * half)
    assert ci.n == 400


def test_mean_ci_agrees_with_scipy_percentile_bootstrap():
    x = np.random.default_rng(5).exponential(1.0, 60)
    ours = interval(lambda w: (w @ x) / w.sum(axis=1), bootstrap_weights(["s"] * 60, 8000, seed=0))
    theirs = scipy_stats.bootstrap((x,), np.mean, n_resamples=8000, method="percentile", random_state=0).confidence_interval
    width = theirs.high - theirs.low
    assert ours.low == pytest.approx(theirs.low, abs=0.05 * width)
    assert ours.high == pytest.approx(theirs.high, abs=0.05 * width)


def test_stratified_ci_matches_the_stratified_variance():
    """Two strata of unequal spread: the CI of the overall mean of stratum means has half-width
    1.96 * sqrt(sum_s var_s / n_s) / 2 (the strata are not mixed)."""
    rng = np.random.default_rng(2)
    a, b = rng.normal(0, 1, 300), rng.normal(50, 4, 300)
    x = np.concatenate([a, b])
    strata = ["a"] * 300 + ["b"] * 300
    sa, sb = np.arange(300), np.arange(300, 600)
    stat = lambda w: ((w[:, sa] @ x[sa]) / 300 + (w[:, sb] @ x[sb]) / 300) / 2  # noqa: E731
    ci = interval(stat, bootstrap_weights(strata, 4000, seed=0))
    half = 1.96 * np.sqrt(a.var(ddof=1) / 300 + b.var(ddof=1) / 300) / 2
    assert ci.half_width == pytest.approx(half, rel=0.07)
    # unstratified resampling would add the between-strata variance (means 0 and 50): far wider
    wide = interval(lambda w: (w @ x) / w.sum(axis=1), bootstrap_weights(["s"] * 600, 2000, seed=0))
    assert wide.half_width > 3 * ci.half_width


def test_a_constant_ratio_has_a_zero_width_ci_however_the_prompts_vary():
    """Paired: a method exactly twice as fast on every prompt is 2.00x with no uncertainty, even when the
    prompts' times span two orders of magnitude."""
    ar = np.random.default_rng(1).uniform(1, 100, 40)
    ci = interval(ratio_of_sums(ar, ar / 2), bootstrap_weights(["s"] * 40, 1000))
    assert (ci.value, ci.low, ci.high) == pytest.approx((2.0, 2.0, 2.0))


def test_one_prompt_a_benchmark_has_no_ci_not_a_zero_width_one():
    """Resampling within benchmarks of one prompt each redraws the same sample every time: the CI is
    undefined (shown as "[no CI]"), where a zero-width interval would claim certainty."""
    ar, method = np.array([3.0, 5.0, 9.0]), np.array([1.0, 4.0, 2.0])
    ci = interval(ratio_of_sums(ar, method), bootstrap_weights(["a", "b", "c"], 500))
    assert ci.value == pytest.approx(17 / 7) and ci.low != ci.low and ci.high != ci.high
    assert ci.format() == "2.43 [no CI]" and not ci.excludes(1.0)
    pooled = interval(ratio_of_sums(ar, method), bootstrap_weights(["s"] * 3, 500))
    assert pooled.low < pooled.value < pooled.high  # the same prompts in one stratum do resample


def _records(times: dict[str, list[float]], benchmarks: list[str], pair: str = "p") -> pd.DataFrame:
    rows = []
    for method, walls in times.items():
        for q, wall in enumerate(walls):
            rows.append({"pair": pair, "benchmark": benchmarks[q], "method": method, "question_id": q, "wall_time": wall,
                         "new_tokens": 10, "accepted_sum": 0 if method == "ar" else 4, "turns": 0 if method == "ar" else 2,
                         "middle_calls": 1, "steps": 5})
    return pd.DataFrame(rows)


def test_prompt_table_speedup_is_the_mean_of_per_benchmark_ratios():
    benches = ["x", "x", "y", "y"]
    rec = _records({"ar": [2, 4, 10, 10], "m": [1, 1, 10, 5]}, benches)
    t = PromptTable(rec, 500)
    ci = t.speedup("m", ["p"])
    assert ci.value == pytest.approx((6 / 2 + 20 / 15) / 2)
    assert ci.n == 4
    assert t.speedup("m", ["p"], ["x"]).value == pytest.approx(3.0)
    assert t.al("m", ["p"]).value == pytest.approx(2.0)
    assert t.call_rate("m", ["p"]).value == pytest.approx(0.2)
    assert t.speedup("ar", ["p"]).low == pytest.approx(1.0) and t.speedup("ar", ["p"]).high == pytest.approx(1.0)


def test_gain_is_against_the_better_rival_and_its_ci_excludes_zero_when_always_ahead():
    rng = np.random.default_rng(0)
    ar = rng.uniform(5, 15, 30)
    benches = ["x"] * 15 + ["y"] * 15
    rec = _records({"ar": list(ar), "tg": list(ar / 1.5 * rng.uniform(0.97, 1.03, 30)),
                    "e1": list(ar / 1.2), "e2": list(ar / 1.1)}, benches)
    t = PromptTable(rec, 1000)
    gain = t.gain("tg", ["e1", "e2"], ["p"])
    assert gain.value == pytest.approx(100 * (t.speedup("tg", ["p"]).value / 1.2 - 1))
    assert gain.low > 0 and gain.excludes(0.0)
    assert t.best(["e1", "e2"], ["p"]) == "e1"


def test_a_method_on_fewer_prompts_is_resampled_over_its_own():
    rec = _records({"ar": [2, 4, 6, 8], "m": [1, 2, 3, 4]}, ["x", "x", "y", "y"])
    rec = rec[~((rec["method"] == "m") & rec["question_id"].isin([1, 3]))]  # an ablation on the first prompt each
    ci = PromptTable(rec, 200).speedup("m", ["p"])
    assert ci.n == 2 and ci.value == pytest.approx(2.0)
    assert ci.low != ci.low  # its own prompts are one a benchmark: nothing to resample, no CI


def test_method_intervals_has_a_mean_row_per_method():
    rec = _records({"ar": [2, 4, 10, 10], "m": [1, 1, 10, 5]}, ["x", "x", "y", "y"])
    out = method_intervals(rec, 200).set_index(["benchmark", "method"])
    assert {"x", "y", "mean"} == set(out.index.get_level_values(0))
    row = out.loc[("mean", "m")]
    assert row["speedup_lo"] <= row["speedup"] <= row["speedup_hi"] and row["n"] == 4


def test_offline_shares_resample_prompts_not_turns():
    """A prompt whose turns all agree counts once: 2 prompts x 50 identical turns give the same CI as
    2 prompts x 1 turn (resampling turns would make it look 50x more certain)."""
    def frame(turns_per_prompt):
        rows = []
        for q, share in ((0, 0.6), (1, 1.0)):
            for turn in range(turns_per_prompt):
                rows += [{"pair": "p", "report": "p/x", "question_id": q, "turn": turn, "policy": "oracle", "tau": 10.0},
                         {"pair": "p", "report": "p/x", "question_id": q, "turn": turn, "policy": "a", "tau": 10 * share},
                         {"pair": "p", "report": "p/x", "question_id": q, "turn": turn, "policy": "b", "tau": 5.0}]
        return pd.DataFrame(rows)

    one, _ = offline_prompt_intervals(frame(1), 1000)
    many, contrasts = offline_prompt_intervals(frame(50), 1000, contrasts=[("a", "b")])
    assert set(many["pair"]) == {"p", "all pairs"}
    one, many, contrasts = (f[f["pair"] == "p"] for f in (one, many, contrasts))
    a1, a50 = one.set_index("policy").loc["a"], many.set_index("policy").loc["a"]
    assert a1["pct_of_oracle"] == pytest.approx(80.0) and a50["pct_of_oracle"] == pytest.approx(80.0)
    assert (a50["pct_of_oracle_lo"], a50["pct_of_oracle_hi"]) == pytest.approx((a1["pct_of_oracle_lo"], a1["pct_of_oracle_hi"]))
    assert a50["pct_of_oracle_lo"] == pytest.approx(60.0) and a50["pct_of_oracle_hi"] == pytest.approx(100.0)
    assert a50["prompts"] == 2 and a50["turns"] == 100
    c = contrasts.iloc[0]
    assert c["contrast"] == "a - b" and c["points_of_oracle"] == pytest.approx(30.0)


def test_display_tables_fold_each_ci_into_its_cell():
    df = pd.DataFrame({"method": ["m"], "speedup": [1.234], "speedup lo": [1.1], "speedup hi": [1.3], "n": [4]})
    shown = fold_intervals(df)
    assert list(shown.columns) == ["method", "speedup", "n"]
    assert shown.loc[0, "speedup"] == "1.23 [1.10, 1.30]"
    assert Interval(float("nan"), 0, 0, 0).format() == "--"


def test_two_runs_on_the_same_prompts_compare_paired():
    """Run B is run A with one method 10% slower on every prompt: B's speedup is A's / 1.1 in every
    replicate, so B - A = -A / 11 exactly, CI included (the runs are resampled together)."""
    ar = [2.0, 4.0, 10.0, 10.0]
    a = _records({"ar": ar, "m": [1, 1, 5, 5]}, ["x", "x", "y", "y"], pair="A")
    b = _records({"ar": ar, "m": [1.1, 1.1, 5.5, 5.5]}, ["x", "x", "y", "y"], pair="B")
    t = PromptTable(pd.concat([a, b], ignore_index=True), 500)
    d = t.run_difference("m", "A", "B")
    expected = t.speedup("m", ["B"]).value - t.speedup("m", ["A"]).value
    assert d.value == pytest.approx(expected) and expected < 0
    first = t.speedup("m", ["A"])
    assert first.high > first.low  # the prompts differ ...
    assert d.low == pytest.approx(-first.high / 11) and d.high == pytest.approx(-first.low / 11) and d.n == 4
