"""Tables and figures from saved artifacts alone (no model is run): `make tables`, `make figures`.

Inputs: ``evaluate/`` records, ``distill/offline_eval.csv``, ``fit/oof_summary.csv``,
``collect/<pair>/runtime.json`` (the verification curve). Outputs under ``report/``: every table as
CSV + Markdown + LaTeX, every figure as PNG + PDF. The notebook calls these same functions.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import numpy as np
import pandas as pd

from ..stats import DEFAULT_RESAMPLES, Interval
from .artifacts import MissingArtifactError, atomic_write_text
from .common import fold_intervals, to_markdown
from .distill import IN_SAMPLE_DISTILLED, IN_SAMPLE_PLANNER
from .estimates import PromptTable, method_intervals
from .evaluate import read_records, summarize_records

__all__ = [
    "load_summary",
    "load_records",
    "headline_metrics",
    "main_table",
    "gain_table",
    "ablation_table",
    "scheduling_table",
    "held_out_table",
    "sensitivity_table",
    "write_table",
    "make_tables",
    "make_figures",
    "METHOD_ORDER",
]

METHOD_ORDER = ["ar", "all_small", "all_mid", "treegraft", "fixed", "no_nondestructive", "no_expanded_selection",
                "all_call", "direct_planner", "csd", "hf_assisted", "hf_prompt_lookup"]
ABLATIONS = ["treegraft", "fixed", "no_nondestructive", "no_expanded_selection", "all_call", "direct_planner"]
PEERS = ["hf_assisted", "hf_prompt_lookup", "csd"]
ENDPOINTS = ["all_small", "all_mid"]
HF_PEERS = ["hf_assisted", "hf_prompt_lookup"]
NAN_INTERVAL = Interval(float("nan"), float("nan"), float("nan"), 0)


def load_summary(exp_dir: Path) -> pd.DataFrame:
    """The per pair x benchmark x method summary, rebuilt from the evaluation records."""
    return summarize_records(load_records(exp_dir))


def load_records(exp_dir: Path) -> pd.DataFrame:
    """Every evaluation record (one row per prompt x method) of an experiment."""
    eval_dir = Path(exp_dir) / "evaluate"
    if not eval_dir.exists():
        raise MissingArtifactError(f"missing {eval_dir}: run the `evaluate` stage first (make evaluate)")
    return read_records(eval_dir)


def _order(methods: Sequence[str]) -> list[str]:
    return [m for m in METHOD_ORDER if m in methods] + [m for m in methods if m not in METHOD_ORDER]


def _put(row: dict, name: str, ci: Interval) -> Interval:
    """``name``, ``name lo``, ``name hi`` (the 95% CI) into ``row``; returns ``ci`` (for its n)."""
    row.update({name: ci.value, f"{name} lo": ci.low, f"{name} hi": ci.high})
    return ci


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
    for method in _order([m for m in dict.fromkeys(s["method"]) if "@" not in m]):  # variants: the sensitivity table
        m = s[s["method"] == method]
        row = {"method": method}
        for b in benches:
            _put(row, f"{b} speedup", prompts.speedup(method, pairs, [b]))
            _put(row, f"{b} AL", prompts.al(method, pairs, [b]))
        mean = _put(row, "mean speedup", prompts.speedup(method, pairs, benches))
        _put(row, "mean AL", prompts.al(method, pairs, benches))
        row["n prompts"] = mean.n
        row["mismatches"] = int(m["mismatches"].sum())
        row["mismatches_unexplained"] = int(m["mismatches_unexplained"].sum())
        rows.append(row)
    return pd.DataFrame(rows)


def gain_table(summary: pd.DataFrame, benchmarks: Sequence[str] | None = None,
               *, prompts: PromptTable) -> pd.DataFrame:
    """Per pair: treegraft's mean speedup vs the better endpoint and vs the best HF peer (as the paper),
    each gain with its paired 95% CI (the better rival picked again in every replicate)."""
    rows = []
    for pair in dict.fromkeys(summary["pair"]):
        methods = set(summary.loc[summary["pair"] == pair, "method"])
        if "treegraft" not in methods:
            continue
        row = {"pair": pair}
        own = _put(row, "treegraft", prompts.speedup("treegraft", [pair], benchmarks))
        for label, rivals in (("better endpoint", ENDPOINTS), ("best HF peer", HF_PEERS)):
            present = [r for r in rivals if r in methods]
            best = prompts.best(present, [pair]) if present else None
            row[label] = best or "--"
            _put(row, f"{label} speedup", prompts.speedup(best, [pair], benchmarks) if best else NAN_INTERVAL)
            _put(row, f"gain vs {label} %", prompts.gain("treegraft", present, [pair], benchmarks) if present
                 else NAN_INTERVAL)
        row["n prompts"] = own.n
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
        speedup = _put(row, "speedup", prompts.speedup(method, pairs))
        _put(row, "mean_al", prompts.al(method, pairs))
        _put(row, "call_rate", prompts.call_rate(method, pairs))
        row["n prompts"] = speedup.n
        rows.append(row)
    return pd.DataFrame(rows)


def scheduling_table(summary: pd.DataFrame, *, prompts: PromptTable) -> pd.DataFrame:
    """Per pair: the learned scheduler's call rate next to its speedup and the endpoints' speedups."""
    rows = []
    for pair, g in summary.groupby("pair", sort=False):
        methods = set(g["method"])
        row, speedups = {"pair": pair}, {}
        for m in ("treegraft", "all_small", "all_mid", "fixed"):
            if m in methods:
                speedups[m] = _put(row, f"{m} speedup", prompts.speedup(m, [pair]))
        if "treegraft" in methods:
            _put(row, "treegraft call rate", prompts.call_rate("treegraft", [pair]))
            _put(row, "treegraft AL", prompts.al("treegraft", [pair]))
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
        for method in _order(list(dict.fromkeys(part["method"]))):
            row = {"split": label, "pair": pair, "benchmark": benches[0] if benches else "all", "method": method}
            speedup = _put(row, "speedup", prompts.speedup(method, [pair], benches))
            _put(row, "mean_al", prompts.al(method, [pair], benches))
            _put(row, "call_rate", prompts.call_rate(method, [pair], benches))
            row["n prompts"] = speedup.n
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
            speedup = _put(row, "speedup", prompts.speedup(method, [pair]))
            _put(row, "call_rate", prompts.call_rate(method, [pair]))
            if method != "treegraft":
                _put(row, "change vs treegraft %", prompts.gain(method, ["treegraft"], [pair]))
            row["n prompts"] = speedup.n
            rows.append(row)
    return pd.DataFrame(rows)


def write_table(df: pd.DataFrame, out_dir: Path, name: str) -> None:
    """``<name>.csv`` (numbers: every CI as ``lo`` / ``hi`` columns) and ``<name>.md`` / ``<name>.tex``
    (every CI folded into its cell: ``1.23 [1.10, 1.35]``)."""
    out_dir = Path(out_dir)
    shown = fold_intervals(df)
    atomic_write_text(df.to_csv(index=False), out_dir / f"{name}.csv")
    atomic_write_text(to_markdown(shown, "{}"), out_dir / f"{name}.md")
    atomic_write_text(shown.to_latex(index=False, na_rep="--"), out_dir / f"{name}.tex")


def make_tables(exp_dir: Path, held_out_pairs: Sequence[str] = (), held_out_benchmarks: Sequence[str] = ("mt_bench",),
                out_dir: Path | None = None, n_resamples: int = DEFAULT_RESAMPLES) -> dict[str, pd.DataFrame]:
    """Every table of the report, each with its 95% CIs (paired bootstrap over prompts, ``n_resamples``
    replicates) and prompt counts; returns them by name."""
    exp_dir = Path(exp_dir)
    out_dir = Path(out_dir or exp_dir / "report")
    records = load_records(exp_dir)
    summary = summarize_records(records)
    prompts = PromptTable(records, n_resamples)
    fit_pairs = [p for p in dict.fromkeys(summary["pair"]) if p not in set(held_out_pairs)]
    fit_benchmarks = [b for b in dict.fromkeys(summary["benchmark"]) if b not in set(held_out_benchmarks)]
    tables = {
        "summary": summary,
        "intervals": method_intervals(records, table=prompts),
        "main": main_table(summary, fit_pairs, prompts=prompts),
        "gain": gain_table(summary, prompts=prompts),
        "gain_fit_benchmarks": gain_table(summary, fit_benchmarks, prompts=prompts),
        "ablation": ablation_table(summary, fit_pairs, prompts=prompts),
        "scheduling": scheduling_table(summary, prompts=prompts),
        "held_out": held_out_table(summary, held_out_pairs, held_out_benchmarks, prompts=prompts),
    }
    sensitivity = sensitivity_table(summary, prompts=prompts)
    if not sensitivity.empty:
        tables["sensitivity"] = sensitivity
    offline = exp_dir / "distill" / "offline_eval.csv"
    if offline.exists():
        tables["offline_scheduler"] = pd.read_csv(offline)
    contrasts = exp_dir / "distill" / "offline_contrasts.csv"
    if contrasts.exists():
        tables["offline_contrasts"] = pd.read_csv(contrasts)
    oof = exp_dir / "fit" / "oof_summary.csv"
    if oof.exists():
        tables["oof"] = pd.read_csv(oof)
    for name, df in tables.items():
        write_table(df, out_dir, name)
    return tables


def headline_metrics(tables: dict[str, pd.DataFrame]) -> dict[str, float]:
    """The report's figures as flat W&B summary metrics, every one with ``_lo`` / ``_hi`` (95% CI) and
    ``_n`` (prompts): each method's mean speedup and AL (main table), each pair's gains."""
    out: dict[str, float] = {}

    def put(key: str, row, col: str, n) -> None:
        if col in row and row[col] == row[col]:
            out.update({key: float(row[col]), f"{key}_lo": float(row[f"{col} lo"]), f"{key}_hi": float(row[f"{col} hi"]),
                        f"{key}_n": int(n)})

    for _, r in tables.get("main", pd.DataFrame()).iterrows():
        put(f"main/{r['method']}/speedup", r, "mean speedup", r["n prompts"])
        put(f"main/{r['method']}/al", r, "mean AL", r["n prompts"])
    for _, r in tables.get("gain", pd.DataFrame()).iterrows():
        for col in ("treegraft", "gain vs better endpoint %", "gain vs best HF peer %"):
            put(f"gain/{r['pair']}/{col.replace(' ', '_')}", r, col, r["n prompts"])
    return out


def _save(fig, out_dir: Path, name: str) -> list[Path]:
    paths = []
    for ext in ("png", "pdf"):
        path = Path(out_dir) / f"{name}.{ext}"
        tmp = path.with_name(f".{path.name}.tmp.{ext}")
        fig.savefig(tmp, dpi=150, bbox_inches="tight")
        tmp.replace(path)
        paths.append(path)
    return paths


def make_figures(exp_dir: Path, out_dir: Path | None = None) -> list[Path]:
    """Speedup per method per benchmark, AL vs call rate, time split, verification curve, offline comparison."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    exp_dir = Path(exp_dir)
    out_dir = Path(out_dir or exp_dir / "report")
    out_dir.mkdir(parents=True, exist_ok=True)
    records = load_records(exp_dir)
    summary = summarize_records(records)
    intervals = method_intervals(records)
    written: list[Path] = []

    pairs = list(dict.fromkeys(intervals["pair"]))
    fig, axes = plt.subplots(len(pairs), 1, figsize=(11, 3.6 * len(pairs)), squeeze=False, constrained_layout=True)
    for ax, pair in zip(axes[:, 0], pairs):
        ci = intervals[intervals["pair"] == pair]
        piv = ci.pivot_table(index="benchmark", columns="method", values="speedup", sort=False)
        lo = ci.pivot_table(index="benchmark", columns="method", values="speedup_lo", sort=False)
        hi = ci.pivot_table(index="benchmark", columns="method", values="speedup_hi", sort=False)
        cols = _order(list(piv.columns))
        piv, lo, hi = piv[cols], lo.reindex_like(piv)[cols], hi.reindex_like(piv)[cols]
        errors = np.stack([(piv - lo).clip(lower=0).to_numpy().T, (hi - piv).clip(lower=0).to_numpy().T], axis=1)
        piv.plot.bar(ax=ax, width=0.85, colormap="tab20", yerr=errors, capsize=1.5, error_kw={"lw": 0.6})
        ax.axhline(1.0, color="black", lw=0.8, ls="--")
        ax.set_ylabel("speedup vs ar")
        ax.tick_params(axis="x", labelrotation=0)
        n = int(ci.loc[(ci["method"] == "ar") & (ci["benchmark"] == "mean"), "n"].max())
        ax.set_title(f"{pair}: speedup per method and benchmark, 95% CI over prompts (n = {n} prompts)")
        ax.legend(ncol=4, fontsize=7)
    written += _save(fig, out_dir, "speedup_per_benchmark")
    plt.close(fig)

    g = intervals[(intervals["benchmark"] == "mean")].dropna(subset=["call_rate"])
    fig, ax = plt.subplots(figsize=(6, 4))
    for method, m in g.groupby("method"):
        ax.errorbar(m["call_rate"], m["al"], fmt="o", label=method, ms=5, capsize=2, lw=0.8,
                    xerr=[(m["call_rate"] - m["call_rate_lo"]).clip(lower=0), (m["call_rate_hi"] - m["call_rate"]).clip(lower=0)],
                    yerr=[(m["al"] - m["al_lo"]).clip(lower=0), (m["al_hi"] - m["al"]).clip(lower=0)])
    ax.set_xlabel("middle-drafter call rate (calls per drafting step)")
    ax.set_ylabel("mean accepted length")
    ax.set_title("AL vs call rate (one point per pair, 95% CIs over prompts)")
    ax.legend(fontsize=7)
    written += _save(fig, out_dir, "al_vs_call_rate")
    plt.close(fig)

    split = summary.groupby("method")[["share_small", "share_middle", "share_verify", "share_other"]].mean()
    split = split.reindex([m for m in _order(list(split.index)) if m in split.index]).dropna(how="all")
    fig, ax = plt.subplots(figsize=(9, 4))
    split.plot.bar(stacked=True, ax=ax)
    ax.set_ylabel("share of turn time")
    ax.set_title("Time split per method")
    written += _save(fig, out_dir, "time_split")
    plt.close(fig)

    curves = sorted((exp_dir / "collect").glob("*/runtime.json"))
    if curves:
        fig, ax = plt.subplots(figsize=(6, 4))
        for path in curves:
            info = json.loads(path.read_text())
            curve = {int(k): v for k, v in (info.get("verify_curve") or {}).items()}
            if curve:
                base = curve[min(curve)]
                ax.plot(list(curve), [v / base for v in curve.values()], marker="o", label=f"{info['pair']} (B={info['budget']})")
        ax.set_xlabel("verified tree size (tokens)")
        ax.set_ylabel("latency / one-token forward")
        ax.set_title("Verification-latency curve (budget=auto)")
        ax.legend(fontsize=7)
        written += _save(fig, out_dir, "verify_curve")
        plt.close(fig)

    offline = exp_dir / "distill" / "offline_eval.csv"
    if offline.exists():
        t = pd.read_csv(offline)
        if "pair" in t:  # the pooled rows (every pair's held-out reports)
            t = t[t["pair"] == "all pairs"]
        t = t[~t["policy"].isin([IN_SAMPLE_DISTILLED, IN_SAMPLE_PLANNER])]  # the figure shows held-out figures only
        fig, ax = plt.subplots(figsize=(7, 4))
        y = np.arange(len(t))
        if "pct_of_oracle_lo" in t:  # share of the oracle with its prompt-resampled CI
            err = np.stack([(t["pct_of_oracle"] - t["pct_of_oracle_lo"]).clip(lower=0),
                            (t["pct_of_oracle_hi"] - t["pct_of_oracle"]).clip(lower=0)])
            ax.barh(y, t["pct_of_oracle"], xerr=err, capsize=2)
            ax.set_xlabel(f"% of the oracle's tokens/s per turn, 95% CI over prompts (n = {int(t['prompts'].max())} "
                          f"prompts, {int(t['turns'].max())} turns)")
        elif "total_tau" in t:  # older artifacts: both measures, no CI
            ax.barh(y - 0.2, t["mean_tau"], height=0.4, label="mean of per-turn tokens/s")
            ax.barh(y + 0.2, t["total_tau"], height=0.4, label="all tokens / all seconds")
            ax.legend(fontsize=7)
            ax.set_xlabel("tokens/s (held-out reports)")
        else:
            ax.barh(y, t["mean_tau"])
            ax.set_xlabel("tokens/s (held-out reports)")
        ax.set_yticks(y, t["policy"])
        ax.set_title("Offline scheduler comparison")
        ax.invert_yaxis()
        written += _save(fig, out_dir, "offline_scheduler")
        plt.close(fig)
    return written
