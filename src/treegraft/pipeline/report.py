"""Tables and figures from saved artifacts alone (no model is run): `make tables`, `make figures`.

Inputs: ``evaluate/`` records, ``distill/offline_eval.csv``, ``fit/oof_summary.csv``,
``collect/<pair>/runtime.json`` (the verification curve). Outputs under ``report/``: every table as
CSV + Markdown + LaTeX, every figure as PNG + PDF, and ``README.md``, the index: what was written
(with n) and, for each study this experiment did not run, which experiment runs it (:data:`STUDIES`).
A study that was not run leaves no file (an earlier run's file of that name is removed). The
notebook calls these same functions.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple, Sequence

import numpy as np
import pandas as pd

from ..stats import DEFAULT_RESAMPLES, Interval
from .artifacts import MissingArtifactError, atomic_write_text, stage_dir
from .common import fold_intervals, to_markdown
from .distill import IN_SAMPLE_DISTILLED, IN_SAMPLE_PLANNER
from .estimates import PromptTable, method_intervals
from .evaluate import read_records, summarize_records
from .grafting import grafting_examples, grafting_table

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
    "small_drafter_table",
    "write_table",
    "make_tables",
    "make_figures",
    "write_index",
    "not_run",
    "run_report",
    "METHOD_ORDER",
    "TABLES",
    "STUDIES",
    "FIGURES",
    "OVER_PAIRS",
]

METHOD_ORDER = ["ar", "all_small", "all_mid", "treegraft", "fixed", "no_nondestructive", "no_expanded_selection",
                "all_call", "direct_planner", "csd", "hf_assisted", "hf_prompt_lookup"]
ABLATIONS = ["treegraft", "fixed", "no_nondestructive", "no_expanded_selection", "all_call", "direct_planner"]
PEERS = ["hf_assisted", "hf_prompt_lookup", "csd"]
ENDPOINTS = ["all_small", "all_mid"]
HF_PEERS = ["hf_assisted", "hf_prompt_lookup"]
NAN_INTERVAL = Interval(float("nan"), float("nan"), float("nan"), 0)
# the gain table's rows across pairs (after the per-pair rows): statistic -> the row's `pair` cell
OVER_PAIRS = {"mean": "mean over pairs", "max": "max over pairs", "min": "min over pairs (worst pair)"}


class Study(NamedTuple):
    """A table the report writes only where the experiment ran its study. ``experiments``: those that
    run it (``experiment=<name>``); ``needs``: what else produces it; ``table`` / ``rows``: where it
    lives when it is part of another table (``rows`` = (column, value) of its rows)."""

    description: str
    experiments: tuple[str, ...] = ()
    needs: str | None = None
    table: str | None = None
    rows: tuple[str, str] | None = None


# the tables every report writes where its methods were evaluated
TABLES = {
    "summary": "per pair x benchmark x method: speedup, AL, call rate (95% CIs), tokens/s, time split, mismatches",
    "intervals": "per pair x benchmark (and `mean`) x method: speedup, AL, call rate with 95% CIs",
    "main": "speedup and AL per method x benchmark, mean over the fitting pairs (the paper's main table)",
    "gain": "treegraft vs the better endpoint and the best HF peer, per pair, then the mean / max / min over pairs",
    "gain_fit_benchmarks": "the gain table on the fitting benchmarks only (held-out benchmarks left out)",
    "scheduling": "per pair: treegraft's call rate beside its gain over the better endpoint, and the endpoints' speedups",
}
# studies an experiment may not run; the index names the experiment that runs each (data, not prose)
STUDIES = {
    "ablation": Study("shared-tree ablations (fixed schedule, no non-destructive grafting, no expanded selection, "
                      "all-call, direct planner): speedup, AL, call rate",
                      ("cpu_ablations", "cpu_full", "cpu_llama_full", "smoke")),
    "sensitivity": Study("treegraft with its runtime context rescaled (t_tgt, t_mid x0.75 / x1.25)",
                         ("cpu_full", "cpu_llama_full")),
    "held_out": Study("speedup on what the scheduler never saw: held-out benchmarks per pair, held-out pairs",
                      needs="a benchmark of `pipeline.held_out_benchmarks` in `evaluation.benchmarks`, or a held-out pair"),
    "held_out_pair": Study("a pair the scheduler was never fitted on", ("cpu", "cpu_full", "paper"), table="held_out",
                           rows=("split", "held-out pair")),
    "offline_scheduler": Study("offline scheduler comparison: share of the per-turn oracle, held-out folds",
                               needs="`make distill` (distill/offline_eval.csv)"),
    "offline_contrasts": Study("offline differences between schedulers, points of the oracle",
                               needs="`make distill` (distill/offline_contrasts.csv)"),
    "oof": Study("grouped out-of-fold errors of the value heads per feature subset", needs="`make fit` (fit/oof_summary.csv)"),
    "small_drafter": Study("Table 9: a tree method with the n-gram small drafter against the same method with a "
                           "neural one (`<method>@<small drafter>`): speedup, AL, small-drafter time share, the "
                           "n-gram's gain", ("cpu_small",)),
    "grafting": Study("Appendix G: the share of accepted draft tokens that lay on branches only non-destructive "
                      "grafting kept, per pair x tree method (and grafting_examples.md: two traced turns)",
                      ("cpu_small", "smoke")),
}
# what scripts/report.py prints (every table is written and logged)
PRINTED = ("main", "gain", "scheduling", "ablation", "held_out", "sensitivity", "small_drafter", "grafting",
           "offline_scheduler", "offline_contrasts")
FIGURES = {
    "speedup_per_benchmark": "speedup per method and benchmark, per pair, 95% CIs",
    "al_vs_call_rate": "mean AL vs middle-drafter call rate, one point per pair and method, 95% CIs",
    "time_split": "share of turn time: small drafter, middle drafter, verification, other",
    "verify_curve": "verification latency vs tree size (collect's runtime.json)",
    "offline_scheduler": "offline scheduler comparison: share of the oracle, 95% CIs",
}


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
        own = _put(row, "treegraft", prompts.speedup("treegraft", [pair], benchmarks))
        for label, rivals in (("better endpoint", ENDPOINTS), ("best HF peer", HF_PEERS)):
            present = [r for r in rivals if r in methods]
            best = prompts.best(present, [pair], benchmarks) if present else None
            row[label] = best or "--"
            _put(row, f"{label} speedup", prompts.speedup(best, [pair], benchmarks) if best else NAN_INTERVAL)
            _put(row, f"gain vs {label} %", prompts.gain("treegraft", present, [pair], benchmarks) if present
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
                _put(row, f"gain vs {label} %", getattr(o, stat))
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
        speedup = _put(row, "speedup", prompts.speedup(method, pairs))
        _put(row, "mean_al", prompts.al(method, pairs))
        _put(row, "call_rate", prompts.call_rate(method, pairs))
        row["n prompts"] = speedup.n
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
            _put(row, "treegraft call rate", prompts.call_rate("treegraft", [pair]))
            present = [r for r in ENDPOINTS if r in methods]
            row["better endpoint"] = (prompts.best(present, [pair]) if present else None) or "--"
            _put(row, "gain vs better endpoint %", prompts.gain("treegraft", present, [pair]) if present
                 else NAN_INTERVAL)
        speedups = {m: _put(row, f"{m} speedup", prompts.speedup(m, [pair]))
                    for m in ("treegraft", "all_small", "all_mid", "fixed") if m in methods}
        if "treegraft" in methods:
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


def small_drafter_table(summary: pd.DataFrame, *, prompts: PromptTable) -> pd.DataFrame:
    """Table 9: per pair, every tree method evaluated with a neural small drafter (``fixed@self_draft``) beside
    the same method with the n-gram one (``fixed``), on the same prompts: speedup, AL, the small drafter's share
    of turn time, and on each neural row the n-gram's gain over it (% , paired CI)."""
    from ..decoding.factory import method_small

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
                speedup = _put(row, "speedup", prompts.speedup(method, [pair]))
                _put(row, "mean AL", prompts.al(method, [pair]))
                share = part.loc[part["method"] == method, "share_small"]
                row["small time share"] = float(share.mean()) if share.notna().any() else float("nan")
                _put(row, "n-gram gain over it %", prompts.gain(base, [method], [pair]) if method != base
                     else NAN_INTERVAL)
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


