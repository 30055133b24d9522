"""The whole pipeline in one process, with one progress bar and an ETA: collect -> fit -> distill ->
evaluate -> tables and figures (`make all`).

The bar counts estimated work (token-forwards of the target, weighted by the target's size), so its
ETA follows the slow units (enumerated turns of a 1.5B pair) and not the count of jobs. Each stage is
the same library call its own entry point makes (``run_collect``, ``run_fit``, ...), with the same
resumability: an interrupted ``make all`` redoes only what is missing. At the end it prints the
wall time of every stage and where the tables and figures are.

With ``pipeline.time_budget_min`` (the ``cpu`` experiment sets it) and an evaluation sized by
precision (``evaluation.target_half_width``), evaluate gets the minutes the earlier stages left
(:func:`evaluate_budget_min`): it adds rounds of prompts until the headline CI is narrow enough or the
next round would not fit, so a slower CPU evaluates fewer prompts in about the same time and the
tables say how wide its CIs came out.
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, open_dict
from rich.console import Console
from tqdm.auto import tqdm

from ..machine import cpu_line
from ..models.loading import resolve_source
from .artifacts import stage_dir
from .collect import run_collect
from .collected import pair_settings
from .common import fold_intervals, pair_spec, print_table
from .distill import run_distill
from .evaluate import most_prompts_per_benchmark, run_evaluate
from .evaluate_scope import eval_pairs, evaluated_methods, method_prompts
from .fit import run_fit
from .parallel import one_thread_if_forking
from .report import make_figures, make_tables
from ..devices import now

__all__ = ["run_all", "work_plan", "evaluate_budget_min", "auto_experiment", "AUTO_EXPERIMENTS"]

# `make all`'s default (experiment=auto): the cpu experiment on the engine whose step is faster here
AUTO_EXPERIMENTS = {"torch": "cpu", "llama_cpp": "cpu_llama"}

ENUMERATION_FACTOR = 6.0  # an enumerated turn costs about this many ordinary turns (62 steps, shared verifications)
SETUP_MINUTES = 8.5  # .venv, model packages and conversions before run_all starts (Zen 4: 8.1 and 8.9 min)
REPORT_MINUTES = 1.0  # tables, figures and the bootstrap after evaluate


def evaluate_budget_min(budget_min: float, elapsed_min: float) -> float:
    """Minutes left to evaluate of a ``make all`` budget once ``elapsed_min`` went to the stages before
    it (setup, which ran before this process, counted as ``SETUP_MINUTES``); at least one."""
    return max(1.0, float(budget_min) - SETUP_MINUTES - float(elapsed_min) - REPORT_MINUTES)


def _pair_weight(cfg: DictConfig, pair: str) -> float:
    """Relative cost of one target forward: the target's weight bytes in GB (1 for unknown sources)."""
    try:
        folder = Path(resolve_source(pair_spec(pair).target, cfg.paths.models_dir))
        size = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
        return max(size / 1e9, 0.05) if size else 1.0
    except Exception:  # noqa: BLE001 (a hub id or tiny model: any constant will do for an ETA)
        return 1.0


def _generations_per_pair(e: DictConfig) -> int:
    """The (prompt, method) generations evaluate may run for one pair over every benchmark: the bar plans for the
    most prompts its precision rounds may reach and jumps to the stage's end where the CI or the time budget stops
    them sooner (planning only the first round left it at 97-100% through every later round)."""
    n = most_prompts_per_benchmark(e)
    per_benchmark = sum(len(method_prompts(e, m, list(range(n)))) for m in evaluated_methods(e))
    return len(e.evaluation.benchmarks) * per_benchmark


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
    for pair in eval_pairs(e):
        evaluate += _pair_weight(e, pair) * _generations_per_pair(e) * int(e.evaluation.max_new_tokens)
    small = 0.02 * (collect + evaluate) + 1.0  # fit, distill, report: minutes, no model
    return {"collect": collect, "fit": small, "distill": small, "evaluate": evaluate, "report": small / 2}


