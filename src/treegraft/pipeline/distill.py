"""Stage `distill`: teacher margins, the margin predictor, offline evaluation.

Reads the collected rows and the fitted value heads; writes ``scheduler.pt`` + ``scheduler.meta.json``
(the deployed policy: feature order, signals, depth), ``offline_eval.{csv,md}`` and
``distill.json`` (teacher/student sign agreement, per-decision cost).

Offline evaluation is cross-fitted: for each grouped fold (reports never straddle folds), the value
heads and the predictor are refitted on the training reports, and every policy is followed through
the held-out reports' enumerations. So each number is out-of-sample, as the paper's B.5/B.6.
"""

from __future__ import annotations

import json
import math
from typing import Sequence, Union

import numpy as np
import pandas as pd
from omegaconf import DictConfig, OmegaConf
from rich.console import Console

from ..scheduling.closed_loop import ClosedLoopConfig, ClosedLoopTeacher, fit_closed_loop_teacher, rescale_timings, timing_pairs
from ..scheduling.features import RUNTIME_NAMES, state_names
from ..scheduling.learned import DirectPlanner, LearnedScheduler, MarginPredictor, fallback_key, fixed_fallback, plan_margins
from ..scheduling.offline import TURN_KEYS, best_fixed_by_middle_cost, best_fixed_schedule, policy_turns, state_rows, summarize_policies
from ..scheduling.policy import StepState
from ..scheduling.signals import SIGNAL_NAMES
from ..scheduling.value import ValueSystem, fit_value_system, grouped_folds
from ..settings import RunSettings
from .artifacts import (IN_SAMPLE_DISTILLED, IN_SAMPLE_PLANNER, atomic_write_json, atomic_write_parquet, atomic_write_text,
                        record_stage, require, stage_dir, up_to_date)
from .collected import load_rows, merge_collect, row_files
from .common import fit_pairs, print_table, to_markdown
from .estimates import offline_prompt_intervals
from .fit import mlp_config
from .tracking import stage_logger
from ..devices import now

__all__ = ["run_distill", "distill_predictor", "choose_teacher", "name_students", "student_name", "states_of", "time_decisions", "IN_SAMPLE_DISTILLED", "IN_SAMPLE_PLANNER"]

DISTILLED = "TreeGraft scheduler (distilled)"
PLANNER = "direct planner (value system)"


def states_of(rows: pd.DataFrame) -> pd.DataFrame:
    """One row per recorded pre-action state (turn x prefix)."""
    return state_rows(rows).reset_index()


def scale_timings(x: np.ndarray, names: list[str], scales: Sequence[float]) -> np.ndarray:
    """Copies of the states ``x`` [N, F] with the warm-up timings rescaled: for every (a, b) of ``scales``
    x ``scales``, t_tgt * a and t_mid * b (log ratio recomputed); the unscaled copy first. [N * S^2, F]"""
    return np.concatenate([rescale_timings(x, names, a, b) for a, b in timing_pairs(scales)])


Teacher = Union[ValueSystem, ClosedLoopTeacher]


def teacher_margins(teacher: Teacher, x: np.ndarray, steps: np.ndarray) -> np.ndarray:
    """The distillation target at states ``x`` [N, F] and ``steps`` [N]: the closed-loop teacher's fitted
    margins, or the open-loop max over suffixes of the value heads."""
    if isinstance(teacher, ClosedLoopTeacher):
        return teacher.margins(x, steps)
    return plan_margins(teacher, x, steps)


def make_teacher(kind: str, rows: pd.DataFrame, vs: ValueSystem, features: Sequence[str],
                 closed_loop: ClosedLoopConfig, timing_scales: Sequence[float]) -> Teacher:
    """``closed_loop``: fitted on ``rows`` over ``features``; ``open_loop``: the value heads ``vs`` themselves."""
    if kind == "closed_loop":
        return fit_closed_loop_teacher(rows, vs.depth, features, closed_loop, timing_scales)
    if kind == "open_loop":
        return vs
    raise ValueError(f"scheduler.teacher must be auto, closed_loop or open_loop, got {kind!r}")


TEACHERS = ("closed_loop", "open_loop")


def student_name(kind: str) -> str:
    """The offline table's name for the student of teacher ``kind`` while ``scheduler.teacher=auto`` compares them."""
    return f"distilled, {kind.replace('_', '-')} teacher"