def _remove(out_dir: Path, name: str, extensions: Sequence[str]) -> None:
    for ext in extensions:
        (Path(out_dir) / f"{name}.{ext}").unlink(missing_ok=True)


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


def make_tables(exp_dir: Path, held_out_pairs: Sequence[str] = (), held_out_benchmarks: Sequence[str] = ("mt_bench",),
                out_dir: Path | None = None, n_resamples: int = DEFAULT_RESAMPLES) -> dict[str, pd.DataFrame]:
    """Every table of the report, each with its 95% CIs (paired bootstrap over prompts, ``n_resamples``
    replicates) and prompt counts; returns those written, by name. A table with no rows (a study the
    experiment did not run) is not written, and a file of that name an earlier run left is removed;
    ``README.md`` indexes what was written and what was not run (:func:`write_index`)."""
    exp_dir = Path(exp_dir)
    out_dir = Path(out_dir or exp_dir / "report")
    records = load_records(exp_dir)
    summary = summarize_records(records)
    prompts = PromptTable(records, n_resamples)
    fit_pairs = [p for p in dict.fromkeys(summary["pair"]) if p not in set(held_out_pairs)]
    fit_benchmarks = [b for b in dict.fromkeys(summary["benchmark"]) if b not in set(held_out_benchmarks)]
    intervals = method_intervals(records, table=prompts)
    tables = {
        "summary": summary_with_intervals(summary, intervals),
        "intervals": intervals,
        "main": main_table(summary, fit_pairs, prompts=prompts),
        "gain": gain_table(summary, prompts=prompts),
        "gain_fit_benchmarks": gain_table(summary, fit_benchmarks, prompts=prompts),
        "ablation": ablation_table(summary, fit_pairs, prompts=prompts),
        "scheduling": scheduling_table(summary, prompts=prompts),
        "held_out": held_out_table(summary, held_out_pairs, held_out_benchmarks, prompts=prompts),
        "sensitivity": sensitivity_table(summary, prompts=prompts),
        "small_drafter": small_drafter_table(summary, prompts=prompts),
        "grafting": grafting_table(records, n_resamples),
    }
    for name, path in (("offline_scheduler", "distill/offline_eval.csv"), ("offline_contrasts", "distill/offline_contrasts.csv"),
                       ("oof", "fit/oof_summary.csv")):
        if (exp_dir / path).exists():
            tables[name] = pd.read_csv(exp_dir / path)
    tables = {name: df for name, df in tables.items() if not df.empty}
    for name in {*TABLES, *STUDIES} - set(tables):  # not run this time: no stale file says otherwise
        _remove(out_dir, name, ("csv", "md", "tex"))
    for name, df in tables.items():
        write_table(df, out_dir, name)
    examples = grafting_examples(records, k=2) if "grafting" in tables else []
    if examples:  # Appendix G's two traced turns, as text
        atomic_write_text("# Traced turns: a branch only non-destructive grafting kept, accepted by the target\n\n"
                          + "\n\n".join(f"```text\n{e}\n```" for e in examples) + "\n", out_dir / "grafting_examples.md")
    else:
        _remove(out_dir, "grafting_examples", ("md",))
    coverage = _evaluate_coverage(exp_dir)
    if coverage is not None:
        atomic_write_text(coverage + "\n", out_dir / "coverage.txt")
    write_index(out_dir, exp_dir.name)
    return tables