def run_all(cfgs: dict[str, DictConfig]) -> dict[str, float]:
    """Run every stage with the composed config of its entry point (``cfgs[stage]``); returns wall seconds
    per stage."""
    console = Console(width=200, stderr=True)
    p = cfgs["collect"].pipeline
    with one_thread_if_forking(p.get("workers", 1)):  # the CPU line the workers run under
        console.print(f"make all ({p.name}) on {cpu_line()}")
    plan = work_plan(cfgs)
    total = sum(plan.values())
    bar = tqdm(total=round(total), desc=f"make all ({cfgs['collect'].pipeline.name})", unit="work", file=console.file,
               bar_format="{l_bar}{bar}| {percentage:3.0f}% [{elapsed}<{remaining}]")
    walls: dict[str, float] = {}

    def stage(name: str, fn) -> None:
        start = now()
        before = bar.n
        fn()
        bar.update(max(0, round(before + plan[name]) - bar.n))  # whatever the estimate left over
        walls[name] = now() - start
        console.print(f"[bold]{name}[/] done in {walls[name] / 60:.1f} min")

    def per_unit(name: str, units: float):
        weight = plan[name] / max(units, 1.0)

        def advance(n=1) -> None:
            if not n:
                return
            step = round(n * weight)
            if bar.n + step >= bar.total:  # more work than planned (a mis-estimate): stretch the bar
                bar.total = round((bar.n + step) / 0.97) + 1
            bar.update(step)

        return advance

    c, e = cfgs["collect"], cfgs["evaluate"]
    collect_units = sum(int(pair_settings(c.pipeline, p).prompts_per_benchmark) * len(c.pipeline.fit_benchmarks)
                        for p in c.pipeline.pairs)
    stage("collect", lambda: run_collect(c, progress=per_unit("collect", collect_units)))
    stage("fit", lambda: run_fit(cfgs["fit"]))
    stage("distill", lambda: run_distill(cfgs["distill"]))
    eval_units = len(eval_pairs(e)) * _generations_per_pair(e)
    if p.get("time_budget_min") and e.evaluation.get("target_half_width") is not None:
        minutes = evaluate_budget_min(float(p.time_budget_min), sum(walls.values()) / 60)
        with open_dict(e):
            e.evaluation.time_budget_min = minutes
        console.print(f"evaluate: {minutes:.0f} of the {p.time_budget_min:g}-min budget left; rounds of "
                      f"{e.evaluation.round_prompts} prompt(s) per benchmark from {e.evaluation.prompts_per_benchmark} until the "
                      f"headline CI half-width is at most {e.evaluation.target_half_width:g}x (the bar plans for "
                      f"{most_prompts_per_benchmark(e)} a benchmark, the most it may run, and jumps ahead where it stops sooner)")
    stage("evaluate", lambda: run_evaluate(e, progress=per_unit("evaluate", eval_units)))
    exp_dir = stage_dir(e.paths.output_dir, e.pipeline.name, "report").parent
    written: list[Path] = []

    def report() -> None:
        tables = make_tables(exp_dir, list(e.pipeline.held_out_pairs or []), list(e.pipeline.held_out_benchmarks),
                             n_resamples=int(e.pipeline.bootstrap_resamples))
        for name in ("main", "gain", "offline_contrasts"):
            if name in tables and not tables[name].empty:
                print_table(fold_intervals(tables[name]), f"{name} (95% CIs over prompts)", console)
        written.extend(make_figures(exp_dir))

    stage("report", report)
    bar.close()
    console.print("wall time per stage: " + ", ".join(f"{k} {v / 60:.1f} min" for k, v in walls.items())
                  + f"; total {sum(walls.values()) / 60:.1f} min")
    console.print(f"tables (CSV, Markdown, LaTeX) and figures (PNG, PDF): {exp_dir / 'report'}")
    console.print(f"evaluation records: {exp_dir / 'evaluate'}; offline scheduler table: {exp_dir / 'distill'}")
    return walls



def auto_experiment(cfg: DictConfig, log=print) -> tuple[str, dict]:
    """``experiment=auto``: ``cpu`` or ``cpu_llama``, whichever engine's one-token step of the main pair
    is faster on this machine (:func:`treegraft.front.choose_engine`; ``cfg`` is the composed
    `collect` config of ``experiment=cpu``). Returns the experiment and the measured choice."""
    from ..front import choose_engine

    choice = choose_engine(pair_spec(cfg.pipeline.pairs[0]), cfg, str(cfg.pipeline.device), cfg.pipeline.dtype, log)
    return AUTO_EXPERIMENTS[choice["engine"]], choice
