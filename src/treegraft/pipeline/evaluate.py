"""Stage `evaluate` (end-to-end decoding): every method on every pair x benchmark, one record per prompt.

For each pair (the fitting pairs and the held-out ones) x benchmark (the six, MT-Bench included)
x method: a warm-up generation (not scored), then the prompts (disjoint from the ones `collect`
used). Records follow the Spec-Bench / FastChat answer layout (``question_id``, ``model_id``,
``choices[0].turns / new_tokens / wall_time / accept_lengths``), so Spec-Bench's speed script can
read them, plus our fields (method, middle calls, time split, tokens, equality with ``ar``).
Every method's output is compared with ``ar``'s; the mismatch counts go into the summary.

Files: ``evaluate/<pair>/<benchmark>/<method>.jsonl`` (atomic, one per method: an interrupted run
redoes at most one method of one benchmark; records are reused only under the same :func:`run_key`,
so a changed config or a refitted scheduler redoes them) and ``evaluate/summary.parquet`` (one row per
pair x benchmark x method), rebuilt from the records alone by :func:`summarize_records`.

This module is the stage driver (the runs, the precision rounds, the near-tie check after the workers,
the summary). Beside it: what a job covers (:mod:`~treegraft.pipeline.evaluate_scope`), the record
files and run keys (:mod:`~treegraft.pipeline.record_files`) and the per-pair work with its workers
(:mod:`~treegraft.pipeline.evaluate_worker`); their names are importable from here too.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd
import torch
from omegaconf import DictConfig, OmegaConf, open_dict
from rich.console import Console

from ..decoding.sampling import SamplingConfig
from ..devices import devices_of, now, reset_peak_memory
from ..front import engines_of, load_engine_pair
from ..models import load_model
from ..models.runtime.memory import return_freed_memory
from ..settings import RunSettings
from ..stats import Interval
from .artifacts import atomic_write_json, atomic_write_parquet, record_stage, stage_dir
from .common import fold_intervals, pair_spec, print_table
from .equality import compare_outputs
from .estimates import PromptTable, method_intervals
from .evaluate_scope import (eval_pairs, evaluate_benchmarks, evaluate_coverage, evaluated_methods, evaluation_offset,
                             evaluation_units, method_prompts, rotated_order)
from .evaluate_worker import PairJob, learned_schedulers, record_gpu_peak, run_on_gpu, run_worker
from .parallel import fork_pull, one_thread_with_workers, spawn_pull
from .record_files import method_files, run_key, write_records
from .records import make_record, read_records, summarize_records
from .shards import shard_from
from .stage_jobs import gpu_groups, print_job, progress_to
from .tracking import stage_logger

__all__ = ["run_evaluate", "explain_mismatches", "near_tie_placement", "size_by_precision", "most_prompts_per_benchmark",
           "main_interval",
           # re-exported from the modules the stage was split into
           "evaluated_methods", "make_record", "summarize_records", "read_records", "eval_pairs", "run_key",
           "method_prompts", "evaluation_units", "evaluate_coverage", "evaluate_benchmarks", "evaluation_offset",
           "method_files", "rotated_order"]


@one_thread_with_workers
def run_evaluate(cfg: DictConfig, progress=None) -> pd.DataFrame:
    """Every method on every pair x benchmark, then the summary with CIs; sized by precision when
    ``evaluation.target_half_width`` is set (:func:`size_by_precision`). ``progress(n)``: advance an outer
    progress bar by n (prompt, method) generations (else one bar here)."""
    console = Console(width=200, stderr=True)
    settings = RunSettings.of(cfg)
    p = cfg.pipeline
    out_dir = stage_dir(cfg.paths.output_dir, p.name, "evaluate")
    if cfg.evaluation.get("target_half_width") is not None:
        if not shard_from(cfg).whole:
            raise ValueError(f"evaluation.target_half_width={cfg.evaluation.target_half_width} sizes the evaluation by "
                             f"its headline CI, which one prompt range cannot see; shard.count={cfg.shard.count} expects "
                             "evaluation.target_half_width=null (a fixed evaluation.prompts_per_benchmark)")
        size_by_precision(cfg, progress, console, settings)
    else:
        _evaluate_prompts(cfg, settings, progress)
    return _summarize(cfg, out_dir, console)


def _evaluate_prompts(cfg: DictConfig, settings: RunSettings, progress=None) -> None:
    """Run whatever (prompt, method) generations the config asks for and no saved record holds."""
    console = Console(width=200, stderr=True)
    p, e = cfg.pipeline, cfg.evaluation
    out_dir = stage_dir(cfg.paths.output_dir, p.name, "evaluate")
    # the learned methods' fit/distill artifacts: this experiment's, or evaluation.scheduler_from's
    artifacts = stage_dir(cfg.paths.output_dir, e.get("scheduler_from") or p.name, "distill").parent
    sampling = SamplingConfig(temperature=float(e.temperature), top_p=float(e.top_p), seed=int(e.seed))
    methods = evaluated_methods(cfg)
    benchmarks = evaluate_benchmarks(cfg)
    offset = evaluation_offset(cfg)
    shard = shard_from(cfg)
    schedulers = learned_schedulers(methods, artifacts)
    print_job(console, "evaluate", cfg, eval_pairs(cfg), benchmarks, shard)
    for pair_name in eval_pairs(cfg):
        job = PairJob.of(cfg, settings, pair_name, benchmarks, methods, shard, offset, out_dir, artifacts, sampling)
        spec = pair_spec(pair_name)
        files = sorted(set(job.paths.values()))
        todo = job.todo()
        if not todo:
            console.print(f"{pair_name}: every record is saved and up to date")
            explain_mismatches(cfg, spec, files, console)  # any an interruption left pending
            continue
        cost = [job.cost(b) for b in todo]
        groups = gpu_groups(p)  # one spawned worker per GPU (group), each loading its own pair
        if groups is not None:
            groups = groups[: len(todo)]
            workers = len(groups)
        else:
            pair = load_engine_pair(spec, cfg, log=console.print, device=p.device, dtype=p.dtype)
            workers = min(engines_of(pair).workers(p.workers), len(todo))
        total = sum(job.units(b) for b in todo)
        with progress_to(progress, total, f"evaluate {pair_name} ({workers} worker(s))") as advance:
            if groups is not None:
                context = (OmegaConf.to_container(cfg, resolve=True), settings, job, todo)
                spawn_pull(run_on_gpu, [context] * workers, groups, todo, cost, advance)
            else:
                reset_peak_memory(devices_of(pair.target, pair.middle))
                fork_pull(lambda pull, report: run_worker(cfg, settings, pair, job, todo, pull, schedulers, report),
                          todo, cost, workers, advance)
                record_gpu_peak(pair, out_dir / pair_name, console)
                del pair
        return_freed_memory()
        explain_mismatches(cfg, spec, files, console)


def main_interval(cfg: DictConfig, out_dir: Path) -> tuple[str, str, Interval]:
    """(pair, method, CI) of the headline figure the evaluation is sized by: the first evaluated pair's
    mean speedup over the benchmarks of ``treegraft`` (else the first method after ``ar``)."""
    pair = eval_pairs(cfg)[0]
    records = read_records(out_dir)
    records = records[records["pair"] == pair]
    methods = [m for m in evaluated_methods(cfg) if m != "ar"]
    method = "treegraft" if "treegraft" in methods else methods[0]
    return pair, method, PromptTable(records, int(cfg.pipeline.bootstrap_resamples)).speedup(method, [pair])


# a percentile bootstrap over 1-2 prompts a benchmark has 1-3 distinct values per stratum: its CI is too
# narrow to stop on
MIN_PROMPTS_FOR_CI = 3


def most_prompts_per_benchmark(cfg: DictConfig) -> int:
    """The most prompts per benchmark evaluate may run: sized by precision (``evaluation.target_half_width``), up to
    ``max_prompts_per_benchmark`` (:func:`size_by_precision`); otherwise ``prompts_per_benchmark``."""
    e = cfg.evaluation
    n = int(e.prompts_per_benchmark)
    if e.get("target_half_width") is not None:
        n = max(n, int(e.get("max_prompts_per_benchmark") or n))
    return n


def size_by_precision(cfg: DictConfig, progress, console, settings: RunSettings | None = None) -> dict:
    """Evaluate in rounds: ``evaluation.prompts_per_benchmark`` prompts per benchmark first, then
    ``round_prompts`` more a round (records of earlier rounds are kept), until the headline CI's
    half-width (:func:`main_interval`) is at most ``target_half_width`` (with at least
    ``MIN_PROMPTS_FOR_CI`` and ``min_prompts_per_benchmark`` prompts per benchmark), or ``max_prompts_per_benchmark``
    is reached, or the next round would end past ``time_budget_min`` (predicted from the last round's
    seconds per prompt). Returns what it reached, also written to ``evaluate/precision.json``."""
    settings = RunSettings.of(settings or cfg)
    e = cfg.evaluation
    out_dir = stage_dir(cfg.paths.output_dir, cfg.pipeline.name, "evaluate")
    target = float(e.target_half_width)
    n = int(e.prompts_per_benchmark)
    top = most_prompts_per_benchmark(cfg)
    step = max(1, int(e.get("round_prompts") or 2))
    least = max(MIN_PROMPTS_FOR_CI, int(e.get("min_prompts_per_benchmark") or 0))
    budget_s = 60 * float(e.time_budget_min) if e.get("time_budget_min") else math.inf
    start, done, rounds = now(), 0, []
    while True:
        t0 = now()
        with open_dict(cfg):
            cfg.evaluation.prompts_per_benchmark = n
        _evaluate_prompts(cfg, settings, progress)
        pair, method, ci = main_interval(cfg, out_dir)
        rounds.append({"prompts_per_benchmark": n, "n": ci.n, "value": ci.value, "low": ci.low, "high": ci.high,
                       "half_width": ci.half_width, "seconds": now() - t0})
        console.print(f"precision: {n} prompts per benchmark -> {pair} {method} mean speedup {ci} (n = {ci.n}), "
                      f"half-width {ci.half_width:.3f} (target {target:g})")
        per_prompt = rounds[-1]["seconds"] / max(n - done, 1)
        done, nxt = n, min(top, n + step)
        if (ci.half_width <= target and n >= least) or n >= top:
            break
        if now() - start + per_prompt * (nxt - n) > budget_s:
            console.print(f"precision: stopping at {n} prompts per benchmark: another round would end past the "
                          f"{e.time_budget_min:g}-min budget")
            break
        n = nxt
    info = {"pair": pair, "method": method, "target_half_width": target, "reached_half_width": ci.half_width,
            "prompts_per_benchmark": n, "met": bool(ci.half_width <= target), "rounds": rounds}
    atomic_write_json(info, out_dir / "precision.json")
    return info

def near_tie_placement(cfg: DictConfig, spec) -> tuple[dict | None, str | None]:
    """Where the float32 copy of ``spec``'s target for the near-tie check goes: ``(load_model keyword
    arguments, None)``, or ``(None, reason)`` when it fits nowhere it may go. Whole on the stage's device
    where its weights (and a ``kv_tokens`` cache) fit the free memory there; else split by accelerate over
    every GPU and the host's available memory, and the disk where ``placement.offload_folder`` is set;
    never a copy that does not fit (a Qwen3-32B in float32 is 131 GB)."""
    from ..models.loading import placement_from
    from ..models.placement import Placement, available_bytes, kv_cache_bytes, model_bytes, model_config

    device = torch.device(cfg.pipeline.device)
    placement = placement_from(cfg.get("placement"))
    tokens = int((cfg.get("placement") or {}).get("kv_tokens", None) or 4096)
    config = model_config(spec.target, cfg.paths.models_dir)
    need = int(1.1 * (model_bytes(config, torch.float32) + kv_cache_bytes(config, tokens, torch.float32)))
    whole, _ = available_bytes(Placement(None), device)
    if need <= whole:
        return {"device": device}, None
    memory, where = {}, []
    if device.type == "cuda":
        for i in range(torch.cuda.device_count()):
            memory[i] = int(0.9 * torch.cuda.mem_get_info(i)[0])
        where.append(f"{len(memory)} GPU(s) {sum(memory.values()) / 1e9:.1f} GB free")
    host, _ = available_bytes(Placement(None), "cpu")
    memory["cpu"] = int(0.8 * host)
    where.append(f"host {memory['cpu'] / 1e9:.1f} GB")
    if placement.offload_folder:
        return {"device": device, "device_map": "auto", "max_memory": memory,
                "offload_folder": str(placement.offload_folder)}, None
    if need <= sum(memory.values()):
        return {"device": device, "device_map": "auto", "max_memory": memory}, None
    return None, (f"a float32 copy of {spec.target} needs {need / 1e9:.1f} GB, {' + '.join(where)} available "
                  "(set placement.offload_folder to offload it to disk)")


def explain_mismatches(cfg: DictConfig, spec, paths: list[Path], console=None) -> int:
    """Decide, for every greedy output that differs from ``ar``'s and is marked pending
    (``mismatch_explained`` None: a lossy runtime such as bfloat16), whether a float32 near-tie explains
    its first difference; rewrites those record files and returns how many it decided.

    It runs after a pair's workers are done, in this process, with one float32 copy of the target loaded
    only when something is pending: loaded by each worker at its first mismatch, that copy put 6 GB of
    checkpoint pages into every worker's resident set (18.9 GB at the peak on the 1.5B pair) and took
    seconds of CPU in the middle of the other worker's timed generations. The copy goes where it fits
    (:func:`near_tie_placement`); where it fits nowhere, each pending record is marked ``mismatch_check:
    "unchecked: <reason>"`` (counted as unchecked in the summary, not retried) and nothing is loaded."""
    pending: dict[Path, list[dict]] = {}
    for path in paths:
        if path.exists() and path.name != "ar.jsonl":
            records = [json.loads(line) for line in path.read_text().splitlines()]
            if any(_pending(r) for r in records):
                pending[path] = records
    if not pending:
        return 0
    where, why = near_tie_placement(cfg, spec)
    if where is None:
        for path, records in pending.items():
            for r in records:
                if _pending(r):
                    r["mismatch_check"] = f"unchecked: {why}"
            write_records(records, path)
        if console is not None:
            console.print(f"{spec.name}: outputs that differ from ar left unchecked: {why}")
        return 0
    target = load_model(spec.target, "float32", models_dir=cfg.paths.models_dir, **where)
    decided = 0
    references: dict[Path, dict] = {}  # benchmark folder -> ar's records by question id, read once
    for path, records in pending.items():
        if path.parent not in references:  # ar's records of every prompt range
            references[path.parent] = {r["question_id"]: r for f in method_files(path.parent, "ar")
                                       for r in map(json.loads, f.read_text().splitlines())}
        reference = references[path.parent]
        for r in records:
            ref = reference.get(r["question_id"])
            if not _pending(r) or ref is None:
                continue
            rep = compare_outputs(ref["tokens"], r["tokens"], r["prompt_ids"], target, float(cfg.evaluation.tie_tolerance))
            r["matches_ar"], r["mismatch_explained"] = rep.equal, rep.explained_by_tie
            r["mismatch_position"], r["mismatch_top2_gap"] = rep.position, rep.top2_gap
            decided += 1
        write_records(records, path)
    del target
    return_freed_memory()
    if console is not None:
        console.print(f"{spec.name}: {decided} output(s) that differ from ar checked for a float32 near-tie")
    return decided


def _pending(record: dict) -> bool:
    """A greedy output that differs from ``ar``'s and waits for the near-tie check."""
    return (record.get("matches_ar") is False and record.get("mismatch_explained") is None
            and "mismatch_check" not in record)

