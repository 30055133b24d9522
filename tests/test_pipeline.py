"""The scheduler pipeline (collect, fit, distill): the smoke experiment end to end, resumable collect,
grouped folds, the margin teacher on a synthetic value system, predictor save/load, stage errors."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from treegraft.pipeline.artifacts import MissingArtifactError, stage_dir
from treegraft.pipeline.collect import COST_FEATURES, apply_cost_model, fit_cost_model, run_collect
from treegraft.pipeline.distill import IN_SAMPLE_DISTILLED, IN_SAMPLE_PLANNER, distill_predictor, run_distill
from treegraft.pipeline.evaluate import read_records, rotated_order, run_evaluate, run_key
from treegraft.pipeline.report import OVER_PAIRS, make_figures, make_tables
from treegraft.pipeline.fit import run_fit
from treegraft.scheduling.features import ALL_FEATURES, state_names, state_vector, suffix_vector
from treegraft.scheduling.policy import StepState
from treegraft.scheduling.learned import MarginPredictor, plan_margins
from treegraft.scheduling.offline import evaluate_policies
from treegraft.scheduling.value import (MLPConfig, ValueSystem, fit_value_system, grouped_folds, latency_prior_s,
                                        select_signals, train_mlp)

from .conftest import compose


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """`make collect fit distill EXPERIMENT=smoke` into a temporary outputs folder."""
    out = tmp_path_factory.mktemp("outputs")
    cfg = compose("collect", ["experiment=smoke", f"paths.output_dir={out}"])
    summary = run_collect(cfg)
    fit_info = run_fit(compose("fit", ["experiment=smoke", f"paths.output_dir={out}"]))
    distill_info = run_distill(compose("distill", ["experiment=smoke", f"paths.output_dir={out}"]))
    run_evaluate(compose("evaluate", ["experiment=smoke", f"paths.output_dir={out}"]))
    return cfg, out, summary, fit_info, distill_info


def test_smoke_pipeline_writes_every_artifact(smoke):
    cfg, out, summary, fit_info, distill_info = smoke
    base = out / "pipeline" / "smoke"
    shards = sorted((base / "collect" / "tiny-random").glob("*/q*.parquet"))
    assert len(shards) == len(cfg.pipeline.fit_benchmarks) * cfg.pipeline.prompts_per_benchmark
    assert int(summary["rows"].sum()) == sum(len(pd.read_parquet(p)) for p in shards)
    for rel in ["collect/config.yaml", "collect/inputs.json", "collect/tiny-random/cost_model.json",
                "collect/tiny-random/runtime.json", "fit/value_heads.pt", "fit/value_heads.meta.json",
                "fit/oof_summary.md", "fit/oof_table.csv", "fit/config.yaml", "distill/scheduler.pt",
                "distill/scheduler.meta.json", "distill/offline_eval.md", "distill/distill.json"]:
        assert (base / rel).is_file(), rel
    table = pd.read_csv(base / "distill" / "offline_eval.csv")
    assert set(table["pair"]) == {"tiny-random", "all pairs"}  # per pair, and pooled
    pooled = table[table["pair"] == "all pairs"].set_index("policy")
    assert (pooled["mean_tau"] <= pooled.loc["oracle", "mean_tau"] + 1e-9).all()  # nothing beats the per-turn oracle
    assert pooled.loc["oracle", "pct_of_oracle"] == pytest.approx(100.0)
    for name in (IN_SAMPLE_DISTILLED, IN_SAMPLE_PLANNER):  # the deployed policies on the very turns they were fitted on
        assert pooled.loc[name, "turns"] == pooled.loc["oracle", "turns"]
    folds = pd.read_csv(base / "distill" / "offline_eval_per_fold.csv")
    oracle_folds = folds[folds["policy"] == "oracle"]  # pooled totals: all tokens over all seconds of every fold
    assert pooled.loc["oracle", "total_tau"] == pytest.approx(oracle_folds["tokens"].sum() / oracle_folds["seconds"].sum())
    assert distill_info["ms_per_decision_scheduler"] < 1.0
    assert json.loads((base / "fit" / "selection.json").read_text())["chosen_signals"] == fit_info["chosen_signals"]


def test_collect_resumes_without_losing_or_duplicating_rows(smoke):
    cfg, out, summary, _, _ = smoke
    root = out / "pipeline" / "smoke" / "collect" / "tiny-random"
    shards = sorted(root.glob("*/q*.parquet"))
    before = {p: (p.stat().st_mtime_ns, len(pd.read_parquet(p))) for p in shards}
    shards[0].unlink()  # as if interrupted before that prompt finished
    (root / shards[0].parent.name / ".q0.parquet.123.tmp").write_text("half-written")  # a stale temp file
    again = run_collect(cfg)
    after = {p: (p.stat().st_mtime_ns, len(pd.read_parquet(p))) for p in sorted(root.glob("*/q*.parquet"))}
    assert set(after) == set(before)
    assert after[shards[0]][1] == before[shards[0]][1]  # the redone prompt has the same rows
    assert all(after[p] == before[p] for p in shards[1:])  # finished prompts are not redone
    assert int(again["rows"].sum()) == int(summary["rows"].sum())


def test_collect_rerun_with_every_shard_present_loads_no_model(smoke, monkeypatch):
    cfg, out, summary, _, _ = smoke
    root = out / "pipeline" / "smoke" / "collect" / "tiny-random"
    shards = {p: p.stat().st_mtime_ns for p in root.glob("*/q*.parquet")}
    runtime = (root / "runtime.json").read_text()

    def no_model(*args, **kwargs):
        raise AssertionError("collect loaded a model although every shard was on disk")

    monkeypatch.setattr("treegraft.models.load_pair", no_model)
    again = run_collect(cfg)
    assert {p: p.stat().st_mtime_ns for p in root.glob("*/q*.parquet")} == shards
    assert (root / "runtime.json").read_text() == runtime  # the measured runtime context is kept
    assert int(again["rows"].sum()) == int(summary["rows"].sum())


def test_stage_without_its_inputs_names_the_stage_to_run(tmp_path):
    cfg = compose("fit", ["experiment=smoke", f"paths.output_dir={tmp_path}"])
    with pytest.raises(MissingArtifactError, match="run the `collect` stage first"):
        run_fit(cfg)
    (stage_dir(tmp_path, "smoke", "collect")).mkdir(parents=True)
    with pytest.raises(MissingArtifactError, match="run the `fit` stage first"):
        run_distill(compose("distill", ["experiment=smoke", f"paths.output_dir={tmp_path}"]))


def test_grouped_folds_never_split_a_report():
    rng = np.random.default_rng(0)
    groups = rng.choice([f"pair{p}/bench{b}" for p in range(3) for b in range(4)], size=500)
    folds = grouped_folds(groups, 5)
    assert len(folds) == 5
    seen_test = []
    for train, test in folds:
        assert not set(groups[train]) & set(groups[test])
        seen_test += list(test)
    assert sorted(seen_test) == list(range(500))  # every row is out-of-fold exactly once
    with pytest.raises(ValueError, match="at least 2 reports"):
        grouped_folds(np.array(["a"] * 10))


class SyntheticValues(ValueSystem):
    """tau(call now, suffix) = 10 + f; tau(skip now, suffix) = 12 + (calls in the suffix), f = first signal."""

    def throughput(self, x, branch):
        n_state = len(state_names(self.depth, self.signals))
        f = x[:, n_state - 1]
        calls_in_suffix = x[:, n_state:].sum(axis=1)
        return 10.0 + f if branch == "call" else 12.0 + calls_in_suffix


def test_margin_teacher_enumerates_suffixes_and_gets_the_sign_right():
    depth = 5
    vs = SyntheticValues(depth=depth, signals=["node_count"])
    n = len(state_names(depth, vs.signals))
    states, steps, expected = [], [], []
    for step in range(1, depth + 1):
        for f in (0.0, 1.0, 4.5, 9.0):
            x = np.zeros(n)
            x[-1] = f
            states.append(x)
            steps.append(step)
            # best skip suffix calls at every later step: 12 + (D - t)
            expected.append((10.0 + f) - (12.0 + (depth - step)))
    margins = plan_margins(vs, np.array(states), np.array(steps))
    assert np.allclose(margins, expected)
    assert ((margins > 0) == (np.array(expected) > 0)).all()
    assert (margins > 0).any() and (margins < 0).any()


def test_suffix_encoding_is_aligned_to_absolute_steps():
    assert suffix_vector(2, "101", 5).tolist() == [0, 0, 1, 0, 1]
    assert suffix_vector(5, "", 5).tolist() == [0] * 5
    with pytest.raises(ValueError, match="must have 2 actions"):
        suffix_vector(3, "1", 5)


def test_state_keeps_only_the_selected_runtime_context():
    state = StepState(step=2, depth=5, history=[1], prompt_len=99, t_tgt_ms=120.0, t_mid_ms=30.0,
                      signals={"node_count": 7.0})
    names = state_names(5, ["t_mid_ms", "node_count", "t_tgt_ms"])
    assert names[:2] == ["t_tgt_ms", "t_mid_ms"] and names[-1] == "sig_node_count"
    assert state_vector(state, ["t_mid_ms", "node_count", "t_tgt_ms"]).tolist() == [120.0, 30.0, 0.4, 0.2, 1, 0, 0, 0, 0, 7.0]
    full = dict(zip(state_names(5, ALL_FEATURES), state_vector(state, ALL_FEATURES)))
    assert full["log_prompt_len"] == pytest.approx(np.log(100.0))
    with pytest.raises(ValueError, match="unknown scheduler feature"):
        state_names(5, ["prompt_length"])


def test_stepwise_selection_drops_a_runtime_feature_that_misleads():
    # log_prompt_len names the benchmark in training; on a held-out benchmark it points the wrong way
    rng = np.random.default_rng(3)
    rows = []
    for b in range(5):
        n = 160
        useful = rng.normal(size=n)
        plen = np.full(n, float(b))
        for action in (0, 1):
            al = 2 + useful + (0.5 * b if action else -0.5 * b) * (b < 4) + 0.1 * rng.normal(size=n)
            rows.append(pd.DataFrame({"report": f"p/b{b}", "action": action, "accepted": al, "latency_s": 0.1,
                                      "log_prompt_len": plen, "sig_node_count": useful}))
    df = pd.concat(rows, ignore_index=True)
    for name in state_names(1, ALL_FEATURES):
        if name not in df:
            df[name] = 0.0
    df["suffix_1"] = 0.0
    chosen, table = select_signals(df, 1, ["log_prompt_len", "node_count"], MLPConfig(hidden=(16,), epochs=60),
                                   search="greedy", n_folds=5)
    assert chosen == ["node_count"]
    assert "log_prompt_len" in set(table["subset"])  # the paper's state was the starting point


def test_artifacts_saved_before_the_context_was_selectable_keep_it(tmp_path):
    signals = ["node_count"]
    x = np.random.default_rng(4).normal(size=(50, len(state_names(5, ["log_prompt_len", "t_tgt_ms", "t_mid_ms", "log_tgt_mid_ratio", *signals]))))
    pred = MarginPredictor.fit(x, x[:, 0], 5, ["log_prompt_len", "t_tgt_ms", "t_mid_ms", "log_tgt_mid_ratio", *signals], MLPConfig(epochs=5))
    pred.save(tmp_path / "scheduler")
    meta = json.loads((tmp_path / "scheduler.meta.json").read_text())
    meta["signals"] = signals  # what an older fit wrote: tree signals only, the four runtime features implied
    (tmp_path / "scheduler.meta.json").write_text(json.dumps(meta))
    again = MarginPredictor.load(tmp_path / "scheduler")
    assert again.feature_names == pred.feature_names
    assert np.array_equal(again.predict(x), pred.predict(x))


def test_saved_and_reloaded_predictor_give_identical_margins(tmp_path):
    rng = np.random.default_rng(1)
    signals = ["depth_before", "node_count"]
    x = rng.normal(size=(300, len(state_names(5, signals))))
    y = x[:, 0] - 0.5 * x[:, -1]
    pred = MarginPredictor.fit(x, y, 5, signals, MLPConfig(epochs=50))
    pred.save(tmp_path / "scheduler")
    again = MarginPredictor.load(tmp_path / "scheduler")
    assert again.feature_names == pred.feature_names
    assert np.array_equal(again.predict(x), pred.predict(x))
    meta = json.loads((tmp_path / "scheduler.meta.json").read_text())
    assert meta["feature_names"] == state_names(5, signals)



def test_an_input_constant_in_training_cannot_move_the_prediction():
    # a one-pair fit sees one warm-up t_tgt; another run measures a slightly different one
    rng = np.random.default_rng(2)
    x = rng.normal(size=(400, 3))
    x[:, 1] = 113.0
    y = x[:, 0] + 0.5 * x[:, 2]
    model = train_mlp(x, y, MLPConfig(epochs=60))
    shifted = x.copy()
    shifted[:, 1] = 125.0
    assert np.array_equal(model.predict(shifted), model.predict(x))
    assert not np.allclose(model.predict(x[:, [0, 0, 2]] + 1.0), model.predict(x))  # the other inputs still count

def test_treegraft_deploys_the_best_fixed_schedule_where_the_distilled_scheduler_lost_offline(smoke):
    """distill's check: a distilled scheduler that does not beat the best fixed schedule on held-out prompts
    with the difference's CI above 0 (below it, tied with it, or ahead by less than the CI carries) is not
    deployed; the saved scheduler says which policy runs, and the loader returns that policy."""
    from treegraft.decoding.methods import load_learned_scheduler
    from treegraft.scheduling.learned import LearnedScheduler, fixed_fallback
    from treegraft.scheduling.policy import CostAwareFixedScheduler, FixedScheduler, StepState

    assert fixed_fallback(2.5, "00000") is None and fixed_fallback(None, "00000") is None
    assert fixed_fallback(-13.3, "01000") == {"policy": "fixed", "schedule": "01000",
                                              "distilled_minus_best_fixed_points": -13.3}
    assert fixed_fallback(0.0, "00000") == {"policy": "fixed", "schedule": "00000",
                                            "distilled_minus_best_fixed_points": 0.0}  # a tie is no evidence
    # with a CI, its lower end decides: a lead of +0.7 points at [-3.8, +5.4] deploys the fixed schedule
    assert fixed_fallback(0.7, "00000", ci_low=-3.8) == {"policy": "fixed", "schedule": "00000",
                                                         "distilled_minus_best_fixed_points": 0.7,
                                                         "distilled_minus_best_fixed_points_lo": -3.8}
    assert fixed_fallback(3.1, "00000", ci_low=0.0)["schedule"] == "00000"  # a CI touching 0 does not carry it
    assert fixed_fallback(3.1, "00000", ci_low=1.8) is None
    assert fixed_fallback(3.1, "00000", ci_low=float("nan"))["distilled_minus_best_fixed_points_lo"] is None
    # against making no calls (distill's second reference): its own keys, and the reference named
    assert fixed_fallback(2.1, "00000", ci_low=-5.2, reference="all-skip") == {
        "policy": "fixed", "schedule": "00000", "reference": "all-skip", "distilled_minus_all_skip_points": 2.1,
        "distilled_minus_all_skip_points_lo": -5.2}
    assert fixed_fallback(2.1, "00000", ci_low=0.4, reference="all-skip") is None
    policy = FixedScheduler("01000")
    assert [policy.decide(StepState(step=k, depth=5, history=[], prompt_len=9, t_tgt_ms=1.0, t_mid_ms=1.0))
            for k in range(1, 6)] == [0, 1, 0, 0, 0]
    with pytest.raises(ValueError, match="0/1 actions"):
        FixedScheduler("01x00")

    cfg, out, *_, distill_info = smoke
    diff_lo = next(c["points_lo"] for c in distill_info["contrasts"]
                   if c["pair"] == "all pairs" and c["contrast"].endswith("- best fixed"))
    loaded = load_learned_scheduler("treegraft", out / "pipeline" / "smoke")
    if not diff_lo > 0:  # NaN: too few smoke prompts for a CI, no evidence
        assert distill_info["deployed"]["policy"] == "fixed" and isinstance(loaded, CostAwareFixedScheduler)
        assert loaded.policy_name == "fixed:" + distill_info["deployed"]["schedule"]
    else:
        assert distill_info["deployed"] == {"policy": "distilled"} and isinstance(loaded, LearnedScheduler)
    meta_path = out / "pipeline" / "smoke" / "distill" / "scheduler.meta.json"
    meta = json.loads(meta_path.read_text())
    try:  # the other branch, through the same loader
        meta_path.write_text(json.dumps({**meta, "fallback": fixed_fallback(-1.0, "10000")}))
        assert load_learned_scheduler("treegraft", out / "pipeline" / "smoke").actions == [1, 0, 0, 0, 0]
        meta_path.write_text(json.dumps({**meta, "fallback": None}))
        assert isinstance(load_learned_scheduler("treegraft", out / "pipeline" / "smoke"), LearnedScheduler)
    finally:
        meta_path.write_text(json.dumps(meta))


def test_cost_model_recovers_per_call_costs():
    rng = np.random.default_rng(2)
    n = 400
    df = pd.DataFrame({k: rng.integers(0, 20, n) for k in COST_FEATURES})
    true = {"small_calls": 0.001, "middle_calls": 0.05, "middle_tokens": 0.002, "verified_nodes": 0.01}
    df["latency_measured_s"] = 0.1 + sum(df[k] * c for k, c in true.items())
    df["step"] = 1
    model = fit_cost_model(df)
    for k, c in true.items():
        assert model[f"{k}_s"] == pytest.approx(c, rel=1e-6, abs=1e-9)
    assert np.allclose(apply_cost_model(df, model), df["latency_measured_s"])


def test_cost_model_reads_verification_off_the_curve():
    """Verification is not linear in the tree size: with the measured curve as a feature, a latency that
    follows the curve is recovered exactly (without it, a line through the curve is not)."""
    rng = np.random.default_rng(3)
    n = 400
    curve = {1: 0.095, 2: 0.11, 4: 0.115, 8: 0.12, 16: 0.17, 32: 0.27}
    df = pd.DataFrame({k: rng.integers(0, 20, n) for k in COST_FEATURES})
    df["verified_nodes"] = rng.integers(0, 31, n)
    from treegraft.models.runtime import curve_at

    df["latency_measured_s"] = 0.01 + 0.04 * df["middle_calls"] + [curve_at(curve, b + 1) for b in df["verified_nodes"]]
    df["step"] = 1
    model = fit_cost_model(df, curve)
    assert model["verify_curve_s"] == pytest.approx(1.0, rel=1e-6) and model["r2"] > 0.999999
    assert np.allclose(apply_cost_model(df, json.loads(json.dumps(model))), df["latency_measured_s"])
    assert fit_cost_model(df)["r2"] < model["r2"]


def test_cost_model_never_prices_a_schedule_at_zero():
    """Latencies that grow faster than the curve feature (here 1.5 x curve - 0.05 s, as on a llama.cpp
    run) pull a free intercept to -0.05 s, and then the cheapest schedules cost ~0 s and their tokens/s
    label is unbounded; the intercept is held at >= 0 like every per-call cost, and every schedule is
    priced within 10% of what it took."""
    from sklearn.linear_model import LinearRegression

    from treegraft.models.runtime import curve_at

    curve = {1: 0.073, 2: 0.095, 4: 0.131, 8: 0.200, 12: 0.296, 16: 0.400, 24: 0.541, 32: 0.724}
    df = pd.DataFrame({k: np.zeros(31, dtype=int) for k in COST_FEATURES})
    df["verified_nodes"] = np.arange(31)
    df["latency_measured_s"] = [1.5 * curve_at(curve, b + 1) - 0.05 for b in df["verified_nodes"]]
    df["step"] = 1
    free = LinearRegression(positive=True).fit(np.c_[df["verified_nodes"], [curve_at(curve, b + 1) for b in range(31)]],
                                               df["latency_measured_s"])
    assert free.intercept_ < -0.04  # the case this guards against
    model = fit_cost_model(df, curve)
    assert model["intercept_s"] >= 0.0
    assert np.allclose(apply_cost_model(df, model), df["latency_measured_s"], rtol=0.1)
    with pytest.raises(ValueError, match="negative intercept_s"):
        apply_cost_model(df, {**model, "intercept_s": -0.1})


def test_cost_model_prices_cheap_schedules_by_relative_error():
    """A few schedules whose middle call also encoded the prompt (+3 s) must not set the price of the
    cheap ones: an absolute least-squares fit misprices the all-skip schedules by more than half (on a
    llama.cpp make all it priced them at 0 s, labelling them 1.5e6 tokens/s); the relative fit prices
    them within 5% and no schedule below half its tree's measured verification."""
    from sklearn.linear_model import LinearRegression

    from treegraft.models.runtime import curve_at
    from treegraft.pipeline.cost_model import CURVE_SCALE, _cost_matrix

    rng = np.random.default_rng(5)
    n = 640
    curve = {1: 0.056, 2: 0.067, 4: 0.098, 8: 0.14}
    calls = rng.integers(0, 6, n)
    df = pd.DataFrame({"small_calls": rng.integers(0, 12, n) * (calls < 5), "middle_calls": calls,
                       "middle_tokens": calls * 5 + rng.integers(0, 3, n) * (calls > 0),
                       "verified_nodes": np.minimum(calls + rng.integers(0, 2, n), 7), "step": 1})
    verify = np.array([curve_at(curve, b + 1) for b in df["verified_nodes"]])
    df["latency_measured_s"] = 0.025 * df["middle_tokens"] + verify
    df.loc[(calls > 0) & (rng.random(n) < 0.05), "latency_measured_s"] += 3.0
    skip = calls == 0
    measured = df["latency_measured_s"].to_numpy()
    x = np.c_[np.ones(n), _cost_matrix(df, curve)[0]]
    absolute = x @ LinearRegression(positive=True, fit_intercept=False).fit(x, measured).coef_
    assert np.median(np.abs(absolute[skip] / measured[skip] - 1)) > 0.5  # the case this guards against
    model = fit_cost_model(df, curve)
    priced = apply_cost_model(df, model)
    assert np.median(np.abs(priced[skip] / measured[skip] - 1)) < 0.05
    assert CURVE_SCALE[0] <= model["verify_curve_s"] <= CURVE_SCALE[1]
    assert np.all(priced >= CURVE_SCALE[0] * verify)
    assert model["median_relative_error"] < 0.05


