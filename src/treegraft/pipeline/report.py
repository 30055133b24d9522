"""Tables and figures from saved artifacts alone (no model is run): `make tables`, `make figures`.

Inputs: ``evaluate/`` records, ``distill/offline_eval.csv``, ``fit/oof_summary.csv``,
``collect/<pair>/runtime.json`` (the verification curve). Outputs under ``report/``: every table as
CSV + Markdown + LaTeX, every figure as PNG + PDF, and ``README.md``, the index: what was written
(with n) and, for each study this experiment did not run, which experiment runs it (:data:`STUDIES`).
A study that was not run leaves no file (an earlier run's file of that name is removed). The
notebook calls these same functions. This module is the entry (:func:`run_report`, :func:`make_tables`,
:func:`make_figures`) and the index; the tables are built in :mod:`.report_tables`, the figures drawn
in :mod:`.report_figures`.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple, Sequence

import pandas as pd

from ..stats import DEFAULT_RESAMPLES
from .artifacts import MissingArtifactError, atomic_write_text, stage_dir
from .common import fold_intervals, to_markdown
from .estimates import PromptTable, method_intervals
from .grafting import grafting_examples, grafting_table
from .records import read_records, summarize_records
from .report_figures import FIGURES, draw_figures
from .report_tables import (OVER_PAIRS, ablation_table, gain_table, headline_metrics, held_out_table, main_table,
                            row_interval, scheduling_table, sensitivity_table, small_drafter_table,
                            summary_with_intervals)

__all__ = ["load_summary", "load_records", "headline_metrics", "main_table", "gain_table", "ablation_table",
           "scheduling_table", "held_out_table", "sensitivity_table", "small_drafter_table", "write_table",
           "make_tables", "make_figures", "write_index", "not_run", "run_report", "TABLES", "STUDIES", "FIGURES",
           "OVER_PAIRS"]

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


def load_summary(exp_dir: Path) -> pd.DataFrame:
    """The per pair x benchmark x method summary, rebuilt from the evaluation records."""
    return summarize_records(load_records(exp_dir))


def load_records(exp_dir: Path) -> pd.DataFrame:
    """Every evaluation record (one row per prompt x method) of an experiment."""
    eval_dir = Path(exp_dir) / "evaluate"
    if not eval_dir.exists():
        raise MissingArtifactError(f"missing {eval_dir}: run the `evaluate` stage first (make evaluate)")
    return read_records(eval_dir)


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

    from .evaluate_scope import evaluate_coverage

    config = Path(exp_dir) / "evaluate" / "config.yaml"
    if not config.exists():
        return None
    cfg = OmegaConf.load(config)
    try:
        return evaluate_coverage(cfg, Path(exp_dir) / "evaluate").line()
    except (KeyError, ValueError, FileNotFoundError, AttributeError) as err:  # a config of older code
        return f"evaluate coverage: not computed ({str(err).splitlines()[0]})"


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
        return row_interval(r, col).format("{:+.1f}") + " %"

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


def make_figures(exp_dir: Path, out_dir: Path | None = None) -> list[Path]:
    """Speedup per method per benchmark, AL vs call rate, time split, verification curve, offline comparison
    (:func:`~.report_figures.draw_figures`); a figure whose input is gone is removed, and the index rewritten."""
    exp_dir = Path(exp_dir)
    out_dir = Path(out_dir or exp_dir / "report")
    out_dir.mkdir(parents=True, exist_ok=True)
    written = draw_figures(load_records(exp_dir), exp_dir, out_dir)
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