def _summarize(cfg: DictConfig, out_dir: Path, console) -> pd.DataFrame:
    p = cfg.pipeline
    # the summary covers every record in the folder, so the jobs of a sweep aggregate into one table
    records = read_records(out_dir)
    summary = summarize_records(records)
    atomic_write_parquet(summary, out_dir / "summary.parquet")
    intervals = method_intervals(records, int(p.bootstrap_resamples))
    atomic_write_parquet(intervals, out_dir / "intervals.parquet")
    record_stage(out_dir, OmegaConf.to_yaml(cfg, resolve=True), [])
    coverage = evaluate_coverage(cfg, out_dir)  # the other prompt ranges of a sweep: done yet?
    coverage.write(out_dir / "coverage.json")
    console.print(coverage.line())
    show = summary[["pair", "benchmark", "method", "tokens_per_s", "mismatches", "mismatches_unexplained"]].merge(
        intervals[["pair", "benchmark", "method", "speedup", "speedup_lo", "speedup_hi", "al", "al_lo", "al_hi",
                   "call_rate", "n"]], on=["pair", "benchmark", "method"])
    print_table(fold_intervals(show), f"evaluate ({p.name}): 95% CIs over prompts", console)
    mean = intervals[intervals["benchmark"] == "mean"]
    print_table(fold_intervals(mean.drop(columns="benchmark")), f"evaluate ({p.name}): mean over benchmarks", console)
    log = stage_logger(cfg, "evaluate")
    metrics = {"mismatches": int(summary["mismatches"].sum()),
               "mismatches_unexplained": int(summary["mismatches_unexplained"].sum())}
    for _, r in mean.iterrows():
        for name in ("speedup", "al"):
            key = f"{r['pair']}/{r['method']}/{name}"
            metrics.update({key: r[name], f"{key}_lo": r[f"{name}_lo"], f"{key}_hi": r[f"{name}_hi"], f"{key}_n": r["n"]})
    log.log_metrics(metrics)
    log.log_table("evaluate_summary", summary)
    log.log_table("evaluate_intervals", intervals)
    log.finish()
    return summary