def _evaluate_coverage(exp_dir: Path) -> str | None:
    """The line saying which prompts the evaluation asked for have no record (from ``evaluate/config.yaml``,
    the config the last evaluate job ran with), or None where that config is not there."""
    from omegaconf import OmegaConf

    from .evaluate import evaluate_coverage

    config = Path(exp_dir) / "evaluate" / "config.yaml"
    if not config.exists():
        return None
    cfg = OmegaConf.load(config)
    try:
        return evaluate_coverage(cfg, Path(exp_dir) / "evaluate").line()
    except (KeyError, ValueError, FileNotFoundError, AttributeError) as err:  # a config of older code
        return f"evaluate coverage: not computed ({str(err).splitlines()[0]})"


def headline_metrics(tables: dict[str, pd.DataFrame]) -> dict[str, float]:
    """The report's figures as flat W&B summary metrics, every one with ``_lo`` / ``_hi`` (95% CI) and
    ``_n`` (prompts): each method's mean speedup and AL (main table), each pair's gains, and the gains'
    mean / max / min over pairs (``gain/all_pairs/<stat>_gain_vs_better_endpoint_%``)."""
    out: dict[str, float] = {}

    def put(key: str, row, col: str, n) -> None:
        if col in row and row[col] == row[col]:
            out.update({key: float(row[col]), f"{key}_lo": float(row[f"{col} lo"]), f"{key}_hi": float(row[f"{col} hi"]),
                        f"{key}_n": int(n)})

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