def choose_teacher(turns: pd.DataFrame, kinds: Sequence[str]) -> tuple[str, dict[str, float]]:
    """(the teacher kind whose student reached the highest share of the oracle on the held-out turns, every
    kind's share in %). ``turns``: :func:`policy_turns` rows of the held-out folds, the students named by
    :func:`student_name`, and the ``oracle``; ties go to the first kind. The share is the one the offline
    table reports (all tokens/s summed over turns / the oracle's), so the choice is the table's ranking."""
    oracle = float(turns.loc[turns["policy"] == "oracle", "tau"].sum())
    shares = {k: 100 * float(turns.loc[turns["policy"] == student_name(k), "tau"].sum()) / oracle for k in kinds}
    return max(kinds, key=shares.__getitem__), shares  # max keeps the first of equals


def name_students(frame: pd.DataFrame, kinds: Sequence[str], chosen: str) -> pd.DataFrame:
    """``frame``'s students renamed: the chosen teacher's is the deployed ``DISTILLED``, the others are marked
    as not deployed."""
    names = {student_name(k): DISTILLED if k == chosen else f"{student_name(k)} (not deployed)" for k in kinds}
    return frame.assign(policy=frame["policy"].replace(names))


def distill_predictor(rows: pd.DataFrame, teacher: Teacher, mlp,
                      timing_scales: Sequence[float] = ()) -> tuple[MarginPredictor, np.ndarray, np.ndarray]:
    """(predictor, teacher margins, predicted margins) on the states of ``rows``.

    With ``timing_scales`` (and a teacher that knows what timings do: the heads' latency prior, or a
    closed-loop teacher fitted on relabelled copies), the predictor also learns the teacher on copies of
    every state with rescaled warm-up timings: with one fitted pair the timings are one value in every
    row, so without the copies the student could not learn that a dearer call (a self-draft pair, a
    slower drafter) moves the margin. The returned margins are the unscaled states'."""
    states = states_of(rows)
    names = state_names(teacher.depth, teacher.signals)
    x = states[names].to_numpy(np.float64)
    steps = states["step"].to_numpy()
    x_fit, steps_fit = x, steps
    knows_timings = isinstance(teacher, ClosedLoopTeacher) or teacher.latency_prior
    if knows_timings and timing_scales:
        x_fit = scale_timings(x, names, timing_scales)
        steps_fit = np.tile(steps, len(x_fit) // len(x))
    margins = teacher_margins(teacher, x_fit, steps_fit)
    predictor = MarginPredictor.fit(x_fit, margins, teacher.depth, teacher.signals, mlp, hidden=tuple(mlp.hidden))
    return predictor, margins[: len(x)], predictor.predict(x)


def step_states(states: pd.DataFrame, depth: int, n: int) -> list[StepState]:
    """Live :class:`StepState` objects rebuilt from recorded rows (for timing the online decision)."""
    out = []
    for _, r in states.head(n).iterrows():
        out.append(StepState(
            step=int(r["step"]), depth=depth, history=[int(a) for a in r["prefix"]],
            prompt_len=int(round(math.expm1(r["log_prompt_len"]))), t_tgt_ms=float(r["t_tgt_ms"]),
            t_mid_ms=float(r["t_mid_ms"]), signals={s: float(r[f"sig_{s}"]) for s in SIGNAL_NAMES},
        ))
    return out


def time_decisions(policy, states: list[StepState], repeats: int) -> float:
    """Mean ms per ``policy.decide`` (state -> feature vector -> action), over ``repeats`` decisions."""
    n = len(states)
    for s in states[: min(n, 50)]:  # warm-up
        policy.decide(s)
    t0 = now()
    for i in range(repeats):
        policy.decide(states[i % n])
    return 1000 * (now() - t0) / repeats


def run_distill(cfg: DictConfig) -> dict:
    console = Console(width=200, stderr=True)
    settings = RunSettings.of(cfg)
    p, s = cfg.pipeline, cfg.scheduler
    depth = settings.depth
    collect_dir = require(stage_dir(cfg.paths.output_dir, p.name, "collect"), "collect", p.name)
    fit_dir = stage_dir(cfg.paths.output_dir, p.name, "fit")
    require(fit_dir / "value_heads.pt", "fit", p.name)
    out_dir = stage_dir(cfg.paths.output_dir, p.name, "distill")
    config_yaml = OmegaConf.to_yaml(cfg, resolve=True)
    merge_collect(cfg, collect_dir, console, settings)  # whatever collect shards exist; says which prompts are missing
    inputs = [*row_files(collect_dir, fit_pairs(cfg), list(p.fit_benchmarks), p.latency_label),
              fit_dir / "value_heads.pt", fit_dir / "value_heads.meta.json"]
    if not cfg.get("force") and up_to_date(out_dir, config_yaml, inputs, ["scheduler.pt", "distill.json"]):
        console.print(f"distill: {out_dir} is up to date with its config and inputs (force=true to redo)")
        return json.loads((out_dir / "distill.json").read_text())
    rows = load_rows(collect_dir, fit_pairs(cfg), list(p.fit_benchmarks), p.name, p.latency_label, allow_missing=True)
    vs = ValueSystem.load(fit_dir)
    if vs.depth != depth:
        raise ValueError(f"the value heads in {fit_dir} were fitted for D={vs.depth}, the config has tree.depth={depth}")
    pred_mlp, value_mlp = mlp_config(s.predictor_mlp), mlp_config(s.value_mlp)

    scales = [float(v) for v in s.get("timing_scales") or []]
    setting = str(s.get("teacher", "auto"))
    if setting not in (*TEACHERS, "auto"):
        raise ValueError(f"scheduler.teacher must be auto, closed_loop or open_loop, got {setting!r}")
    # auto: both teachers' students go through the same held-out folds and the better one deploys. The
    # closed-loop one needs turns (PyTorch full experiment, 394 turns: 89.1% of the oracle against the
    # open-loop one's 85.9; make all's 110 turns: 56.5% against the best fixed schedule's 83.7)
    kinds = list(TEACHERS) if setting == "auto" else [setting]
    closed_cfg = ClosedLoopConfig(**OmegaConf.to_container(s.closed_loop, resolve=True)) if s.get("closed_loop") else ClosedLoopConfig()
    # the closed-loop teacher (and its student) read every candidate feature: the selection in `fit` scores the
    # heads' prediction errors, and dropped signals a policy needs (student on the selected ones: +0.6 points
    # over the best fixed schedule, CI across 0; on every candidate: +3.0, on the PyTorch full experiment)
    all_features = [*[r for r in RUNTIME_NAMES if r not in s.candidates], *s.candidates]

    def features_of(kind: str) -> list[str]:
        return all_features if kind == "closed_loop" else list(vs.signals)

    # offline evaluation, cross-fitted over grouped folds
    turn_reports = rows.drop_duplicates(TURN_KEYS)
    folds = grouped_folds(rows["report"].to_numpy(), int(s.folds))
    tables, turn_frames = [], []
    for k, (train_idx, test_idx) in enumerate(folds):
        train, test = rows.iloc[train_idx], rows.iloc[test_idx]
        vs_k = fit_value_system(train, depth, vs.signals, value_mlp, latency_prior=vs.latency_prior)
        policies = {}
        for kind in kinds:
            pred_k, _, _ = distill_predictor(train, make_teacher(kind, train, vs_k, features_of(kind), closed_cfg, scales),
                                             pred_mlp, scales)
            policies[student_name(kind)] = (pred_k.signals, lambda x, t, m=pred_k: (m.predict(x) > float(s.threshold)).astype(int))
        policies[PLANNER] = (vs.signals, lambda x, t, v=vs_k: (plan_margins(v, x, np.full(len(x), t)) > 0).astype(int))
        for pair_name, test_pair in test.groupby("pair", sort=False):  # per pair: the table reports each
            turns_k = policy_turns(test_pair, depth, policies, train_rows=train).assign(fold=k, pair=pair_name)
            turn_frames.append(turns_k)
            tables.append(summarize_policies(turns_k).assign(fold=k, pair=pair_name))
    kind, teacher_shares = choose_teacher(pd.concat(turn_frames, ignore_index=True), kinds)
    turn_frames = [name_students(f, kinds, kind) for f in turn_frames]
    tables = [name_students(t, kinds, kind) for t in tables]

    # the deployed predictor: distilled from the chosen teacher fitted on every fitting report
    teacher = make_teacher(kind, rows, vs, features_of(kind), closed_cfg, scales)
    predictor, margins, predicted = distill_predictor(rows, teacher, pred_mlp, scales)
    agreement = float(np.mean((margins > 0) == (predicted > 0)))

    states = states_of(rows)
    live = step_states(states.sample(frac=1.0, random_state=0), depth, 500)
    ms_scheduler = time_decisions(LearnedScheduler(predictor, float(s.threshold)), live, int(s.decision_timing_repeats))
    ms_planner = time_decisions(DirectPlanner(vs), live, max(50, int(s.decision_timing_repeats) // 10))

    per_fold = pd.concat(tables, ignore_index=True)
    per_fold["policy_group"] = per_fold["policy"].str.replace(r"best fixed \[\d+\]", "best fixed", regex=True)
    # in-sample: the deployed heads and predictor, fitted on every turn, followed through those same
    # turns. Not a held-out figure: how far from the oracle these features leave the value system even
    # on turns it has seen (the rest of the gap is what the pre-action state does not tell apart)
    deployed = {
        IN_SAMPLE_DISTILLED: (predictor.signals, lambda x, t: (predictor.predict(x) > float(s.threshold)).astype(int)),
        IN_SAMPLE_PLANNER: (vs.signals, lambda x, t: (plan_margins(vs, x, np.full(len(x), t)) > 0).astype(int)),
    }
    in_sample_turns = pd.concat([policy_turns(pair_rows, depth, deployed).assign(pair=pair_name)
                                 for pair_name, pair_rows in rows.groupby("pair", sort=False)], ignore_index=True)
    in_sample_turns = in_sample_turns[in_sample_turns["policy"].isin(list(deployed))]
    in_sample = pd.concat([summarize_policies(g).assign(pair=pair_name)
                           for pair_name, g in in_sample_turns.groupby("pair", sort=False)], ignore_index=True)
    in_sample = in_sample.assign(policy_group=lambda d: d["policy"])
    # pool the folds (and the in-sample rows after them): turn-weighted means per pair and over every
    # pair (the best fixed schedule may differ per fold)
    pooled = pd.concat([per_fold, in_sample], ignore_index=True)
    agg = []
    for pair_name, pf in [*pooled.groupby("pair", sort=False), ("all pairs", pooled)]:
        for name, g in pf.groupby("policy_group", sort=False):
            w = g["turns"].to_numpy()
            row = {"pair": pair_name, "policy": name}
            for c in ("mean_tau", "gap_to_oracle", "gap_pct", "at_oracle", "call_rate"):
                row[c] = float(np.average(g[c], weights=w))
            row["total_tau"] = float(g["tokens"].sum() / g["seconds"].sum())
            row["turns"] = int(w.sum())
            agg.append(row)
    table = pd.DataFrame(agg)
    # shares of the oracle with CIs that resample prompts (a prompt's turns are not independent)
    turn_table = pd.concat([*turn_frames, in_sample_turns], ignore_index=True)
    turn_table["policy"] = turn_table["policy"].str.replace(r"best fixed \[\d+\]", "best fixed", regex=True)
    shares, contrasts = offline_prompt_intervals(
        turn_table, int(p.bootstrap_resamples), seed=0,
        contrasts=[(DISTILLED, "best fixed"), (DISTILLED, PLANNER), (DISTILLED, "all-skip (All-Small)")])
    # deploy the distilled scheduler only where it beats the best fixed schedule on held-out prompts with the
    # difference's CI above 0 (a tie, or a lead the CI does not carry, deploys the fixed one)
    fallback = None
    if s.get("fallback_to_fixed", True) and not contrasts.empty:
        pooled = contrasts[contrasts["pair"] == "all pairs"]
        vs_fixed = pooled[pooled["contrast"].str.endswith("- best fixed")]
        best_fixed = best_fixed_schedule(rows)
        fallback = fixed_fallback(float(vs_fixed["points_of_oracle"].iloc[0]), best_fixed,
                                  ci_low=float(vs_fixed["points_lo"].iloc[0]))
        if fallback and "latency_middle_s" in rows:
            # re-picked online at the decoding pair's t_mid / t_tgt (a self-draft pair: calls 3x dearer, 00000 wins)
            fallback["by_middle_cost"] = best_fixed_by_middle_cost(rows)
            fallback["ref_mid_over_tgt"] = float(np.median(rows["t_mid_ms"] / rows["t_tgt_ms"]))
        vs_skip = pooled[pooled["contrast"].str.endswith("- all-skip (All-Small)")]
        if fallback is None and not vs_skip.empty:
            # making no calls is a constant policy too, and the one where a call's first use also pays the middle
            # drafter's prompt catch-up, which collect's labels never price (a Zen 3: distilled - best fixed +8.6
            # [+1.0, +17.0] points, - all-skip +2.1 [-5.2, +10.2]; deployed, 0.90x `ar` where all-skip made 1.05x)
            fallback = fixed_fallback(float(vs_skip["points_of_oracle"].iloc[0]), "0" * len(best_fixed),
                                      ci_low=float(vs_skip["points_lo"].iloc[0]), reference="all-skip")
    predictor.save(out_dir / "scheduler", {"pairs": fit_pairs(cfg), "threshold": float(s.threshold), "fallback": fallback})
    table = table.merge(shares.drop(columns="turns"), on=["pair", "policy"], how="left")
    cols = ["pair", "policy", "mean_tau", "pct_of_oracle", "pct_of_oracle_lo", "pct_of_oracle_hi"]
    table = table[cols + [c for c in table.columns if c not in cols]]
    atomic_write_text(table.to_csv(index=False), out_dir / "offline_eval.csv")
    atomic_write_text(contrasts.to_csv(index=False), out_dir / "offline_contrasts.csv")
    atomic_write_text(per_fold.to_csv(index=False), out_dir / "offline_eval_per_fold.csv")
    atomic_write_parquet(turn_table, out_dir / "offline_turns.parquet")
    atomic_write_text(to_markdown(table), out_dir / "offline_eval.md")
    info = {
        "teacher": kind, "teacher_setting": setting, "teacher_held_out_pct_of_oracle": teacher_shares, "signals": vs.signals, "features": predictor.feature_names, "states": int(len(states)),
        "turns": int(len(turn_reports)), "teacher_call_share": float(np.mean(margins > 0)),
        "sign_agreement": agreement, "ms_per_decision_scheduler": ms_scheduler,
        "ms_per_decision_direct_planner": ms_planner, "folds": len(folds),
        # differences in points of the oracle's throughput, prompt-resampled 95% CIs
        "contrasts": contrasts.to_dict(orient="records"),
        "deployed": fallback or {"policy": "distilled"},
    }
    atomic_write_json(info, out_dir / "distill.json")
    record_stage(out_dir, config_yaml, inputs)
    print_table(table, f"offline scheduler evaluation ({len(folds)} grouped folds, held-out reports; in-sample rows: "
                       "fitted on those turns), tokens/s per turn", console)
    console.print(f"teacher says call on {info['teacher_call_share']:.1%} of {len(states)} states; predictor sign "
                  f"agreement {agreement:.1%}; per decision: scheduler {ms_scheduler:.4f} ms, direct planner {ms_planner:.3f} ms")
    if len(kinds) > 1:
        console.print(f"scheduler.teacher=auto deploys the {kind} teacher's student: held-out share of the oracle "
                      + ", ".join(f"{k} {v:.1f}%" for k, v in teacher_shares.items())
                      + " (picked on the turns that also score it: a little optimistic)")
    if not contrasts.empty:
        print_table(contrasts, "offline differences, points of the oracle (95% CI over prompts)", console)
    if fallback:
        reference = fallback.get("reference", "best fixed")
        key = fallback_key(reference)
        lo = fallback.get(f"{key}_lo")
        console.print(f"[bold]treegraft deploys the fixed schedule {fallback['schedule']}[/]: the distilled scheduler does not "
                      f"beat {reference} on held-out prompts with the CI above 0 (distilled - {reference} = "
                      f"{fallback[key]:+.1f} points of the oracle, CI lower end "
                      f"{'n/a' if lo is None else format(lo, '+.1f')}; scheduler.fallback_to_fixed)")
    log = stage_logger(cfg, "distill")
    metrics = {k: v for k, v in info.items() if isinstance(v, (int, float))}
    for _, r in shares.iterrows():
        key = f"offline/{r['pair']}/{r['policy']}/pct_of_oracle"
        metrics.update({key: r["pct_of_oracle"], f"{key}_lo": r["pct_of_oracle_lo"], f"{key}_hi": r["pct_of_oracle_hi"],
                        f"offline/{r['pair']}/prompts": r["prompts"]})
    for _, r in contrasts.iterrows():
        key = f"offline/{r['pair']}/{r['contrast']}"
        metrics.update({key: r["points_of_oracle"], f"{key}_lo": r["points_lo"], f"{key}_hi": r["points_hi"]})
    log.log_metrics(metrics)
    log.log_table("offline_eval", table)
    log.log_table("offline_contrasts", contrasts)
    log.finish()
    return info
