"""The report's figures, drawn from an experiment's evaluation records and saved artifacts.

:func:`draw_figures` draws every figure of :data:`FIGURES` whose input is there, each saved as PNG and
PDF (written to a temporary name, then moved into place): speedup per method and benchmark with 95%
CIs, mean AL against the middle drafter's call rate, the split of turn time, the verification-latency
curve ``collect/<pair>/runtime.json`` measured, and the offline scheduler comparison of
``distill/offline_eval.csv``. It only draws; :func:`~.report.make_figures` removes the figures whose
input is gone and rewrites the report's index.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd

from .artifacts import IN_SAMPLE_DISTILLED, IN_SAMPLE_PLANNER
from .estimates import method_intervals
from .records import summarize_records
from .report_tables import method_order

__all__ = ["draw_figures", "FIGURES"]

FIGURES = {
    "speedup_per_benchmark": "speedup per method and benchmark, per pair, 95% CIs",
    "al_vs_call_rate": "mean AL vs middle-drafter call rate, one point per pair and method, 95% CIs",
    "time_split": "share of turn time: small drafter, middle drafter, verification, other",
    "verify_curve": "verification latency vs tree size (collect's runtime.json)",
    "offline_scheduler": "offline scheduler comparison: share of the oracle, 95% CIs",
}


def _save(fig, out_dir: Path, name: str) -> list[Path]:
    paths = []
    for ext in ("png", "pdf"):
        path = Path(out_dir) / f"{name}.{ext}"
        tmp = path.with_name(f".{path.name}.tmp.{ext}")
        fig.savefig(tmp, dpi=150, bbox_inches="tight")
        tmp.replace(path)
        paths.append(path)
    return paths


def _error_arms(value, low, high):
    """The lengths of an error bar's arms below and above ``value`` for its CI ``low`` .. ``high`` (never negative)."""
    return (value - low).clip(lower=0), (high - value).clip(lower=0)


def draw_figures(records: pd.DataFrame, exp_dir: Path, out_dir: Path) -> list[Path]:
    """Speedup per method per benchmark, AL vs call rate, time split (from ``records``), verification curve,
    offline comparison (from ``exp_dir``'s artifacts, where they are there), saved under ``out_dir``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    exp_dir = Path(exp_dir)
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
        cols = method_order(list(piv.columns))
        piv, lo, hi = piv[cols], lo.reindex_like(piv)[cols], hi.reindex_like(piv)[cols]
        errors = np.stack([arm.to_numpy().T for arm in _error_arms(piv, lo, hi)], axis=1)
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
                    xerr=list(_error_arms(m["call_rate"], m["call_rate_lo"], m["call_rate_hi"])),
                    yerr=list(_error_arms(m["al"], m["al_lo"], m["al_hi"])))
    ax.set_xlabel("middle-drafter call rate (calls per drafting step)")
    ax.set_ylabel("mean accepted length")
    ax.set_title("AL vs call rate (one point per pair, 95% CIs over prompts)")
    ax.legend(fontsize=7)
    written += _save(fig, out_dir, "al_vs_call_rate")
    plt.close(fig)

    split = summary.groupby("method")[["share_small", "share_middle", "share_verify", "share_other"]].mean()
    split = split.reindex([m for m in method_order(list(split.index)) if m in split.index]).dropna(how="all")
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
            err = np.stack(_error_arms(t["pct_of_oracle"], t["pct_of_oracle_lo"], t["pct_of_oracle_hi"]))
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
