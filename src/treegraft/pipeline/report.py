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

from .artifacts import MissingArtifactError, atomic_write_text
from .common import to_markdown
from .distill import IN_SAMPLE_DISTILLED, IN_SAMPLE_PLANNER
from .evaluate import read_records, summarize_records

__all__ = [
    "load_summary",
    "main_table",
    "gain_table",
    "ablation_table",
    "scheduling_table",
    "held_out_table",
    "write_table",
    "make_tables",
    "make_figures",
    "METHOD_ORDER",
]

METHOD_ORDER = ["ar", "all_small", "all_mid", "treegraft", "fixed", "no_nondestructive", "no_expanded_selection",
                "all_call", "direct_planner", "csd", "hf_assisted", "hf_prompt_lookup"]
ABLATIONS = ["treegraft", "fixed", "no_nondestructive", "no_expanded_selection", "all_call", "direct_planner"]
PEERS = ["hf_assisted", "hf_prompt_lookup", "csd"]


def load_summary(exp_dir: Path) -> pd.DataFrame:
    """The per pair x benchmark x method summary, rebuilt from the evaluation records."""
    eval_dir = Path(exp_dir) / "evaluate"
    if not eval_dir.exists():
        raise MissingArtifactError(f"missing {eval_dir}: run the `evaluate` stage first (make evaluate)")
    return summarize_records(read_records(eval_dir))


def _order(methods: Sequence[str]) -> list[str]:
    return [m for m in METHOD_ORDER if m in methods] + [m for m in methods if m not in METHOD_ORDER]


def main_table(summary: pd.DataFrame, pairs: Sequence[str] | None = None, benchmarks: Sequence[str] | None = None) -> pd.DataFrame:
    """Speedup and mean AL per method x benchmark (mean over ``pairs``), with a mean column and the
    mismatch count, as the paper's main table."""
    s = summary
    if pairs is not None:
        s = s[s["pair"].isin(pairs)]
    if benchmarks is not None:
        s = s[s["benchmark"].isin(benchmarks)]
    benches = list(dict.fromkeys(s["benchmark"]))
    rows = []
    for method in _order(list(dict.fromkeys(s["method"]))):
        m = s[s["method"] == method]
        row = {"method": method}
        for b in benches:
            mb = m[m["benchmark"] == b]
            row[f"{b} speedup"] = float(mb["speedup"].mean())
            row[f"{b} AL"] = float(mb["mean_al"].mean())
        row["mean speedup"] = float(m.groupby("benchmark")["speedup"].mean().mean())
        row["mean AL"] = float(m.groupby("benchmark")["mean_al"].mean().mean())
        row["mismatches"] = int(m["mismatches"].sum())
        row["mismatches_unexplained"] = int(m["mismatches_unexplained"].sum())
        rows.append(row)
    return pd.DataFrame(rows)


def _per_pair_speedup(summary: pd.DataFrame, benchmarks: Sequence[str] | None = None) -> pd.DataFrame:
    s = summary if benchmarks is None else summary[summary["benchmark"].isin(benchmarks)]
    return s.pivot_table(index="pair", columns="method", values="speedup", aggfunc="mean")


def gain_table(summary: pd.DataFrame, benchmarks: Sequence[str] | None = None) -> pd.DataFrame:
    """Per pair: treegraft's mean speedup vs the better endpoint and vs the best HF peer (as the paper)."""
    sp = _per_pair_speedup(summary, benchmarks)
    rows = []
    for pair, r in sp.iterrows():
        row = {"pair": pair}
        for m in ("treegraft", "all_small", "all_mid", "hf_assisted", "hf_prompt_lookup"):
            row[m] = float(r.get(m, float("nan")))
        ends = [v for v in (row["all_small"], row["all_mid"]) if v == v]
        peers = [v for v in (row["hf_assisted"], row["hf_prompt_lookup"]) if v == v]
        row["better endpoint"] = max(ends) if ends else float("nan")
        row["gain vs better endpoint %"] = 100 * (row["treegraft"] / row["better endpoint"] - 1) if ends else float("nan")
        row["best HF peer"] = max(peers) if peers else float("nan")
        row["gain vs best HF peer %"] = 100 * (row["treegraft"] / row["best HF peer"] - 1) if peers else float("nan")
        rows.append(row)
    return pd.DataFrame(rows)


def ablation_table(summary: pd.DataFrame, pairs: Sequence[str] | None = None) -> pd.DataFrame:
    s = summary if pairs is None else summary[summary["pair"].isin(pairs)]
    s = s[s["method"].isin(ABLATIONS)]
    g = s.groupby("method").agg(speedup=("speedup", "mean"), mean_al=("mean_al", "mean"), call_rate=("call_rate", "mean"))
    return g.reindex([m for m in ABLATIONS if m in g.index]).reset_index()