def test_methods_run_ar_first_then_in_an_order_rotated_prompt_by_prompt():
    methods = ["ar", "all_small", "all_mid", "treegraft"]
    orders = [rotated_order(methods, k) for k in range(6)]
    assert all(o[0] == "ar" and sorted(o) == sorted(methods) for o in orders)
    # over 2 x 3 prompts every other method runs in every place, and right after every other method
    for place in (1, 2, 3):
        assert {o[place] for o in orders} == {"all_small", "all_mid", "treegraft"}
    for m in methods[1:]:
        assert {o[o.index(m) - 1] for o in orders if o.index(m) > 1} == set(methods[1:]) - {m}
    assert rotated_order(methods, 6) == orders[0]
    assert rotated_order(["all_small", "treegraft"], 1) == ["treegraft", "all_small"]  # without ar: the same rule


def test_evaluate_records_every_method_with_zero_greedy_mismatches(smoke):
    cfg, out, *_ = smoke
    eval_cfg = compose("evaluate", ["experiment=smoke", f"paths.output_dir={out}"])
    records = read_records(out / "pipeline" / "smoke" / "evaluate")
    methods = set(eval_cfg.evaluation.methods)
    assert set(records["method"]) == methods
    assert len(records) == len(methods) * len(eval_cfg.evaluation.benchmarks) * eval_cfg.evaluation.prompts_per_benchmark
    compared = records[records["method"] != "ar"]
    assert compared["matches_ar"].all(), compared[~compared["matches_ar"].astype(bool)]
    line = (out / "pipeline" / "smoke" / "evaluate" / "tiny-random" / "gsm8k" / "treegraft.jsonl").read_text().splitlines()[0]
    rec = json.loads(line)  # Spec-Bench / FastChat answer layout
    assert {"question_id", "model_id", "choices"} <= set(rec)
    assert {"turns", "new_tokens", "wall_time", "accept_lengths"} <= set(rec["choices"][0])


