"""The report from records alone (no model, no smoke run): the gain across pairs and its CIs, the
scheduling table, the index of what was written and what was not run, stale files, summary CIs."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from treegraft.pipeline.estimates import PromptTable
from treegraft.pipeline.records import summarize_records
from treegraft.pipeline.report import (OVER_PAIRS, STUDIES, gain_table, headline_metrics, make_tables, not_run,
                                       scheduling_table)

from .conftest import compose

BENCHES = ["x"] * 10 + ["y"] * 10


def _records(pairs: dict[str, dict[str, float]], seed: int = 0) -> pd.DataFrame:
    """Read_records' frame: per pair, each method's time per prompt = ar's / its speedup x noise; treegraft
    calls the middle drafter on 30% of its steps."""
    rng = np.random.default_rng(seed)
    ar = rng.uniform(5, 15, len(BENCHES))
    rows = []
    for pair, speedups in pairs.items():
        for method, speedup in {"ar": 1.0, **speedups}.items():
            noise = np.ones(len(BENCHES)) if method == "ar" else rng.uniform(0.9, 1.1, len(BENCHES))
            for q, (bench, wall) in enumerate(zip(BENCHES, ar / speedup * noise)):
                rows.append({"pair": pair, "benchmark": bench, "method": method, "question_id": q, "wall_time": wall,
                             "new_tokens": 20, "turns": 5, "accepted_sum": 10, "middle_calls": 3 if method == "treegraft" else 0,
                             "steps": 10, "t_small_s": 0.1, "t_middle_s": 0.1, "t_verify_s": 0.7, "t_other_s": 0.1,
                             "matches_ar": None if method == "ar" else True, "mismatch_explained": None,
                             "mismatch_unchecked": False, "mean_budget": 8.0, "runtime": "float32", "tree_shape": "auto",
                             "cpu": "cpu", "cpu_capability": "AVX2"})
    return pd.DataFrame(rows)


THREE = {"a": {"all_small": 1.2, "all_mid": 1.5, "treegraft": 1.8, "hf_assisted": 1.1},  # all_mid wins: +20%
         "b": {"all_small": 1.6, "all_mid": 1.3, "treegraft": 1.7, "hf_assisted": 1.2},  # all_small wins: +6%
         "c": {"all_small": 1.4, "all_mid": 1.45, "treegraft": 1.35, "hf_assisted": 1.0}}  # behind: -7%


def test_the_gain_across_pairs_is_resampled_from_one_draw_with_the_better_endpoint_picked_per_pair_and_replicate():
    rec = _records(THREE)
    t = PromptTable(rec, 400)
    over = t.gain_over_pairs("treegraft", ["all_small", "all_mid"], ["a", "b", "c"])
    per_pair = {p: t.gain("treegraft", ["all_small", "all_mid"], [p]) for p in "abc"}
    assert over.pairs == ["a", "b", "c"] and over.argmax == "a" and over.argmin == "c"
    assert over.mean.value == pytest.approx(np.mean([g.value for g in per_pair.values()]))
    assert over.max.value == pytest.approx(per_pair["a"].value) and over.min.value == pytest.approx(per_pair["c"].value)
    assert over.min.value < 0 < over.max.value and over.mean.n == len(BENCHES)
    # the same statistics computed by hand on the table's own replicates (every pair in every row of w)
    w = t._weights_for(np.ones(len(BENCHES), bool))
    wide = rec.pivot_table(index=["benchmark", "question_id"], columns=["pair", "method"], values="wall_time")
    strata = wide.index.get_level_values("benchmark").to_numpy()

    def speedup(pair, method):
        return np.mean([(w[:, strata == b] @ wide[(pair, "ar")].to_numpy()[strata == b])
                        / (w[:, strata == b] @ wide[(pair, method)].to_numpy()[strata == b]) for b in ("x", "y")], axis=0)

    gains = np.stack([100 * (speedup(p, "treegraft") / np.maximum(speedup(p, "all_small"), speedup(p, "all_mid")) - 1)
                      for p in "abc"])
    for ci, reduce in ((over.mean, np.mean), (over.max, np.max), (over.min, np.min)):
        assert (ci.low, ci.high) == pytest.approx(tuple(np.quantile(reduce(gains, axis=0), [0.025, 0.975])))
    # not the per-pair CIs relabelled: the max over pairs of each replicate is at least every pair's
    assert over.max.low >= per_pair["a"].low - 1e-9 and over.mean.high - over.mean.low < per_pair["a"].high - per_pair["a"].low


def test_the_gain_table_ends_with_the_rows_across_pairs_naming_the_pairs_at_max_and_min():
    rec = _records(THREE)
    t = PromptTable(rec, 300)
    table = gain_table(summarize_records(rec), prompts=t).set_index("pair")
    assert list(table.index) == ["a", "b", "c", *OVER_PAIRS.values()]
    mean, top, worst = (table.loc[OVER_PAIRS[k]] for k in ("mean", "max", "min"))
    assert top["better endpoint"] == "at a" and worst["better endpoint"] == "at c" and mean["better endpoint"] == "per pair"
    col = "gain vs better endpoint %"
    assert worst[col] == pytest.approx(table.loc["c", col]) and worst[col] < 0
    assert mean[f"{col} lo"] < mean[col] < mean[f"{col} hi"] and mean["n pairs"] == 3 and mean["n prompts"] == 20
    hf = "gain vs best HF peer %"
    assert top[hf] == pytest.approx(table[hf].iloc[:3].max())  # the HF peer's max may be at another pair
    metrics = headline_metrics({"gain": table.reset_index()})
    for stat in ("mean", "max", "min"):
        key = f"gain/all_pairs/{stat}_gain_vs_better_endpoint_%"
        assert metrics[key] == pytest.approx(table.loc[OVER_PAIRS[stat], col])
        assert metrics[f"{key}_lo"] < metrics[f"{key}_hi"] and metrics[f"{key}_n"] == 20
        assert f"gain/all_pairs/{stat}_gain_vs_best_HF_peer_%" in metrics
    assert not any(OVER_PAIRS["mean"] in k for k in metrics)  # the summary rows are not logged as pairs


def test_with_one_pair_the_rows_across_pairs_equal_its_row():
    rec = _records({"a": THREE["a"]})
    table = gain_table(summarize_records(rec), prompts=PromptTable(rec, 300)).set_index("pair")
    cols = [f"gain vs {label} %{end}" for label in ("better endpoint", "best HF peer") for end in ("", " lo", " hi")]
    for name in OVER_PAIRS.values():
        assert table.loc[name, cols].tolist() == table.loc["a", cols].tolist()
        assert table.loc[name, "n prompts"] == table.loc["a", "n prompts"] and table.loc[name, "n pairs"] == 1
    assert table.loc["a", "gain vs better endpoint % lo"] > 0  # a real CI, compared exactly, not two NaNs


def test_scheduling_puts_the_call_rate_beside_the_gain_and_names_the_better_endpoint():
    rec = _records(THREE)
    table = scheduling_table(summarize_records(rec), prompts=PromptTable(rec, 200)).set_index("pair")
    assert table["better endpoint"].to_dict() == {"a": "all_mid", "b": "all_small", "c": "all_mid"}
    assert table.loc["a", "treegraft call rate"] == pytest.approx(0.3)
    cols = list(table.columns)
    assert cols.index("gain vs better endpoint %") == cols.index("treegraft call rate") + 4  # rate [lo, hi], endpoint
    assert table.loc["b", "gain vs better endpoint % lo"] == table.loc["b", "gain vs better endpoint % lo"]


def _write_records(eval_dir, rec: pd.DataFrame) -> None:
    """``rec`` as evaluate's jsonl records (the fields read_records reads)."""
    for (pair, bench, method), g in rec.groupby(["pair", "benchmark", "method"]):
        lines = [json.dumps({"pair": pair, "benchmark": bench, "method": method, "question_id": int(r.question_id),
                             "choices": [{"new_tokens": [int(r.new_tokens)], "wall_time": [float(r.wall_time)]}],
                             "turns": int(r.turns), "accepted": [int(r.accepted_sum)], "middle_calls": int(r.middle_calls),
                             "steps": int(r.steps), "matches_ar": r.matches_ar,
                             "time_split": {"small_s": 0.1, "middle_s": 0.1, "verify_s": 0.7, "other_s": 0.1}})
                 for r in g.itertuples()]
        path = eval_dir / pair / bench / f"{method}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(lines) + "\n")