def not_run(tables: dict[str, pd.DataFrame], experiment: str | None = None) -> dict[str, str]:
    """Study name -> one line saying it was not run here and what runs it, for every study of
    :data:`STUDIES` that ``tables`` (the report's tables by name) does not hold."""
    out = {}
    for name, study in STUDIES.items():
        df = tables.get(study.table or name)
        ran = df is not None and not df.empty
        if ran and study.rows:
            column, value = study.rows
            ran = column in df and bool((df[column] == value).any())
        if ran:
            continue
        if experiment in study.experiments:  # this experiment runs it: its records are missing
            how = f"`experiment={experiment}` runs it, but its records are missing: `make evaluate EXPERIMENT={experiment}`"
        elif study.experiments:
            how = "run by " + ", ".join(f"`experiment={e}`" for e in study.experiments)
        else:
            how = f"needs {study.needs}"
        out[name] = f"`{name}` ({study.description}): not run by this experiment; {how}"
    return out


def _read_written(out_dir: Path) -> dict[str, pd.DataFrame]:
    """The tables under ``out_dir`` by name: the report's own first, in :data:`TABLES` / :data:`STUDIES` order."""
    known = {name: i for i, name in enumerate([*TABLES, *STUDIES])}
    tables = {}
    for path in sorted(Path(out_dir).glob("*.csv"), key=lambda p: (known.get(p.stem, len(known)), p.stem)):
        try:
            tables[path.stem] = pd.read_csv(path)
        except pd.errors.EmptyDataError:  # a 1-byte file an older report wrote for a table with no rows
            tables[path.stem] = pd.DataFrame()
    return tables


def _n_prompts(df: pd.DataFrame) -> str:
    col = next((c for c in ("n prompts", "n", "prompts") if c in df), None)
    if col is None or df[col].dropna().empty:
        return "--"
    lo, hi = int(df[col].min()), int(df[col].max())
    return f"{lo}" if lo == hi else f"{lo}-{hi}"


def _across_pairs_lines(gain: pd.DataFrame, label: str) -> list[str]:
    """The index's lines on treegraft's gain vs ``label`` (a rival column of :func:`gain_table`) across pairs."""
    rows = {r["pair"]: r for _, r in gain.iterrows()}
    mean, top, worst = (rows.get(OVER_PAIRS[k]) for k in ("mean", "max", "min"))
    col = f"gain vs {label} %"
    if mean is None or col not in mean or mean[col] != mean[col]:
        return []

    def ci(r) -> str:
        return Interval(r[col], r[f"{col} lo"], r[f"{col} hi"], 0).format("{:+.1f}") + " %"

    def at(r) -> str:
        return str(r[label]).removeprefix("at ")

    lines = [f"- mean over {int(mean['n pairs'])} pair(s): {ci(mean)} (n = {int(mean['n prompts'])} prompts)",
             f"- best pair ({at(top)}): {ci(top)}"]
    if worst[col] < 0:
        low = worst[f"{col} lo"]
        lines.append(f"- worst pair ({at(worst)}): {ci(worst)}: no pair is behind the {label} by more than "
                     f"{-worst[col]:.1f}% (point estimate; " + (f"CI lower end {low:+.1f}%)" if low == low else "no CI)"))
    else:
        lines.append(f"- worst pair ({at(worst)}): {ci(worst)}: ahead of the {label} in every pair (point estimate)")
    return lines