def test_outputs_that_differ_from_ar_are_checked_for_a_near_tie_after_the_workers(tmp_path, monkeypatch):
    """A pending mismatch (bfloat16 runtime) is decided once, with one float32 target loaded in the
    stage's own process, from the records on disk; with nothing pending no model is loaded."""
    import torch
    from omegaconf import OmegaConf

    import treegraft.pipeline.evaluate as evaluate_mod
    from treegraft.models import PairSpec, load_model

    cfg = OmegaConf.create({"pipeline": {"device": "cpu"}, "paths": {"models_dir": str(tmp_path)},
                            "evaluation": {"tie_tolerance": 1e9}})
    spec = PairSpec(name="tiny", target="tiny-random:0", middle="tiny-random:0")
    prompt, ref = [5, 9, 13, 21], [7, 7, 30, 31, 2]
    folder = tmp_path / "tiny" / "gsm8k"
    folder.mkdir(parents=True)
    rec = {"question_id": 3, "prompt_ids": prompt}
    (folder / "ar.jsonl").write_text(json.dumps({**rec, "tokens": ref}) + "\n")
    same = {**rec, "tokens": ref, "matches_ar": True, "mismatch_explained": True}
    pending = {**rec, "tokens": [7, 7, 44, 1, 2], "matches_ar": False, "mismatch_explained": None, "mismatch_position": 2}
    (folder / "all_small.jsonl").write_text(json.dumps(same) + "\n")
    loads = []
    monkeypatch.setattr(evaluate_mod, "load_model", lambda *a, **k: loads.append(a) or load_model(*a, **k))
    paths = [folder / "ar.jsonl", folder / "all_small.jsonl", folder / "treegraft.jsonl"]
    assert evaluate_mod.explain_mismatches(cfg, spec, paths) == 0 and loads == []  # nothing pending: no model
    (folder / "treegraft.jsonl").write_text(json.dumps(pending) + "\n")
    assert evaluate_mod.explain_mismatches(cfg, spec, paths) == 1 and len(loads) == 1
    out = json.loads((folder / "treegraft.jsonl").read_text())
    assert out["matches_ar"] is False and out["mismatch_explained"] is True and out["mismatch_position"] == 2
    with torch.inference_mode():  # the gap is the float32 target's top-2 logit gap at the first difference
        logits = load_model("tiny-random:0", "float32")(torch.tensor([prompt + ref[:2]])).logits[0, -1]
    top2 = logits.topk(2).values
    assert out["mismatch_top2_gap"] == pytest.approx(float(top2[0] - top2[1]), rel=1e-5)
    cfg.evaluation.tie_tolerance = 0.0  # decided records stay decided: a rerun loads nothing
    assert evaluate_mod.explain_mismatches(cfg, spec, paths) == 0 and len(loads) == 1