def test_a_study_not_run_leaves_no_file_and_the_index_says_which_experiment_runs_it(tmp_path):
    exp = tmp_path / "cpu_llama"
    _write_records(exp / "evaluate", _records({"a": THREE["a"]}))
    report = exp / "report"
    report.mkdir()
    (report / "ablation.csv").write_text("\n")  # what an older report wrote for a study with no rows
    (report / "ablation.md").write_text("|  |\n")
    tables = make_tables(exp, [], ["mt_bench"], n_resamples=200)
    assert "ablation" not in tables and "sensitivity" not in tables and "held_out" not in tables
    assert not list(report.glob("ablation.*")) and not list(report.glob("sensitivity.*"))
    index = (report / "README.md").read_text()
    assert "[main](main.md)" in index and "[gain](gain.md)" in index and "| 20 |" in index
    lines = not_run(tables, "cpu_llama")
    assert set(lines) == {"ablation", "sensitivity", "held_out", "held_out_pair", "offline_scheduler",
                          "offline_contrasts", "oof", "small_drafter", "grafting"}
    for name, line in lines.items():
        assert f"- {line}" in index and "\n" not in line
    assert "`experiment=cpu_ablations`" in lines["ablation"] and "`experiment=cpu_small`" in lines["small_drafter"]
    assert "make distill" in lines["offline_scheduler"]
    assert "mean over 1 pair(s): +" in index and "(n = 20 prompts)" in index
    # the summary carries its CIs and n like every other table
    summary = pd.read_csv(report / "summary.csv")
    row = summary[(summary["method"] == "treegraft") & (summary["benchmark"] == "x")].iloc[0]
    assert row["speedup lo"] < row["speedup"] < row["speedup hi"] and row["n prompts"] == 10
    assert row["mean_al lo"] == pytest.approx(2.0) and row["mean_al hi"] == pytest.approx(2.0)
    assert "speedup [lo, hi]" not in summary and "[" in (report / "summary.md").read_text()
    intervals = tables["intervals"].set_index(["benchmark", "method"])
    assert row["speedup"] == pytest.approx(intervals.loc[("x", "treegraft"), "speedup"])
    # a study this experiment runs but whose records are missing says so
    assert "records are missing" in not_run(tables, "cpu_full")["sensitivity"]


@pytest.mark.parametrize("study, runs", [
    ("ablation", lambda c: {"fixed", "no_nondestructive", "no_expanded_selection", "all_call", "direct_planner"}
     & set(c.evaluation.methods)),
    ("sensitivity", lambda c: list(c.evaluation.get("sensitivity") or [])),
    ("held_out_pair", lambda c: list(c.pipeline.held_out_pairs or [])),
])
def test_each_experiment_the_index_names_for_a_study_runs_it(study, runs):
    assert STUDIES[study].experiments
    for experiment in STUDIES[study].experiments:
        cfg = compose("evaluate", [f"experiment={experiment}"])
        assert runs(cfg), f"experiment={experiment} does not run {study}: fix report.STUDIES"
