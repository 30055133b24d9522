"""The report's tables, each built from the evaluation summary and a :class:`~.estimates.PromptTable`.

Every builder here is a pure function of the per pair x benchmark x method summary and the prompt table
that resamples its records (no file is read or written): the paper's main table, treegraft's gain per
pair and across pairs (:data:`OVER_PAIRS`), the ablations, the scheduling table, the held-out splits,
the runtime-context sensitivity, the small-drafter comparison (Table 9), the summary with its CIs, and
the headline metrics read back off the main and gain tables. A measure with a CI is three columns,
``X``, ``X lo``, ``X hi`` (:func:`put_interval` writes them, :func:`row_interval` reads them back);
:mod:`.report` writes the tables and indexes them.
"""

from __future__ import annotations

from typing import Sequence

import pandas as pd

from ..stats import Interval
from .estimates import PromptTable

__all__ = [
    "main_table",
    "gain_table",
    "ablation_table",
    "scheduling_table",
    "held_out_table",
    "sensitivity_table",
    "small_drafter_table",
    "summary_with_intervals",
    "headline_metrics",
    "method_order",
    "put_interval",
    "row_interval",
    "METHOD_ORDER",
    "OVER_PAIRS",
]

METHOD_ORDER = ["ar", "all_small", "all_mid", "treegraft", "fixed", "no_nondestructive", "no_expanded_selection",
                "all_call", "direct_planner", "csd", "hf_assisted", "hf_prompt_lookup"]
ABLATIONS = ["treegraft", "fixed", "no_nondestructive", "no_expanded_selection", "all_call", "direct_planner"]
ENDPOINTS = ["all_small", "all_mid"]
HF_PEERS = ["hf_assisted", "hf_prompt_lookup"]
NAN_INTERVAL = Interval(float("nan"), float("nan"), float("nan"), 0)
# the gain table's rows across pairs (after the per-pair rows): statistic -> the row's `pair` cell
OVER_PAIRS = {"mean": "mean over pairs", "max": "max over pairs", "min": "min over pairs (worst pair)"}


def method_order(methods: Sequence[str]) -> list[str]:
    """``methods`` in :data:`METHOD_ORDER`, the ones it does not name after them in their own order."""
    return [m for m in METHOD_ORDER if m in methods] + [m for m in methods if m not in METHOD_ORDER]


def put_interval(row: dict, name: str, ci: Interval) -> Interval:
    """``name``, ``name lo``, ``name hi`` (the 95% CI) into ``row``; returns ``ci`` (for its n)."""
    row.update({name: ci.value, f"{name} lo": ci.low, f"{name} hi": ci.high})
    return ci


def row_interval(row, name: str, n: int = 0) -> Interval:
    """The interval :func:`put_interval` wrote as ``name`` into a table's ``row`` (``n``: the prompts behind it)."""
    return Interval(row[name], row[f"{name} lo"], row[f"{name} hi"], n)


def _put_measures(row: dict, prompts: PromptTable, method: str, pairs: Sequence[str],
                  benchmarks: Sequence[str] | None = None) -> Interval:
    """``method``'s speedup, mean AL and call rate on ``pairs`` x ``benchmarks`` with their CIs and
    ``n prompts`` into ``row``; returns the speedup."""
    speedup = put_interval(row, "speedup", prompts.speedup(method, pairs, benchmarks))
    put_interval(row, "mean_al", prompts.al(method, pairs, benchmarks))
    put_interval(row, "call_rate", prompts.call_rate(method, pairs, benchmarks))
    row["n prompts"] = speedup.n
    return speedup