def test_a_near_tie_check_that_fits_nowhere_is_recorded_unchecked_without_loading(tmp_path, monkeypatch):
    """The float32 copy is never loaded where it does not fit (a Qwen3-32B in float32 is 131 GB): with no room
    on the device or the host, the pending records say why and count as unchecked; with an offload folder,
    accelerate places the copy (device_map with a disk entry)."""
    import torch
    from omegaconf import OmegaConf

    import treegraft.models.placement as placement_mod
    import treegraft.pipeline.evaluate as evaluate_mod
    from treegraft.models import PairSpec
    from treegraft.pipeline.records import summarize_records

    cfg = OmegaConf.create({"pipeline": {"device": "cpu"}, "paths": {"models_dir": str(tmp_path)},
                            "evaluation": {"tie_tolerance": 0.5}, "placement": {"offload_folder": None}})
    spec = PairSpec(name="tiny", target="tiny-random:0", middle="tiny-random:0")
    assert evaluate_mod.near_tie_placement(cfg, spec) == ({"device": torch.device("cpu")}, None)  # it fits: whole
    monkeypatch.setattr(placement_mod, "available_bytes", lambda placement, device: (1000, "nowhere"))
    where, why = evaluate_mod.near_tie_placement(cfg, spec)
    assert where is None and "a float32 copy of tiny-random:0 needs" in why and "\n" not in why
    folder = tmp_path / "tiny" / "gsm8k"
    folder.mkdir(parents=True)
    rec = {"question_id": 3, "prompt_ids": [5, 9]}
    (folder / "ar.jsonl").write_text(json.dumps({**rec, "tokens": [7, 7]}) + "\n")
    pending = {**rec, "tokens": [7, 8], "matches_ar": False, "mismatch_explained": None, "mismatch_position": 1}
    (folder / "treegraft.jsonl").write_text(json.dumps(pending) + "\n")
    loads = []
    monkeypatch.setattr(evaluate_mod, "load_model", lambda *a, **k: loads.append(a))
    assert evaluate_mod.explain_mismatches(cfg, spec, [folder / "treegraft.jsonl"]) == 0 and loads == []
    out = json.loads((folder / "treegraft.jsonl").read_text())
    assert out["mismatch_check"] == f"unchecked: {why}" and out["mismatch_explained"] is None
    assert evaluate_mod.explain_mismatches(cfg, spec, [folder / "treegraft.jsonl"]) == 0  # not retried
    cfg.placement.offload_folder = str(tmp_path / "offload")
    where, why = evaluate_mod.near_tie_placement(cfg, spec)
    assert why is None and where["device_map"] == "auto" and where["offload_folder"] == str(tmp_path / "offload")
    frame = pd.DataFrame([{"pair": "tiny", "benchmark": "gsm8k", "method": "treegraft", "question_id": 3,
                           "new_tokens": 2, "wall_time": 1.0, "turns": 1, "accepted_sum": 1, "middle_calls": 0,
                           "steps": 5, "matches_ar": False, "mismatch_explained": None, "mismatch_unchecked": True,
                           "t_small_s": 0.1, "t_middle_s": 0.0, "t_verify_s": 0.8, "t_other_s": 0.1, "mean_budget": 4.0,
                           "runtime": "float32", "tree_shape": "auto", "cpu": "x", "cpu_capability": "AVX2"}])
    row = summarize_records(frame).iloc[0]
    assert row["mismatches"] == 1 and row["mismatches_unexplained"] == 1 and row["mismatches_unchecked"] == 1


def test_tables_and_figures_from_saved_records_alone(smoke, tmp_path):
    _, out, *_ = smoke
    exp = out / "pipeline" / "smoke"
    tables = make_tables(exp, [], ["mt_bench"], out_dir=tmp_path)
    main = tables["main"].set_index("method")
    assert main.loc["ar", "mean speedup"] == pytest.approx(1.0)
    assert (main["mismatches"] == 0).all()
    # every figure carries its 95% CI and n: CSV columns, and "value [lo, hi]" cells in Markdown / LaTeX;
    # the smoke run evaluates 1 prompt of each of 2 benchmarks, and resampling within benchmarks of one
    # prompt has nothing to draw: the CI columns are empty and the cells say "[no CI]", never [x, x]
    assert (main["n prompts"] == 2).all()
    assert main["mean speedup"].notna().all()
    assert main["mean speedup lo"].isna().all() and main["mean speedup hi"].isna().all()
    gain = tables["gain"].iloc[0]
    for col in ("gain vs better endpoint %", "gain vs best HF peer %"):
        assert gain[col] == gain[col] and gain[f"{col} lo"] != gain[f"{col} lo"]
    assert set(tables["held_out"]["split"]) == {"held-out benchmark"}
    offline = tables["offline_scheduler"]
    assert offline["pct_of_oracle"].notna().all() and (offline["prompts"] > 0).all()
    assert offline["pct_of_oracle_lo"].isna().all()  # one collected prompt a benchmark: no CI either
    assert not tables["offline_contrasts"].empty
    md = (tmp_path / "main.md").read_text()
    assert "mean speedup" in md and "1.00 [no CI]" in md  # ar against itself
    for name in ("main", "gain", "ablation", "scheduling", "held_out", "offline_scheduler", "offline_contrasts", "oof",
                 "intervals", "summary"):
        for ext in ("csv", "md", "tex"):
            assert (tmp_path / f"{name}.{ext}").stat().st_size > 0, (name, ext)
    # one pair: the rows across pairs are its row; the summary carries the CI columns and n
    gains = tables["gain"].set_index("pair")
    cols = ["gain vs better endpoint %", "gain vs best HF peer %"]
    for name in OVER_PAIRS.values():
        assert gains.loc[name, cols].tolist() == gains.loc["tiny-random", cols].tolist()
    assert {"speedup lo", "speedup hi", "mean_al lo", "mean_al hi", "n prompts"} <= set(tables["summary"].columns)
    assert "sensitivity" not in tables and not list(tmp_path.glob("sensitivity.*"))  # smoke runs no sensitivity study
    figures = make_figures(exp, out_dir=tmp_path)
    names = {p.stem for p in figures}
    assert {"speedup_per_benchmark", "al_vs_call_rate", "time_split", "verify_curve", "offline_scheduler"} <= names
    assert all(p.stat().st_size > 1000 for p in figures)
    index = (tmp_path / "README.md").read_text()  # rewritten by make_figures: the tables and the figures
    assert "[ablation](ablation.md)" in index and "[time_split](time_split.png)" in index
    assert "`sensitivity`" in index and "`experiment=cpu_full`" in index


