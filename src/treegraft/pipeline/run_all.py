"""The whole pipeline in one process, with one progress bar and an ETA: collect -> fit -> distill ->
evaluate -> tables and figures (`make all`).

The bar counts estimated work (token-forwards of the target, weighted by the target's size), so its
ETA follows the slow units (enumerated turns of a 1.5B pair) and not the count of jobs. Each stage is
the same library call its own entry point makes (``run_collect``, ``run_fit``, ...), with the same
resumability: an interrupted ``make all`` redoes only what is missing. At the end it prints the
wall time of every stage and where the tables and figures are.
"""

from __future__ import annotations

import time
from pathlib import Path

from omegaconf import DictConfig
from rich.console import Console
from tqdm.auto import tqdm

from ..models.loading import resolve_source
from .artifacts import stage_dir
from .collect import pair_settings, run_collect
from .common import pair_spec, print_table
from .distill import run_distill
from .evaluate import eval_pairs, method_prompts, run_evaluate
from .fit import run_fit
from .report import make_figures, make_tables

__all__ = ["run_all", "work_plan"]

ENUMERATION_FACTOR = 6.0  # an enumerated turn costs about this many ordinary turns (62 steps, shared verifications)


def _pair_weight(cfg: DictConfig, pair: str) -> float:
    """Relative cost of one target forward: the target's weight bytes in GB (1 for unknown sources)."""
    try:
        folder = Path(resolve_source(pair_spec(pair).target, cfg.paths.models_dir))
        size = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
        return max(size / 1e9, 0.05) if size else 1.0
    except Exception:  # noqa: BLE001 (a hub id or tiny model: any constant will do for an ETA)
        return 1.0


def work_plan(cfgs: dict[str, DictConfig]) -> dict[str, float]:
    """Estimated work of each stage, in weighted target tokens."""
    c, e = cfgs["collect"], cfgs["evaluate"]
    collect = 0.0
    for pair in c.pipeline.pairs:
        pp = pair_settings(c.pipeline, pair)
        prompts = int(pp.prompts_per_benchmark) * len(c.pipeline.fit_benchmarks)
        share = 1.0 / max(int(pp.enumerate_every), 1)
        collect += _pair_weight(c, pair) * prompts * int(pp.max_new_tokens) * (1 + ENUMERATION_FACTOR * share)
    evaluate = 0.0
    methods = ["ar"] + [m for m in e.evaluation.methods if m != "ar"]
    for pair in eval_pairs(e):
        gens = 0
        for bench in e.evaluation.benchmarks:
            n = int(e.evaluation.prompts_per_benchmark)
            gens += sum(len(method_prompts(e, m, list(range(n)))) for m in methods)
        evaluate += _pair_weight(e, pair) * gens * int(e.evaluation.max_new_tokens)
    small = 0.02 * (collect + evaluate) + 1.0  # fit, distill, report: minutes, no model
    return {"collect": collect, "fit": small, "distill": small, "evaluate": evaluate, "report": small / 2}


def run_all(cfgs: dict[str, DictConfig]) -> dict[str, float]:
    """Run every stage with the composed config of its entry point (``cfgs[stage]``); returns wall seconds
    per stage."""
    console = Console(width=200, stderr=True)
    plan = work_plan(cfgs)
    total = sum(plan.values())
    bar = tqdm(total=round(total), desc=f"make all ({cfgs['collect'].pipeline.name})", unit="work", file=console.file,
               bar_format="{l_bar}{bar}| {percentage:3.0f}% [{elapsed}<{remaining}]")
    walls: dict[str, float] = {}

    def stage(name: str, fn) -> None:
        start = time.perf_counter()
        before = bar.n
        fn()
        bar.update(max(0, round(before + plan[name]) - bar.n))  # whatever the estimate left over
        walls[name] = time.perf_counter() - start
        console.print(f"[bold]{name}[/] done in {walls[name] / 60:.1f} min")

    def per_unit(name: str, units: float):
        weight = plan[name] / max(units, 1.0)
        return lambda n=1: bar.update(round(n * weight)) if n else None

    c, e = cfgs["collect"], cfgs["evaluate"]
    collect_units = sum(int(pair_settings(c.pipeline, p).prompts_per_benchmark) * len(c.pipeline.fit_benchmarks)
                        for p in c.pipeline.pairs)
    stage("collect", lambda: run_collect(c, progress=per_unit("collect", collect_units)))
    stage("fit", lambda: run_fit(cfgs["fit"]))
    stage("distill", lambda: run_distill(cfgs["distill"]))
    methods = ["ar"] + [m for m in e.evaluation.methods if m != "ar"]
    n = int(e.evaluation.prompts_per_benchmark)
    eval_units = len(eval_pairs(e)) * len(e.evaluation.benchmarks) * sum(
        len(method_prompts(e, m, list(range(n)))) for m in methods)
    stage("evaluate", lambda: run_evaluate(e, progress=per_unit("evaluate", eval_units)))
    exp_dir = stage_dir(e.paths.output_dir, e.pipeline.name, "report").parent
    written: list[Path] = []

    def report() -> None:
        tables = make_tables(exp_dir, list(e.pipeline.held_out_pairs or []), list(e.pipeline.held_out_benchmarks))
        for name in ("main", "gain"):
            if name in tables and not tables[name].empty:
                print_table(tables[name], name, console)
        written.extend(make_figures(exp_dir))

    stage("report", report)
    bar.close()
    console.print("wall time per stage: " + ", ".join(f"{k} {v / 60:.1f} min" for k, v in walls.items())
                  + f"; total {sum(walls.values()) / 60:.1f} min")
    console.print(f"tables (CSV, Markdown, LaTeX) and figures (PNG, PDF): {exp_dir / 'report'}")
    console.print(f"evaluation records: {exp_dir / 'evaluate'}; offline scheduler table: {exp_dir / 'distill'}")
    return walls