def main_table(summary: pd.DataFrame, pairs: Sequence[str] | None = None, benchmarks: Sequence[str] | None = None,
               *, prompts: PromptTable) -> pd.DataFrame:
    """Speedup and mean AL per method x benchmark (mean over ``pairs``), with a mean column, each with
    its 95% CI over prompts, the number of prompts and the mismatch count, as the paper's main table."""
    s = summary
    if pairs is not None:
        s = s[s["pair"].isin(pairs)]
    if benchmarks is not None:
        s = s[s["benchmark"].isin(benchmarks)]
    pairs = list(dict.fromkeys(s["pair"]))
    benches = list(dict.fromkeys(s["benchmark"]))
    rows = []
    for method in method_order([m for m in dict.fromkeys(s["method"]) if "@" not in m]):  # variants: the sensitivity table
        m = s[s["method"] == method]
        row = {"method": method}
        for b in benches:
            put_interval(row, f"{b} speedup", prompts.speedup(method, pairs, [b]))
            put_interval(row, f"{b} AL", prompts.al(method, pairs, [b]))
        mean = put_interval(row, "mean speedup", prompts.speedup(method, pairs, benches))
        put_interval(row, "mean AL", prompts.al(method, pairs, benches))
        row["n prompts"] = mean.n
        row["mismatches"] = int(m["mismatches"].sum())
        row["mismatches_unexplained"] = int(m["mismatches_unexplained"].sum())
        rows.append(row)
    return pd.DataFrame(rows)


def gain_table(summary: pd.DataFrame, benchmarks: Sequence[str] | None = None,
               *, prompts: PromptTable) -> pd.DataFrame:
    """Per pair: treegraft's mean speedup vs the better endpoint and vs the best HF peer (as the paper),
    each gain with its paired 95% CI (the better rival picked again in every replicate). Then, across
    pairs (:data:`OVER_PAIRS`): the mean, max and min over pairs of each gain, every pair's gain
    recomputed in each replicate of one draw of prompts (:meth:`PromptTable.gain_over_pairs`); the
    rival column names the pair at the max / min. With one pair they equal its row."""
    rows, pairs = [], []
    for pair in dict.fromkeys(summary["pair"]):
        methods = set(summary.loc[summary["pair"] == pair, "method"])
        if "treegraft" not in methods:
            continue
        pairs.append(pair)
        row = {"pair": pair}
        own = put_interval(row, "treegraft", prompts.speedup("treegraft", [pair], benchmarks))
        for label, rivals in (("better endpoint", ENDPOINTS), ("best HF peer", HF_PEERS)):
            present = [r for r in rivals if r in methods]
            best = prompts.best(present, [pair], benchmarks) if present else None
            row[label] = best or "--"
            put_interval(row, f"{label} speedup", prompts.speedup(best, [pair], benchmarks) if best else NAN_INTERVAL)
            put_interval(row, f"gain vs {label} %", prompts.gain("treegraft", present, [pair], benchmarks) if present
                         else NAN_INTERVAL)
        row["n prompts"] = own.n
        row["n pairs"] = 1
        rows.append(row)
    if pairs:
        over = {label: prompts.gain_over_pairs("treegraft", rivals, pairs, benchmarks)
                for label, rivals in (("better endpoint", ENDPOINTS), ("best HF peer", HF_PEERS))}
        n = next((o.mean.n for o in over.values() if o.pairs), 0)
        for stat, name in OVER_PAIRS.items():
            row = {"pair": name}
            for label, o in over.items():
                at = {"mean": "per pair", "max": o.argmax, "min": o.argmin}[stat] if o.pairs else None
                row[label] = f"at {at}" if stat != "mean" and at else (at or "--")
                put_interval(row, f"gain vs {label} %", getattr(o, stat))
            row["n prompts"] = n
            row["n pairs"] = max(len(o.pairs) for o in over.values())
            rows.append(row)
    return pd.DataFrame(rows)


def ablation_table(summary: pd.DataFrame, pairs: Sequence[str] | None = None,
                   *, prompts: PromptTable) -> pd.DataFrame:
    """The shared-tree variants on the prompts each ran (the ablations may run on the first k of each
    benchmark): speedup, AL, call rate, with CIs."""
    s = summary if pairs is None else summary[summary["pair"].isin(pairs)]
    pairs = list(dict.fromkeys(s["pair"]))
    rows = []
    present = [m for m in ABLATIONS if m in set(s["method"])]
    if present == ["treegraft"]:  # no ablation was run (e.g. the cpu experiment: they have their own)
        return pd.DataFrame()
    for method in present:
        row = {"method": method}
        _put_measures(row, prompts, method, pairs)
        rows.append(row)
    return pd.DataFrame(rows)