def test_notebook_rebuilds_the_report_from_smoke_outputs(smoke, monkeypatch):
    """CI executes the whole notebook in a Jupyter kernel (about 10 s, most of it the kernel's imports): every
    cell runs, the tables, figures and index are written, the rows across pairs and the studies cell show."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    _, out, *_ = smoke
    monkeypatch.setenv("TREEGRAFT_EXPERIMENT", "smoke")
    monkeypatch.setenv("TREEGRAFT_OUTPUTS", str(out))
    nb = nbformat.read(Path(__file__).parents[1] / "notebooks" / "reproduce.ipynb", as_version=4)
    nbclient.NotebookClient(nb, timeout=600, kernel_name="python3").execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    errors = [o for o in outputs if o.get("output_type") == "error"]
    assert not errors, errors[0]
    text = "\n".join(o.get("text", "") + "".join(str(v) for v in o.get("data", {}).values()) for o in outputs)
    assert "held-out benchmarks ['mt_bench']" in text  # read from the config evaluate recorded
    assert "min over pairs (worst pair)" in text  # the gain's rows across pairs
    assert "`sensitivity` (" in text and "run by `experiment=cpu_full`" in text  # a study smoke does not run
    assert "offline_scheduler" in text and "## Not run by this experiment" in text  # a study it runs; the index
    report = out / "pipeline" / "smoke" / "report"
    assert (report / "main.md").exists() and (report / "README.md").exists() and (report / "time_split.png").exists()


def _wandb_run(folder: Path) -> dict:
    """The one offline W&B run under ``folder``, read back from its run file (W&B's record log: 32 KiB
    blocks of chunks with a 7-byte header, each record a protobuf): name, group, job type, config, the
    logged keys, and the table and image files it wrote."""
    from wandb.proto import wandb_internal_pb2

    runs = list((folder / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, runs
    (path,) = runs[0].glob("run-*.wandb")
    data, pos, chunk, records = path.read_bytes(), 7, b"", []
    assert data[:4] == b":W&B", "not a W&B run file"
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        chunk += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or the last chunk of one
            records.append(wandb_internal_pb2.Record.FromString(chunk))
            chunk = b""
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    keys = {item.key or "/".join(item.nested_key) for r in records if r.WhichOneof("record_type") == "history"
            for item in r.history.item}
    media = runs[0] / "files" / "media"
    return {"name": run.display_name, "group": run.run_group, "job_type": run.job_type, "keys": keys,
            "config": {c.key: json.loads(c.value_json) for c in run.config.update},
            "tables": [p.name for p in media.glob("table/*.table.json")], "images": [p.name for p in media.glob("images/*")]}


# the logging, not the fit, is under test: a small scheduler fit
CHEAP_SCHEDULER = ["scheduler.candidates=[depth_before,node_count]", "scheduler.selection_mlp.epochs=5",
                   "scheduler.value_mlp.epochs=5", "scheduler.predictor_mlp.epochs=5", "scheduler.teacher=open_loop",
                   "scheduler.decision_timing_repeats=20"]
WANDB_STAGES = {"evaluate": ["evaluation.methods=[ar,all_small]"],  # every record saved: summarized and logged, no model
                "collect": [],  # every shard saved: no model
                "fit": [*CHEAP_SCHEDULER, "force=true"], "distill": [*CHEAP_SCHEDULER, "force=true"],
                "report": []}


@pytest.fixture(scope="module")
def wandb_runs(smoke, tmp_path_factory):
    """Every stage and the report logged to W&B offline, once, in a copy of the smoke outputs: stage -> the
    overrides it ran with and its run read back (:func:`_wandb_run`)."""
    from treegraft.pipeline.report import run_report

    _, out, *_ = smoke
    work = tmp_path_factory.mktemp("wandb")
    for stage in ("collect", "fit", "distill", "evaluate"):
        shutil.copytree(out / "pipeline" / "smoke" / stage, work / "pipeline" / "smoke" / stage)
    run = {"collect": run_collect, "fit": run_fit, "distill": run_distill, "evaluate": run_evaluate, "report": run_report}
    overrides = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("WANDB_API_KEY", raising=False)
        mp.setenv("WANDB_SILENT", "true")
        for stage, extra in WANDB_STAGES.items():
            overrides[stage] = ["experiment=smoke", f"paths.output_dir={work}", "logger=wandb",
                                f"logger.dir={work / 'wandb' / stage}", *extra]
            run[stage](compose(stage, overrides[stage]))
        import wandb

        wandb.teardown()  # the run files are written by W&B's service process: let it close them before reading
    return {stage: (overrides[stage], _wandb_run(work / "wandb" / stage)) for stage in WANDB_STAGES}


@pytest.mark.parametrize("stage, metric, table", [
    ("collect", "turns", "collect_summary"),
    ("fit", "oof_score", "oof_summary"),
    ("distill", "ms_per_decision_scheduler", "offline_eval"),
    ("evaluate", "tiny-random/treegraft/speedup", "evaluate_intervals"),
    ("report", "gain/all_pairs/mean_gain_vs_better_endpoint_%", "gain"),
])
def test_wandb_offline_run_logs_every_stage(wandb_runs, stage, metric, table):
    overrides, run = wandb_runs[stage]
    assert (run["name"], run["group"], run["job_type"]) == (f"smoke-{stage}", f"smoke/{stage}", stage)
    config = compose(stage, overrides)  # the stage's own resolved config, whole
    assert set(run["config"]) - {"_wandb"} == set(config)
    assert run["config"]["pipeline"]["name"] == "smoke" and run["config"]["logger"]["name"] == "wandb"
    assert metric in run["keys"], sorted(run["keys"])[:20]
    if stage in ("evaluate", "report"):  # figures with a CI carry it and their n
        assert {f"{metric}_lo", f"{metric}_hi", f"{metric}_n"} <= run["keys"]
    assert any(name.startswith(f"{table}_") for name in run["tables"]), run["tables"]
    if stage == "report":
        assert "gain/tiny-random/gain_vs_better_endpoint_%" in run["keys"]
        assert any(name.startswith("speedup_per_benchmark_") for name in run["images"]), run["images"]


def test_evaluate_reuses_records_only_under_the_same_run_key(smoke):
    _, out, *_ = smoke
    args = ["experiment=smoke", f"paths.output_dir={out}"]
    eval_dir = out / "pipeline" / "smoke" / "evaluate"
    run_evaluate(compose("evaluate", args))  # brings the records up to date (an earlier test may have redone distill)
    before = {p: p.stat().st_mtime_ns for p in eval_dir.glob("*/*/*.jsonl")}
    run_evaluate(compose("evaluate", args))  # everything saved and up to date: nothing is redone
    assert {p: p.stat().st_mtime_ns for p in eval_dir.glob("*/*/*.jsonl")} == before
    stale = sorted(eval_dir.glob("*/*/all_small.jsonl"))[0]  # as if written under another prompt format
    lines = [json.loads(line) for line in stale.read_text().splitlines()]
    lines[0]["prompt_ids"] = lines[0]["prompt_ids"][1:]
    stale.write_text("".join(json.dumps(r) + "\n" for r in lines))
    run_evaluate(compose("evaluate", args))  # redoes exactly that file
    redone = [json.loads(line) for line in stale.read_text().splitlines()]
    assert redone[0]["prompt_ids"] != lines[0]["prompt_ids"]
    assert {p: p.stat().st_mtime_ns for p in eval_dir.glob("*/*/*.jsonl") if p != stale} == {
        p: m for p, m in before.items() if p != stale}
    base = out / "pipeline" / "smoke"
    cfg = compose("evaluate", args)
    keys = {m: run_key(cfg, "tiny-random", m, base) for m in ("ar", "treegraft")}
    longer = compose("evaluate", args + ["evaluation.max_new_tokens=99"])
    assert run_key(longer, "tiny-random", "ar", base) != keys["ar"]  # a changed setting redoes every method
    more = compose("evaluate", args + ["evaluation.prompts_per_benchmark=5"])
    assert run_key(more, "tiny-random", "ar", base) == keys["ar"]  # more prompts keep the records of the first ones
    scheduler = base / "distill" / "scheduler.pt"
    saved = scheduler.read_bytes()
    try:
        scheduler.write_bytes(saved + b"refitted")
        assert run_key(cfg, "tiny-random", "treegraft", base) != keys["treegraft"]  # a new scheduler redoes treegraft
        assert run_key(cfg, "tiny-random", "ar", base) == keys["ar"]  # but not the methods without one
        assert run_key(cfg, "tiny-random", "treegraft@t_mid_x1.25", base) != run_key(cfg, "tiny-random", "treegraft", base)
    finally:
        scheduler.write_bytes(saved)


def test_fit_and_distill_skip_when_up_to_date_and_redo_when_forced_or_changed(smoke):
    _, out, *_ = smoke
    cheap = ["scheduler.candidates=[depth_before,node_count,ngram_match_len]", "scheduler.selection_mlp.epochs=10",
             "scheduler.value_mlp.epochs=20", "scheduler.predictor_mlp.epochs=20",
             "scheduler.decision_timing_repeats=50", "scheduler.teacher=open_loop",
             "scheduler.timing_scales=[]"]  # the skip logic, not the fit, is under test
    args = ["experiment=smoke", f"paths.output_dir={out}", *cheap]
    heads = out / "pipeline" / "smoke" / "fit" / "value_heads.pt"
    scheduler = out / "pipeline" / "smoke" / "distill" / "scheduler.pt"
    run_fit(compose("fit", args))  # brings both up to date (an earlier test re-collected a prompt: new timings)
    run_distill(compose("distill", args))
    stamp = heads.stat().st_mtime_ns, scheduler.stat().st_mtime_ns
    run_fit(compose("fit", args + ["logger=none"]))  # same config and inputs (the logger does not count)
    run_distill(compose("distill", args))
    assert (heads.stat().st_mtime_ns, scheduler.stat().st_mtime_ns) == stamp
    run_fit(compose("fit", args + ["force=true"]))
    assert heads.stat().st_mtime_ns != stamp[0]
    run_fit(compose("fit", args + ["scheduler.value_mlp.epochs=3"]))  # a changed setting: other value heads
    run_distill(compose("distill", args))  # its input (the value heads) changed
    assert scheduler.stat().st_mtime_ns != stamp[1]
    stamp = scheduler.stat().st_mtime_ns
    run_distill(compose("distill", args + ["scheduler.predictor_mlp.epochs=3"]))  # a changed setting
    assert scheduler.stat().st_mtime_ns != stamp


def test_a_stage_stays_up_to_date_when_only_what_evaluate_runs_changes(tmp_path):
    from omegaconf import OmegaConf

    from treegraft.pipeline.artifacts import record_stage, up_to_date

    conf = OmegaConf.create({"scheduler": {"epochs": 20}, "evaluation": {"ablation_prompts": 4}, "logger": "none"})
    rows = tmp_path / "rows.parquet"
    rows.write_bytes(b"rows")
    (tmp_path / "value_heads.pt").write_bytes(b"heads")
    record_stage(tmp_path, OmegaConf.to_yaml(conf), [rows])

    def current(**changes) -> bool:
        changed = OmegaConf.merge(conf, OmegaConf.create(changes))
        return up_to_date(tmp_path, OmegaConf.to_yaml(changed), [rows], ["value_heads.pt"])

    assert current()
    assert current(evaluation={"ablation_prompts": 2}, logger="wandb")  # fit and distill never read these
    assert not current(scheduler={"epochs": 3})  # a setting they read
    rows.write_bytes(b"other rows")
    assert not current()  # an input that changed


def test_pair_overrides_size_collect_per_pair():
    from omegaconf import OmegaConf

    from treegraft.pipeline.collect import pair_settings

    p = OmegaConf.create({"prompts_per_benchmark": 2, "enumerate_every": 1, "max_enumerated_turns": None,
                          "pair_overrides": {"slow": {"prompts_per_benchmark": 1, "enumerate_every": 2}}})
    assert (pair_settings(p, "slow").prompts_per_benchmark, pair_settings(p, "slow").enumerate_every) == (1, 2)
    assert (pair_settings(p, "fast").prompts_per_benchmark, pair_settings(p, "fast").enumerate_every) == (2, 1)
    p.pair_overrides.slow.prompts_per_benchmark = 3  # more than the evaluation offset allows
    with pytest.raises(ValueError, match="prompts_per_benchmark must be <="):
        pair_settings(p, "slow")
    p.pair_overrides.slow = {"max_new_tokens": 8}
    with pytest.raises(ValueError, match=r"sets \['max_new_tokens'\]"):
        pair_settings(p, "slow")


def test_evaluate_with_two_forked_workers_and_ablations_on_fewer_prompts(smoke, tmp_path):
    import shutil

    _, out, _, _, _ = smoke
    for stage in ("fit", "distill"):
        shutil.copytree(out / "pipeline" / "smoke" / stage, tmp_path / "pipeline" / "smoke" / stage)
    overrides = ["experiment=smoke", f"paths.output_dir={tmp_path}", "evaluation.prompts_per_benchmark=2",
                 "evaluation.ablation_prompts=1", "evaluation.methods=[ar,all_small,fixed,treegraft]",
                 "evaluation.ablations=[fixed]"]
    summary = run_evaluate(compose("evaluate", [*overrides, "pipeline.workers=2"]))
    records = read_records(tmp_path / "pipeline" / "smoke" / "evaluate")
    per = records.groupby(["benchmark", "method"]).size().unstack()
    assert (per["ar"] == 2).all() and (per["treegraft"] == 2).all() and (per["fixed"] == 1).all()
    assert int(summary["mismatches"].sum()) == 0
    assert records["runtime"].notna().all() and records["cpu"].notna().all() and records["tree_shape"].notna().all()
    # the bf16 kernel crossover is in every raw record; only bfloat16_packed has one
    raw = [json.loads(line) for f in (tmp_path / "pipeline" / "smoke" / "evaluate").glob("*/*/*.jsonl")
           for line in f.read_text().splitlines()]
    assert raw and all("bf16_onednn_above" in r for r in raw)
    assert records.loc[records["runtime"] != "bfloat16_packed", "bf16_onednn_above"].isna().all()
    # the ablation's speedup is against ar on its own prompt only
    fixed = summary[summary["method"] == "fixed"].set_index("benchmark")["speedup"]
    for bench, speedup in fixed.items():
        g = records[records["benchmark"] == bench]
        qid = g[g["method"] == "fixed"]["question_id"].iloc[0]
        ar_t = g[(g["method"] == "ar") & (g["question_id"] == qid)]["wall_time"].sum()
        assert speedup == pytest.approx(ar_t / g[g["method"] == "fixed"]["wall_time"].sum())
    # one worker gives the same outputs
    single = tmp_path / "single"
    for stage in ("fit", "distill"):
        shutil.copytree(out / "pipeline" / "smoke" / stage, single / "pipeline" / "smoke" / stage)
    run_evaluate(compose("evaluate", [o.replace(str(tmp_path), str(single)) for o in overrides]))
    one = read_records(single / "pipeline" / "smoke" / "evaluate").set_index(["benchmark", "method", "question_id"])
    two = records.set_index(["benchmark", "method", "question_id"])
    assert sorted(one.index) == sorted(two.index)


@pytest.mark.slow  # `make test-all`; CI runs forked workers in evaluate (test_evaluate_with_two_forked_workers...)
def test_collect_with_two_forked_workers_writes_the_same_shards(smoke, tmp_path):
    cfg, out, _, _, _ = smoke
    run_collect(compose("collect", ["experiment=smoke", f"paths.output_dir={tmp_path}", "pipeline.workers=2"]))
    one = sorted((out / "pipeline" / "smoke" / "collect" / "tiny-random").glob("*/q*.parquet"))
    two = sorted((tmp_path / "pipeline" / "smoke" / "collect" / "tiny-random").glob("*/q*.parquet"))
    assert [p.relative_to(out) for p in one] == [p.relative_to(tmp_path) for p in two]
    for a, b in zip(one, two):
        da, db = pd.read_parquet(a), pd.read_parquet(b)
        assert len(da) == len(db) and (da["accepted"].to_numpy() == db["accepted"].to_numpy()).all()


SPEC_BENCH_TASKS = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities",
                    "translation", "summarization", "qa", "math_reasoning", "rag"}


def test_records_of_every_method_carry_the_fields_spec_bench_reads(smoke):
    """Spec-Bench's evaluation/speed.py filters by `category` and reads choices[0].new_tokens, wall_time and
    accept_lengths; evaluation/equal.py reads choices[0].turns. FastChat answers also carry answer_id."""
    _, out, *_ = smoke
    files = sorted((out / "pipeline" / "smoke" / "evaluate").glob("*/*/*.jsonl"))
    methods = {p.stem for p in files}
    assert {"ar", "treegraft", "hf_assisted", "hf_prompt_lookup", "csd"} <= methods
    answer_ids = set()
    for path in files:
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            assert isinstance(rec["category"], str) and rec["category"], (path, rec["category"])
            bench = path.parent.name
            if bench in ("gsm8k", "cnndm", "nq"):
                assert rec["category"] in SPEC_BENCH_TASKS
            if bench == "mt_bench":
                assert rec["category"] in SPEC_BENCH_TASKS - {"translation", "summarization", "qa", "math_reasoning", "rag"}
            choice = rec["choices"][0]
            assert isinstance(choice["turns"], list) and all(isinstance(t, str) for t in choice["turns"])
            tokens, times = sum(choice["new_tokens"]), sum(choice["wall_time"])
            assert tokens > 0 and times > 0
            lengths = choice["accept_lengths"]  # present for every method, never an empty list
            assert lengths and all(isinstance(a, int) and a >= 1 for a in lengths)
            assert sum(lengths) == tokens, (path, lengths)  # tokens per target forward, the bonus included
            assert rec["answer_id"] not in answer_ids
            answer_ids.add(rec["answer_id"])


@pytest.mark.timeout(120)
def test_forked_workers_run_kernels_after_the_parent_ran_multithreaded_ones(tmp_path):
    """GNU OpenMP's pool does not survive fork: a worker must not deadlock in its first matmul when
    the parent already ran threaded kernels (the CI hang of the forked collect/evaluate tests)."""
    import torch

    from treegraft.pipeline.parallel import fork_map

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        a = torch.randn(512, 512)
        (a @ a).sum()  # the parent's pool exists now

        def work(group, report):
            for job in group:
                value = float((a @ a).sum()) + job
                (tmp_path / f"{job}.txt").write_text(repr(value))
                report(1)

        seen = []
        fork_map(work, [[0, 2], [1, 3]], progress=seen.append)
    finally:
        torch.set_num_threads(threads)
    assert sum(seen) == 4
    expected = float((a @ a).sum())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0.txt", "1.txt", "2.txt", "3.txt"]
    assert float((tmp_path / "2.txt").read_text()) == pytest.approx(expected + 2, rel=1e-4)


@pytest.mark.timeout(120)
def test_pulled_jobs_go_to_whichever_worker_is_free(tmp_path):
    """The heavy job (its weight says only 2x a light one) waits until the three light ones are done:
    split in advance by weight (2 | 1 + 1, then the third light job behind the heavy one) it would wait
    in vain; pulled from one queue, the other worker takes all three."""
    import os
    import time

    from treegraft.pipeline.parallel import fork_pull

    def work(pull, report):
        for job in pull:
            if job == "heavy":
                deadline = time.monotonic() + 30
                while len(list(tmp_path.glob("light*"))) < 3 and time.monotonic() < deadline:
                    time.sleep(0.01)
            (tmp_path / job).write_text(str(os.getpid()))
            report(1)

    seen = []
    fork_pull(work, ["light1", "light2", "heavy", "light3"], [1, 1, 2, 1], 2, progress=seen.append)
    pids = {p.name: p.read_text() for p in tmp_path.iterdir()}
    assert sum(seen) == 4 and sorted(pids) == ["heavy", "light1", "light2", "light3"]
    assert len({pids["light1"], pids["light2"], pids["light3"]}) == 1 and pids["heavy"] != pids["light1"]

    order = []
    fork_pull(lambda pull, report: order.extend(pull), ["a", "b", "c"], [1, 3, 2], 1)
    assert order == ["b", "c", "a"]  # one worker: in this process, heaviest first


def _one_pair_rows(depth: int = 2, turns: int = 60, t_tgt: float = 100.0, t_mid: float = 25.0, seed: int = 5) -> pd.DataFrame:
    """Enumerated turns of one pair: every call adds 0.8 accepted tokens and costs t_mid; timings constant."""
    rng = np.random.default_rng(seed)
    rows = []
    for q in range(turns):
        noise = rng.normal(size=1)[0]
        for k in range(2 ** depth):
            schedule = format(k, f"0{depth}b")
            calls = schedule.count("1")
            for step in range(1, depth + 1):
                prefix = schedule[: step - 1]
                row = {"report": f"p/b{q % 3}", "question_id": q, "turn": 0, "schedule": schedule, "prefix": prefix,
                       "step": step, "action": int(schedule[step - 1]), "accepted": 1 + 0.8 * calls + 0.1 * noise,
                       "latency_s": (t_tgt + calls * t_mid) / 1000 * 1.1, "t_tgt_ms": t_tgt, "t_mid_ms": t_mid,
                       "log_prompt_len": 3.0, "log_tgt_mid_ratio": np.log(t_tgt / t_mid), "step_frac": step / depth,
                       "calls_frac": prefix.count("1") / depth, "sig_node_count": 5.0 + noise}
                row.update({f"hist_{s}": float(s < step and schedule[s - 1] == "1") for s in range(1, depth + 1)})
                row.update({f"suffix_{s}": float(s > step and schedule[s - 1] == "1") for s in range(1, depth + 1)})
                rows.append(row)
    return pd.DataFrame(rows)


def test_latency_prior_reads_the_whole_schedule_calls_and_the_pairs_timings():
    names = state_names(3, ["t_tgt_ms", "t_mid_ms"]) + [f"suffix_{s}" for s in (1, 2, 3)]
    x = np.zeros((1, len(names)))
    col = {n: i for i, n in enumerate(names)}
    x[0, col["t_tgt_ms"]], x[0, col["t_mid_ms"]] = 100.0, 30.0
    x[0, col["calls_frac"]] = 1 / 3  # one call so far
    x[0, col["suffix_3"]] = 1.0  # and one later
    assert latency_prior_s(x, names, 3, action=1)[0] == pytest.approx((100 + 3 * 30) / 1000)
    assert latency_prior_s(x, names, 3, action=0)[0] == pytest.approx((100 + 2 * 30) / 1000)
    with pytest.raises(ValueError, match="latency prior needs"):
        latency_prior_s(x[:, 2:], names[2:], 3, 1)


def test_a_one_pair_scheduler_with_the_latency_prior_stops_calling_where_calls_cost_more():
    depth, signals = 2, ["t_tgt_ms", "t_mid_ms", "node_count"]
    rows = _one_pair_rows(depth)
    cfg = MLPConfig(hidden=(16,), epochs=200)
    x = rows.drop_duplicates(["question_id", "prefix"])
    x = x[x["step"] == 1][state_names(depth, signals)].to_numpy(np.float64)
    dear = x.copy()
    dear[:, 1] *= 3.0  # another pair's warm-up: a middle forward three times dearer (a self-draft)
    steps = np.ones(len(x))
    for prior in (False, True):
        vs = fit_value_system(rows, depth, signals, cfg, latency_prior=prior)
        cheap_margin, dear_margin = plan_margins(vs, x, steps), plan_margins(vs, dear, steps)
        assert (cheap_margin > 0).all()  # on the fitted pair calls pay (2.6 vs 2.0 tokens for 1.5x the time)
        if prior:
            assert (dear_margin < 0).all()
            predictor, _, _ = distill_predictor(rows, vs, MLPConfig(hidden=(32, 16), epochs=400), [0.33, 1.0, 3.0])
            assert (predictor.predict(x) > 0).all() and (predictor.predict(dear) < 0).all()
        else:  # without it the timings were constant in training: the heads cannot tell the pairs apart
            assert np.allclose(dear_margin, cheap_margin)


def test_selection_with_the_latency_prior_keeps_the_timings_it_reads():
    rows = _one_pair_rows(2, turns=30)
    chosen, table = select_signals(rows, 2, ["log_prompt_len", "node_count"], MLPConfig(hidden=(8,), epochs=30),
                                   search="greedy", n_folds=3, latency_prior=True)
    assert {"t_tgt_ms", "t_mid_ms"} <= set(chosen)
    assert all({"t_tgt_ms", "t_mid_ms"} <= set(s.split(",")) for s in table["subset"])
    assert table["n_signals"].min() == 0  # n_signals counts the features beyond the prior's


def test_offline_table_reports_the_total_rate_beside_the_mean_of_turn_ratios():
    rows = _one_pair_rows(2, turns=12)
    table = evaluate_policies(rows, 2, {}).set_index("policy")
    first = rows[rows["step"] == 1]
    for name, schedule in (("all-skip (All-Small)", "00"), ("all-call", "11")):
        picked = first[first["schedule"] == schedule]
        assert table.loc[name, "total_tau"] == pytest.approx((picked["accepted"] + 1).sum() / picked["latency_s"].sum())
        assert table.loc[name, "mean_tau"] == pytest.approx(((picked["accepted"] + 1) / picked["latency_s"]).mean())
    assert table.loc["random (p=0.5)", "total_tau"] == pytest.approx((first["accepted"] + 1).sum() / first["latency_s"].sum())


def test_make_all_gives_evaluate_what_the_earlier_stages_left_of_the_budget(tmp_path):
    """`make all` (experiment=cpu) evaluates by precision within the minutes collect, fit and distill left;
    never less than one."""
    from treegraft.pipeline.run_all import REPORT_MINUTES, SETUP_MINUTES, evaluate_budget_min

    cfg = compose("evaluate", ["experiment=cpu", f"paths.output_dir={tmp_path}"])
    assert cfg.evaluation.target_half_width > 0 and cfg.pipeline.time_budget_min
    assert evaluate_budget_min(58, 20) == pytest.approx(58 - SETUP_MINUTES - 20 - REPORT_MINUTES)
    assert evaluate_budget_min(58, 20) > evaluate_budget_min(58, 30)
    assert evaluate_budget_min(58, 90) == 1.0


def test_make_all_plans_evaluate_for_the_most_prompts_its_rounds_may_run(tmp_path):
    """The bar's evaluate share is the most prompts precision rounds may reach (it jumps ahead where they stop
    sooner), not the first round's, which left the bar at 97-100% through every later round."""
    from treegraft.pipeline.evaluate import most_prompts_per_benchmark as evaluate_prompts_planned
    from treegraft.pipeline.run_all import _generations_per_pair

    cfg = compose("evaluate", ["experiment=cpu_llama", f"paths.output_dir={tmp_path}"])
    e = cfg.evaluation
    assert e.target_half_width is not None and e.max_prompts_per_benchmark > e.prompts_per_benchmark
    assert evaluate_prompts_planned(cfg) == e.max_prompts_per_benchmark
    fixed = compose("evaluate", ["experiment=cpu_llama", f"paths.output_dir={tmp_path}", "evaluation.target_half_width=null"])
    assert evaluate_prompts_planned(fixed) == e.prompts_per_benchmark
    assert _generations_per_pair(cfg) > _generations_per_pair(fixed)


