"""The whole pipeline in one process, with one progress bar and an ETA: collect -> fit -> distill ->
evaluate -> tables and figures (`make all`).

The bar counts estimated work (token-forwards of the target, weighted by the target's size), so its
ETA follows the slow units (enumerated turns of a 1.5B pair) and not the count of jobs. Each stage is
the same library call its own entry point makes (``run_collect``, ``run_fit``, ...), with the same
resumability: an interrupted ``make all`` redoes only what is missing. At the end it prints the
wall time of every stage and where the tables and figures are.

With ``pipeline.time_budget_min`` (the ``cpu`` experiment sets it), the run is sized to the machine
before it starts (:func:`size_to_budget`): it measures the main pair's one-token target step on this
CPU and evaluates the most prompts per benchmark, down to ``pipeline.min_prompts_per_benchmark``, whose
predicted wall time fits the budget (collect keeps its count), so a slower CPU evaluates fewer prompts
in about the same time.
"""

from __future__ import annotations

import time
from pathlib import Path

from omegaconf import DictConfig
from rich.console import Console
from tqdm.auto import tqdm

from ..machine import cpu_line
from ..models.loading import load_model, resolve_source, runtime_choice
from ..models.runtime import curve_at, effective_runtime, forward_curve
from .artifacts import stage_dir
from .collect import pair_settings, run_collect
from .common import fold_intervals, pair_spec, print_table
from .distill import run_distill
from .evaluate import eval_pairs, method_prompts, run_evaluate
from .fit import run_fit
from .parallel import one_thread_if_forking
from .report import make_figures, make_tables

__all__ = ["run_all", "work_plan", "predicted_minutes", "size_to_budget", "step_seconds"]

ENUMERATION_FACTOR = 6.0  # an enumerated turn costs about this many ordinary turns (62 steps, shared verifications)
# Wall seconds of the stages per unit of :func:`work_plan` and per second of the main target's one-token
# step as :func:`step_seconds` measures it before the run, from fresh-clone runs of `make all` with two
# workers on the Zen 4 EPYC (docs/results/amd-epyc-zen4.md): 0.083 (2 + 2 prompts, step 0.208 s, 35.2 min
# of stages) and 0.063 (4 + 2, step 0.250 s, 37.6 min). The larger, so that a prediction errs long. (The
# Zen 5 run's 33.5 min at 4 + 4 and a t(1) of ~0.10 s gives ~0.086 too.)
SECONDS_PER_UNIT_STEP = 0.085
SETUP_MINUTES = 8.5  # .venv, model packages and conversions before the first stage (Zen 4: 8.1 and 8.9 min)


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


def predicted_minutes(cfgs: dict[str, DictConfig], step_s: float) -> float:
    """Predicted wall minutes of ``make all`` (setup included) when the main target's one-token step takes
    ``step_s`` seconds."""
    return SETUP_MINUTES + SECONDS_PER_UNIT_STEP * step_s * sum(work_plan(cfgs).values()) / 60


def size_to_budget(cfgs: dict[str, DictConfig], budget_min: float, step_s: float,
                   low: int) -> tuple[int, int, float]:
    """(collect prompts, evaluate prompts, predicted minutes) per benchmark: the most evaluation prompts,
    from the configured count down to ``low``, whose predicted time fits ``budget_min`` (``low`` when none
    does). Collect keeps its configured count: evaluation is most of the time and fewer evaluation
    prompts only widen the tables' noise, while fewer collected turns break the scheduler (with 2
    collected prompts per benchmark, ~63 turns, the distilled scheduler fell to 66-67% of the oracle
    offline on the Zen 4 EPYC, below a random policy, against 82-84% with 4). Sets evaluate's count in
    ``cfgs``, the only stage that reads it."""
    collect = int(cfgs["collect"].pipeline.prompts_per_benchmark)
    high = int(cfgs["evaluate"].evaluation.prompts_per_benchmark)
    if low < 1 or low > high:
        raise ValueError(f"pipeline.min_prompts_per_benchmark must be in [1, {high}] (the configured evaluation "
                         f"prompts), got {low}")
    for n in range(high, low - 1, -1):
        cfgs["evaluate"].evaluation.prompts_per_benchmark = n
        minutes = predicted_minutes(cfgs, step_s)
        if minutes <= budget_min:
            break
    return collect, n, minutes


def step_seconds(cfg: DictConfig, log=print) -> float:
    """Seconds of one target step (one token on a 256-token cache, LM head included) of the first pair,
    on the runtime the stages will use, one thread per worker as they run: ``runtime=auto``'s cached (or
    now measured) curve, else one measurement."""
    spec = pair_spec(cfg.pipeline.pairs[0])
    runtime = effective_runtime(cfg.runtime, cfg.pipeline.dtype)
    device = cfg.pipeline.device
    with one_thread_if_forking(cfg.pipeline.get("workers", 1)):
        if runtime == "auto":
            choice = runtime_choice(spec.target, device, cfg.paths.models_dir, cfg.paths.cache_dir, log)
            if choice.curves:
                return curve_at(choice.curves[choice.runtime], 1)
            runtime = choice.runtime
        model = load_model(spec.target, device=device, models_dir=cfg.paths.models_dir, runtime=runtime)
        return forward_curve(model, sizes=(1,))[1]


def run_all(cfgs: dict[str, DictConfig]) -> dict[str, float]:
    """Run every stage with the composed config of its entry point (``cfgs[stage]``); returns wall seconds
    per stage."""
    console = Console(width=200, stderr=True)
    p = cfgs["collect"].pipeline
    if p.get("time_budget_min"):
        step_s = step_seconds(cfgs["collect"], console.print)
        n_collect, n_eval, minutes = size_to_budget(cfgs, float(p.time_budget_min), step_s,
                                                    int(p.get("min_prompts_per_benchmark") or 1))
        with one_thread_if_forking(p.get("workers", 1)):  # the CPU line the step was measured under
            line = cpu_line()
        console.print(f"sized to {p.time_budget_min:g} min on {line}: target step {1000 * step_s:.0f} ms -> "
                      f"{n_collect} prompts per benchmark in collect, {n_eval} in evaluate (predicted {minutes:.0f} min"
                      + (", over the budget even at the fewest prompts)" if minutes > float(p.time_budget_min) else ")"))
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