def scheduling_table(summary: pd.DataFrame, *, prompts: PromptTable) -> pd.DataFrame:
    """Per pair: the learned scheduler's call rate beside its gain over the better endpoint (which one
    is better, and the gain with its CI), then its and the endpoints' speedups: frequent calls where
    all_mid wins, sparse calls where all_small wins."""
    rows = []
    for pair, g in summary.groupby("pair", sort=False):
        methods = set(g["method"])
        row = {"pair": pair}
        if "treegraft" in methods:
            put_interval(row, "treegraft call rate", prompts.call_rate("treegraft", [pair]))
            present = [r for r in ENDPOINTS if r in methods]
            row["better endpoint"] = (prompts.best(present, [pair]) if present else None) or "--"
            put_interval(row, "gain vs better endpoint %", prompts.gain("treegraft", present, [pair]) if present
                         else NAN_INTERVAL)
        speedups = {m: put_interval(row, f"{m} speedup", prompts.speedup(m, [pair]))
                    for m in ("treegraft", "all_small", "all_mid", "fixed") if m in methods}
        if "treegraft" in methods:
            put_interval(row, "treegraft AL", prompts.al("treegraft", [pair]))
            row["n prompts"] = speedups["treegraft"].n
        rows.append(row)
    return pd.DataFrame(rows)


def held_out_table(summary: pd.DataFrame, held_out_pairs: Sequence[str], held_out_benchmarks: Sequence[str],
                   *, prompts: PromptTable) -> pd.DataFrame:
    """Speedup per method on what the scheduler never saw: each held-out pair (all benchmarks) and each
    held-out benchmark (per pair), with CIs."""
    rows = []
    scopes = [("held-out pair", p, None) for p in held_out_pairs if p in set(summary["pair"])]
    scopes += [("held-out benchmark", p, [b]) for b in held_out_benchmarks for p in dict.fromkeys(summary["pair"])
               if p not in set(held_out_pairs) and ((summary["pair"] == p) & (summary["benchmark"] == b)).any()]
    for label, pair, benches in scopes:
        part = summary[(summary["pair"] == pair) & (summary["benchmark"].isin(benches) if benches else True)]
        for method in method_order(list(dict.fromkeys(part["method"]))):
            row = {"split": label, "pair": pair, "benchmark": benches[0] if benches else "all", "method": method}
            _put_measures(row, prompts, method, [pair], benches)
            row["mismatches"] = int(part.loc[part["method"] == method, "mismatches"].sum())
            rows.append(row)
    return pd.DataFrame(rows)


def sensitivity_table(summary: pd.DataFrame, *, prompts: PromptTable) -> pd.DataFrame:
    """Per pair: treegraft with its calibrated runtime context and with it rescaled (the
    ``treegraft@t_mid_x1.25`` variants), each variant's speedup and call rate and its change against
    treegraft on the same prompts, with CIs."""
    rows = []
    for pair in dict.fromkeys(summary["pair"]):
        methods = list(dict.fromkeys(summary.loc[summary["pair"] == pair, "method"]))
        variants = [m for m in methods if m.startswith("treegraft@")]
        if "treegraft" not in methods or not variants:
            continue
        for method in ["treegraft", *variants]:
            row = {"pair": pair, "method": method, "context": method.partition("@")[2] or "as calibrated"}
            speedup = put_interval(row, "speedup", prompts.speedup(method, [pair]))
            put_interval(row, "call_rate", prompts.call_rate(method, [pair]))
            if method != "treegraft":
                put_interval(row, "change vs treegraft %", prompts.gain(method, ["treegraft"], [pair]))
            row["n prompts"] = speedup.n
            rows.append(row)
    return pd.DataFrame(rows)