def scheduling_table(summary: pd.DataFrame) -> pd.DataFrame:
    """Per pair: the learned scheduler's call rate next to its speedup and the endpoints' speedups."""
    rows = []
    for pair, g in summary.groupby("pair", sort=False):
        by = g.groupby("method")
        row = {"pair": pair}
        for m in ("treegraft", "all_small", "all_mid", "fixed"):
            if m in by.groups:
                row[f"{m} speedup"] = float(by.get_group(m)["speedup"].mean())
        if "treegraft" in by.groups:
            row["treegraft call rate"] = float(by.get_group("treegraft")["call_rate"].mean())
            row["treegraft AL"] = float(by.get_group("treegraft")["mean_al"].mean())
        rows.append(row)
    return pd.DataFrame(rows)


def held_out_table(summary: pd.DataFrame, held_out_pairs: Sequence[str], held_out_benchmarks: Sequence[str]) -> pd.DataFrame:
    """Speedup per method on what the scheduler never saw: held-out pairs (all benchmarks) and the
    held-out benchmarks (every pair)."""
    rows = []
    for label, part in (("held-out pairs", summary[summary["pair"].isin(held_out_pairs)]),
                        ("held-out benchmarks", summary[summary["benchmark"].isin(held_out_benchmarks)])):
        if part.empty:
            continue
        for method in _order(list(dict.fromkeys(part["method"]))):
            m = part[part["method"] == method]
            rows.append({"split": label, "method": method, "speedup": float(m["speedup"].mean()),
                         "mean_al": float(m["mean_al"].mean()), "call_rate": float(m["call_rate"].mean()),
                         "mismatches": int(m["mismatches"].sum())})
    return pd.DataFrame(rows)


def write_table(df: pd.DataFrame, out_dir: Path, name: str) -> None:
    """``<name>.csv``, ``<name>.md`` and ``<name>.tex``."""
    out_dir = Path(out_dir)
    atomic_write_text(df.to_csv(index=False), out_dir / f"{name}.csv")
    atomic_write_text(to_markdown(df, "{:.2f}"), out_dir / f"{name}.md")
    atomic_write_text(df.to_latex(index=False, float_format="%.2f", na_rep="--"), out_dir / f"{name}.tex")


def make_tables(exp_dir: Path, held_out_pairs: Sequence[str] = (), held_out_benchmarks: Sequence[str] = ("mt_bench",),
                out_dir: Path | None = None) -> dict[str, pd.DataFrame]:
    exp_dir = Path(exp_dir)
    out_dir = Path(out_dir or exp_dir / "report")
    summary = load_summary(exp_dir)
    fit_pairs = [p for p in dict.fromkeys(summary["pair"]) if p not in set(held_out_pairs)]
    tables = {
        "summary": summary,
        "main": main_table(summary, fit_pairs),
        "gain": gain_table(summary),
        "ablation": ablation_table(summary, fit_pairs),
        "scheduling": scheduling_table(summary),
        "held_out": held_out_table(summary, held_out_pairs, held_out_benchmarks),
    }
    offline = exp_dir / "distill" / "offline_eval.csv"
    if offline.exists():
        tables["offline_scheduler"] = pd.read_csv(offline)
    oof = exp_dir / "fit" / "oof_summary.csv"
    if oof.exists():
        tables["oof"] = pd.read_csv(oof)
    for name, df in tables.items():
        write_table(df, out_dir, name)
    return tables


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
    summary = load_summary(exp_dir)
    written: list[Path] = []

    piv = summary.pivot_table(index="benchmark", columns="method", values="speedup", aggfunc="mean")
    piv = piv[_order(list(piv.columns))]
    fig, ax = plt.subplots(figsize=(11, 4))
    piv.plot.bar(ax=ax, width=0.85, colormap="tab20")  # 12 methods: more colours than the default cycle
    ax.axhline(1.0, color="black", lw=0.8, ls="--")
    ax.set_ylabel("speedup vs ar")
    ax.set_title("Speedup per method and benchmark (mean over pairs)")
    ax.legend(ncol=4, fontsize=7)
    written += _save(fig, out_dir, "speedup_per_benchmark")
    plt.close(fig)

    g = summary.dropna(subset=["call_rate"]).groupby(["pair", "method"]).agg(al=("mean_al", "mean"), rate=("call_rate", "mean")).reset_index()
    fig, ax = plt.subplots(figsize=(6, 4))
    for method, m in g.groupby("method"):
        ax.scatter(m["rate"], m["al"], label=method, s=30)
    ax.set_xlabel("middle-drafter call rate (calls per drafting step)")
    ax.set_ylabel("mean accepted length")
    ax.set_title("AL vs call rate (one point per pair)")
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
        if "total_tau" in t:  # both measures: the mean of turn ratios and all tokens / all seconds
            ax.barh(y - 0.2, t["mean_tau"], height=0.4, label="mean of per-turn tokens/s")
            ax.barh(y + 0.2, t["total_tau"], height=0.4, label="all tokens / all seconds")
            ax.legend(fontsize=7)
        else:
            ax.barh(y, t["mean_tau"])
        ax.set_yticks(y, t["policy"])
        ax.set_xlabel("tokens/s (held-out reports)")
        ax.set_title("Offline scheduler comparison")
        ax.invert_yaxis()
        written += _save(fig, out_dir, "offline_scheduler")
        plt.close(fig)
    return written