def write_index(out_dir: Path, experiment: str | None = None) -> Path:
    """``README.md`` under ``out_dir`` (atomic), from the files there: every table and figure written (name,
    what it is, n prompts), the gain across pairs, and one line for each study this experiment did not
    run, naming the experiment that runs it. :func:`make_tables` and :func:`make_figures` both rewrite it."""
    out_dir = Path(out_dir)
    tables = _read_written(out_dir)
    tables = {k: v for k, v in tables.items() if not v.empty}
    title = f"# Report: `{experiment}`" if experiment else "# Report"
    lines = [title, "",
             "Rebuilt from the saved artifacts alone (`make tables figures`, `scripts/report.py`, "
             "`notebooks/reproduce.ipynb`). Every interval is a 95% paired bootstrap CI over prompts, resampled "
             "within benchmarks; n = prompts. Each table is here as CSV (numbers, CIs as `lo` / `hi` columns), "
             "Markdown and LaTeX (CIs folded into the cell).", ""]
    coverage = out_dir / "coverage.txt"
    if coverage.exists():  # what the evaluation asked for and has no record of (a sweep's jobs still running)
        lines += ["## Coverage", "", coverage.read_text().strip(), ""]
    for label in ("better endpoint", "best HF peer"):
        across = _across_pairs_lines(tables["gain"], label) if "gain" in tables else []
        if across:
            lines += [f"## treegraft vs the {label}, across pairs", "", *across, ""]
    lines += ["## Tables", ""]
    if tables:
        lines += ["| table | what it is | n prompts |", "|---|---|---|"]
        descriptions = {**TABLES, **{k: v.description for k, v in STUDIES.items()}}
        for name, df in tables.items():
            lines.append(f"| [{name}]({name}.md) | {descriptions.get(name, '--')} | {_n_prompts(df)} |")
        if (out_dir / "grafting_examples.md").exists():
            lines.append("| [grafting_examples](grafting_examples.md) | two traced turns whose accepted path ran "
                         "through a branch only non-destructive grafting kept | -- |")
    else:
        lines.append("No table written yet: `make tables`.")
    figures = [p.stem for p in sorted(out_dir.glob("*.png"))]
    lines += ["", "## Figures", ""]
    if figures:
        lines += ["| figure | what it is |", "|---|---|"]
        lines += [f"| [{name}]({name}.png) ([pdf]({name}.pdf)) | {FIGURES.get(name, '--')} |" for name in figures]
    else:
        lines.append("No figure written yet: `make figures`.")
    if tables:
        lines += ["", "## Not run by this experiment", ""]
        missing = [f"- {line}" for line in not_run(tables, experiment).values()]
        missing += [f"- `{n}` ({TABLES[n]}): no rows (the methods it compares were not evaluated)"
                    for n in TABLES if n not in tables]
        lines += missing or ["Every study of the report was run."]
    path = out_dir / "README.md"
    atomic_write_text("\n".join(lines) + "\n", path)
    return path


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
    for name in set(FIGURES) - {p.stem for p in written}:  # its input is gone: no stale figure says otherwise
        _remove(out_dir, name, ("png", "pdf"))
    write_index(out_dir, exp_dir.name)
    return written


def run_report(cfg, console=None) -> tuple[dict[str, pd.DataFrame], list[Path]]:
    """`make tables` / `make figures` (``scripts/report.py``): the tables (``cfg.tables``) and figures
    (``cfg.figures``) of ``cfg.pipeline.name``, each table and the headline metrics (:func:`headline_metrics`)
    and figures logged by the configured logger; returns (tables, figures)."""
    from .common import print_table
    from .tracking import stage_logger

    exp_dir = stage_dir(cfg.paths.output_dir, cfg.pipeline.name, "report").parent
    log = stage_logger(cfg, "report")
    tables, figures = {}, []
    try:
        if cfg.tables:
            tables = make_tables(exp_dir, list(cfg.pipeline.held_out_pairs or []), list(cfg.pipeline.held_out_benchmarks),
                                 n_resamples=int(cfg.pipeline.bootstrap_resamples))
            for name, df in tables.items():
                if name in PRINTED and console is not None:
                    print_table(fold_intervals(df), f"{name} (95% CIs over prompts)", console)
                log.log_table(name, df)
            log.log_metrics(headline_metrics(tables))
        if cfg.figures:
            figures = make_figures(exp_dir)
            for path in figures:
                if path.suffix == ".png":
                    if console is not None:
                        console.print(f"figure: {path}")
                    log.log_figure(path.stem, path)
    finally:
        log.finish()
    return tables, figures