def small_drafter_table(summary: pd.DataFrame, *, prompts: PromptTable) -> pd.DataFrame:
    """Table 9: per pair, every tree method evaluated with a neural small drafter (``fixed@self_draft``) beside
    the same method with the n-gram one (``fixed``), on the same prompts: speedup, AL, the small drafter's share
    of turn time, and on each neural row the n-gram's gain over it (% , paired CI)."""
    from ..decoding.methods import method_small

    rows = []
    for pair in dict.fromkeys(summary["pair"]):
        part = summary[summary["pair"] == pair]
        methods = list(dict.fromkeys(part["method"]))
        variants = [m for m in methods if "@" in m and method_small(m)]
        for base in dict.fromkeys(m.partition("@")[0] for m in variants):
            if base not in methods:
                continue
            for method in [base, *[v for v in variants if v.partition("@")[0] == base]]:
                small = method_small(method) or "ngram"
                row = {"pair": pair, "method": base, "small drafter": small}
                speedup = put_interval(row, "speedup", prompts.speedup(method, [pair]))
                put_interval(row, "mean AL", prompts.al(method, [pair]))
                share = part.loc[part["method"] == method, "share_small"]
                row["small time share"] = float(share.mean()) if share.notna().any() else float("nan")
                put_interval(row, "n-gram gain over it %", prompts.gain(base, [method], [pair]) if method != base
                             else NAN_INTERVAL)
                row["n prompts"] = speedup.n
                rows.append(row)
    return pd.DataFrame(rows)


def summary_with_intervals(summary: pd.DataFrame, intervals: pd.DataFrame) -> pd.DataFrame:
    """``summary`` with each cell's 95% CIs (``speedup lo`` / ``hi``, ``mean_al lo`` / ``hi``, ``call_rate
    lo`` / ``hi``) and ``n prompts`` beside its columns, from :func:`method_intervals`' rows."""
    ci = intervals[intervals["benchmark"] != "mean"].rename(columns={
        "speedup_lo": "speedup lo", "speedup_hi": "speedup hi", "al_lo": "mean_al lo", "al_hi": "mean_al hi",
        "call_rate_lo": "call_rate lo", "call_rate_hi": "call_rate hi", "n": "n prompts"})
    added = ["speedup lo", "speedup hi", "mean_al lo", "mean_al hi", "call_rate lo", "call_rate hi", "n prompts"]
    out = summary.merge(ci[["pair", "benchmark", "method", *added]], on=["pair", "benchmark", "method"], how="left")
    cols = list(summary.columns)
    for after, new in (("speedup", ["speedup lo", "speedup hi"]), ("mean_al", ["mean_al lo", "mean_al hi"]),
                       ("call_rate", ["call_rate lo", "call_rate hi"]), ("prompts", ["n prompts"])):
        i = cols.index(after) + 1 if after in cols else len(cols)
        cols[i:i] = new
    return out[cols]


def headline_metrics(tables: dict[str, pd.DataFrame]) -> dict[str, float]:
    """The report's figures as flat W&B summary metrics, every one with ``_lo`` / ``_hi`` (95% CI) and
    ``_n`` (prompts): each method's mean speedup and AL (main table), each pair's gains, and the gains'
    mean / max / min over pairs (``gain/all_pairs/<stat>_gain_vs_better_endpoint_%``)."""
    out: dict[str, float] = {}

    def put(key: str, row, col: str, n) -> None:
        if col in row and row[col] == row[col]:
            ci = row_interval(row, col, int(n))
            out.update({key: float(ci.value), f"{key}_lo": float(ci.low), f"{key}_hi": float(ci.high),
                        f"{key}_n": ci.n})

    for _, r in tables.get("main", pd.DataFrame()).iterrows():
        put(f"main/{r['method']}/speedup", r, "mean speedup", r["n prompts"])
        put(f"main/{r['method']}/al", r, "mean AL", r["n prompts"])
    stats = {name: stat for stat, name in OVER_PAIRS.items()}
    for _, r in tables.get("gain", pd.DataFrame()).iterrows():
        for col in ("treegraft", "gain vs better endpoint %", "gain vs best HF peer %"):
            if r["pair"] in stats:
                if col != "treegraft":
                    put(f"gain/all_pairs/{stats[r['pair']]}_{col.replace(' ', '_')}", r, col, r["n prompts"])
            else:
                put(f"gain/{r['pair']}/{col.replace(' ', '_')}", r, col, r["n prompts"])
    return out