def test_evaluation_sized_by_precision_adds_prompts_and_keeps_earlier_records(smoke, tmp_path):
    """Rounds of prompts until the CI is narrow enough (here: never, so up to the cap): the first round's
    records are reused, not redone; precision.json says what was reached; sensitivity variants carry
    their rescaled runtime context."""
    _, out, *_ = smoke
    work = tmp_path / "out"
    shutil.copytree(out / "pipeline" / "smoke" / "distill", work / "pipeline" / "smoke" / "distill")
    shutil.copytree(out / "pipeline" / "smoke" / "fit", work / "pipeline" / "smoke" / "fit")
    args = ["experiment=smoke", f"paths.output_dir={work}", "evaluation.methods=[ar,all_small,treegraft]",
            "evaluation.benchmarks=[gsm8k]", "evaluation.max_new_tokens=6", "evaluation.sensitivity=[t_mid_x1.25]",
            "evaluation.sensitivity_prompts=1"]
    eval_dir = work / "pipeline" / "smoke" / "evaluate"
    run_evaluate(compose("evaluate", args))
    first = {p.name: json.loads(p.read_text().splitlines()[0]) for p in (eval_dir / "tiny-random" / "gsm8k").glob("*.jsonl")}
    assert set(first) == {"ar.jsonl", "all_small.jsonl", "treegraft.jsonl", "treegraft@t_mid_x1.25.jsonl"}
    base, variant = first["treegraft.jsonl"], first["treegraft@t_mid_x1.25.jsonl"]
    assert variant["t_mid_ms"] == pytest.approx(1.25 * base["t_mid_ms"]) and variant["t_tgt_ms"] == pytest.approx(base["t_tgt_ms"])
    run_evaluate(compose("evaluate", args + ["evaluation.target_half_width=0.0", "evaluation.max_prompts_per_benchmark=3",
                                             "evaluation.round_prompts=1"]))
    precision = json.loads((eval_dir / "precision.json").read_text())
    assert [r["prompts_per_benchmark"] for r in precision["rounds"]] == [1, 2, 3] and not precision["met"]
    assert precision["method"] == "treegraft" and precision["rounds"][-1]["n"] == 3
    records = read_records(eval_dir)
    assert records.groupby("method").size().to_dict() == {"ar": 3, "all_small": 3, "treegraft": 3, "treegraft@t_mid_x1.25": 1}
    again = {p.name: json.loads(p.read_text().splitlines()[0]) for p in (eval_dir / "tiny-random" / "gsm8k").glob("*.jsonl")}
    assert all(again[k]["tstamp"] == first[k]["tstamp"] for k in first)  # the first prompt's records were kept
    # a target met at once still runs up to min_prompts_per_benchmark (budget left is spent on prompts)
    run_evaluate(compose("evaluate", args + ["evaluation.target_half_width=10.0", "evaluation.max_prompts_per_benchmark=5",
                                             "evaluation.min_prompts_per_benchmark=4", "evaluation.round_prompts=1"]))
    precision = json.loads((eval_dir / "precision.json").read_text())
    assert [r["prompts_per_benchmark"] for r in precision["rounds"]] == [1, 2, 3, 4] and precision["met"]
    with pytest.raises(ValueError, match="bad method variant"):
        run_evaluate(compose("evaluate", args + ["evaluation.sensitivity=[t_mid_times2]"]))


def test_a_stage_entry_point_reports_a_missing_model_as_one_line(tmp_path, capsys):
    """`python scripts/evaluate.py ...` with a model that is not converted: one line naming the model and
    the command that converts it, exit status 2 (not a traceback)."""
    from treegraft.pipeline.common import run_stage_cli

    cfg = compose("evaluate", ["experiment=cpu", f"paths.output_dir={tmp_path}", f"paths.models_dir={tmp_path / 'none'}",
                               "evaluation.methods=[ar]"])
    with pytest.raises(SystemExit) as exit_info:
        run_stage_cli(run_evaluate, cfg)
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and len(err.splitlines()) == 1
    assert err.startswith("error: embedded model qwen-coder-1.5b not converted") and "make models" in err
