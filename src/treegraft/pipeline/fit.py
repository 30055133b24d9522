"""Stage `fit` (the value system): tree-signal subset selection by grouped OOF validation, then the four heads.

Reads the collected rows of the fitting pairs x fitting benchmarks; writes ``value_heads.pt`` +
``value_heads.meta.json`` (the chosen signals and the input order), ``oof_table.csv`` (every
subset scored), ``oof_summary.{csv,md}`` (chosen vs single best vs all candidates vs none) and
``selection.json``.
"""

from __future__ import annotations

import json
import sys

import pandas as pd
from omegaconf import DictConfig, OmegaConf
from rich.console import Console

from ..scheduling.value import MLPConfig, fit_value_system, oof_summary, select_signals
from ..settings import RunSettings
from .artifacts import atomic_write_json, atomic_write_text, record_stage, require, stage_dir, up_to_date
from .collected import load_rows, merge_collect, row_files
from .common import fit_pairs, print_table, to_markdown
from .tracking import stage_logger
from ..devices import now

__all__ = ["run_fit", "mlp_config"]


def mlp_config(node) -> MLPConfig:
    d = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node)
    d["hidden"] = tuple(d.get("hidden", (64, 64)))
    return MLPConfig(**d)


def subsample_turns(rows: pd.DataFrame, max_rows: int | None, seed: int = 0) -> pd.DataFrame:
    """At most ``max_rows`` rows, made of whole turns drawn at random (every report keeps its turns'
    structure, so grouped folds stay valid). ``None`` keeps everything."""
    if not max_rows or len(rows) <= max_rows:
        return rows
    keys = ["report", "question_id", "turn"]
    turns = rows[keys].drop_duplicates().sample(frac=1.0, random_state=seed)
    per_turn = len(rows) / len(turns)
    keep = turns.head(max(1, int(max_rows // per_turn)))
    return rows.merge(keep, on=keys, how="inner")


def run_fit(cfg: DictConfig) -> dict:
    console = Console(width=200, stderr=True)
    settings = RunSettings.of(cfg)
    p, s = cfg.pipeline, cfg.scheduler
    collect_dir = require(stage_dir(cfg.paths.output_dir, p.name, "collect"), "collect", p.name)
    out_dir = stage_dir(cfg.paths.output_dir, p.name, "fit")
    config_yaml = OmegaConf.to_yaml(cfg, resolve=True)
    merge_collect(cfg, collect_dir, console, settings)  # whatever collect shards exist; says which prompts are missing
    inputs = row_files(collect_dir, fit_pairs(cfg), list(p.fit_benchmarks), p.latency_label)
    if not cfg.get("force") and up_to_date(out_dir, config_yaml, inputs, ["value_heads.pt", "selection.json"]):
        console.print(f"fit: {out_dir} is up to date with its config and inputs (force=true to redo)")
        return json.loads((out_dir / "selection.json").read_text())
    start = now()
    rows = load_rows(collect_dir, fit_pairs(cfg), list(p.fit_benchmarks), p.name, p.latency_label, allow_missing=True)
    depth = settings.depth
    console.print(f"fit on {len(rows)} rows, {rows['report'].nunique()} reports, latency label: {p.latency_label}")
    sel_rows = subsample_turns(rows, s.get("selection_max_rows"), int(s.value_mlp.seed))
    if len(sel_rows) < len(rows):
        console.print(f"signal selection on {len(sel_rows)} rows (whole turns sampled; scheduler.selection_max_rows)")
    chosen, table = select_signals(
        sel_rows, depth, list(s.candidates), mlp_config(s.selection_mlp), s.search, int(s.max_exhaustive),
        int(s.folds), progress=lambda msg: print(msg, file=sys.stderr), latency_prior=bool(s.latency_prior),
    )
    summary = oof_summary(table, chosen)
    vs = fit_value_system(rows, depth, chosen, mlp_config(s.value_mlp), latency_prior=bool(s.latency_prior))
    vs.save(out_dir, {"pairs": fit_pairs(cfg), "benchmarks": list(p.fit_benchmarks), "rows": len(rows),
                      "latency_label": p.latency_label})
    atomic_write_text(table.to_csv(index=False), out_dir / "oof_table.csv")
    atomic_write_text(summary.to_csv(index=False), out_dir / "oof_summary.csv")
    atomic_write_text(to_markdown(summary), out_dir / "oof_summary.md")
    info = {"chosen_signals": chosen, "subsets_scored": len(table), "rows": len(rows),
            "reports": int(rows["report"].nunique()), "wall_s": now() - start}
    atomic_write_json(info, out_dir / "selection.json")
    record_stage(out_dir, config_yaml, inputs)
    print_table(summary[["model", "subset", "n_signals", "score", "al_err_call", "lat_err_call", "tau_err_call",
                         "al_err_skip", "lat_err_skip", "tau_err_skip"]], "grouped out-of-fold errors (normalized MAE)", console)
    console.print(f"chosen signals: {chosen} ({len(table)} subsets scored, {info['wall_s']:.1f} s)")
    log = stage_logger(cfg, "fit")
    log.log_metrics({"rows": info["rows"], "subsets_scored": info["subsets_scored"],
                     "n_chosen_signals": len(chosen), "oof_score": float(table["score"].min())})
    log.log_table("oof_summary", summary)
    log.log_table("oof_table", table)
    log.finish()
    return info
