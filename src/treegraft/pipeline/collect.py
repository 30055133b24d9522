"""Stage `collect`: exhaustive 2^D schedule enumeration on real prompts, rows to Parquet.

For each pair and fitting benchmark: a warm-up that calls the middle drafter at every step gives the
runtime context (t_tgt, t_mid; not used as data); then each prompt is decoded, and at every sampled
turn all 2^D schedules are enumerated from the same state (``enumerate_turn``) before the turn is
decoded normally. One row per (turn, schedule, step): pre-action state (runtime context, history,
every candidate signal), action, prefix and future suffix, and the schedule's complete-turn AL and
latency split. The group key is ``report`` = ``<pair>/<benchmark>``.

Resumable: each prompt's rows are one Parquet shard ``collect/<pair>/<benchmark>/q<id>.parquet``,
written atomically once the prompt is done; a rerun skips finished shards, so nothing is lost or
duplicated. Per pair, ``cost_model.json`` holds per-call costs fitted by least squares on the
measured latencies (``latency_label=cost_model`` uses them instead of wall times downstream).

Sharded (:mod:`treegraft.pipeline.shards`): a job may be one pair (``pair=``), one fitting benchmark
(``data=``) and one prompt range (``shard.index`` / ``shard.count``); every job, and `fit` and `distill`
before they read the rows, merges what is on disk (:func:`merge_collect`: the cost models and the summary
from every shard present, ``coverage.json`` saying which prompts are still missing). Held-out pairs are
never collected.

This module is the stage driver. Beside it: the rows of an enumerated prompt
(:mod:`~treegraft.pipeline.collect_rows`), the cost model (:mod:`~treegraft.pipeline.cost_model`), and the
job's scope, the shards on disk and the merge (:mod:`~treegraft.pipeline.collected`); their names are
importable from here too.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
from omegaconf import OmegaConf
from rich.console import Console

from ..devices import devices_of
from ..front import decoder_for, engines_of, load_engine_pair
from ..machine import machine_info
from ..models import load_tokenizer
from ..models.runtime.memory import return_freed_memory
from ..settings import RunSettings
from .artifacts import atomic_write_json, atomic_write_parquet, record_stage, stage_dir
from .collect_rows import collect_summary, decode_with_enumeration, enumeration_rows, run_prompt
from .collected import (PAIR_SETTINGS, collect_benchmarks, collect_coverage, collect_pairs, collect_question_ids,
                        load_rows, merge_collect, pair_is_collected, pair_settings, row_files, shard_path)
from .common import pair_spec, print_table, stage_prompts
from .cost_model import (COST_FEATURES, CURVE_SCALE, apply_cost_model,  # noqa: F401 (re-exported)
                         cost_model_latency, fit_cost_model)
from .parallel import fork_pull, one_thread_with_workers, spawn_pull
from .shards import Shard, shard_from
from .stage_jobs import gpu_groups, print_job, progress_to
from .tracking import stage_logger

__all__ = [
    "run_collect",
    # re-exported from the modules the stage was split into
    "decode_with_enumeration", "enumeration_rows", "run_prompt", "collect_summary",
    "COST_FEATURES", "CURVE_SCALE", "fit_cost_model", "cost_model_latency", "apply_cost_model",
    "PAIR_SETTINGS", "pair_settings", "collect_pairs", "collect_benchmarks", "collect_question_ids", "shard_path",
    "row_files", "load_rows", "collect_coverage", "pair_is_collected", "merge_collect",
]


@one_thread_with_workers
def run_collect(cfg, progress=None) -> pd.DataFrame:
    """The `collect` stage for this job's pairs and benchmarks (every fitting pair x fitting benchmark, or a
    sweep job's ``pair`` / ``data`` / ``shard``), then the merge of every shard on disk
    (:func:`merge_collect`); returns the summary table. ``progress(n)``: advance an outer progress bar by n
    prompts (else one bar per pair here)."""
    console = Console(width=200, stderr=True)
    settings = RunSettings.of(cfg)
    p = cfg.pipeline
    out_dir = stage_dir(cfg.paths.output_dir, p.name, "collect")
    benchmarks, shard = collect_benchmarks(cfg), shard_from(cfg)
    pairs = collect_pairs(cfg)
    print_job(console, "collect", cfg, pairs, benchmarks, shard)
    for pair_name in pairs:
        if pair_is_collected(cfg, out_dir, pair_name, benchmarks, shard):
            console.print(f"{pair_name}: every prompt already collected, skipped (no model loaded)")
        else:
            _collect_pair(cfg, settings, pair_name, out_dir, console, progress, benchmarks, shard)
            return_freed_memory()  # the pair's heap pages, before the next pair or stage loads its own
    # refitted on every run (seconds), so a resumed collect never keeps a model fitted by older code
    df, coverage = merge_collect(cfg, out_dir, console, settings)
    record_stage(out_dir, OmegaConf.to_yaml(cfg, resolve=True),
                 [Path(cfg.paths.benchmarks_dir) / b / "question.jsonl" for b in p.fit_benchmarks])
    if not df.empty:
        print_table(df, f"collect ({p.name}): rows per report", console)
        console.print(f"rows in total: {int(df['rows'].sum())}")
    log = stage_logger(cfg, "collect")
    log.log_metrics({"rows": int(df["rows"].sum()) if not df.empty else 0,
                     "turns": int(df["turns"].sum()) if not df.empty else 0,
                     "prompts_present": coverage.n_present, "prompts_expected": coverage.n_expected})
    log.log_table("collect_summary", df)
    log.finish()
    return df


def _collect_pair(cfg, settings: RunSettings, pair_name: str, collect_dir: Path, console, progress=None,
                  benchmarks=None, shard=None) -> None:
    """Load a pair, measure its runtime context (runtime.json), then decode and enumerate every prompt of
    ``benchmarks`` (``shard``'s range of each) not collected yet, one shard per prompt. On CUDA with
    ``workers`` > 1, one spawned worker per GPU (group) does all of that with a pair of its own
    (:func:`_collect_on_gpus`)."""
    shard = shard or Shard()
    benchmarks = list(benchmarks or cfg.pipeline.fit_benchmarks)
    p, pp = cfg.pipeline, pair_settings(cfg.pipeline, pair_name)
    groups = gpu_groups(p)
    if groups is not None:  # the models load in the spawned workers; the prompts need only the tokenizer here
        pair = decoder = None
        tokenizer = load_tokenizer(pair_spec(pair_name).target, cfg.paths.models_dir)
    else:
        pair, decoder = _collect_setup(cfg, settings, pair_name, collect_dir, console)
        tokenizer = pair.tokenizer
    prompts = {b: shard.take(stage_prompts(cfg, tokenizer, b, int(pp.prompts_per_benchmark), int(p.prompt_offset)))
               for b in benchmarks}
    jobs = [(b, qid, ids) for b, items in prompts.items() for qid, ids in items]
    todo = [job for job in jobs if not shard_path(collect_dir, pair_name, job[0], job[1]).exists()]
    if len(todo) < len(jobs):  # finished before an interruption
        console.print(f"{pair_name}: {len(jobs) - len(todo)} prompt(s) already collected, skipped")
    weights = [len(ids) + 4 * int(pp.max_new_tokens) for _, _, ids in todo]
    workers = min(len(groups) if groups is not None else engines_of(pair).workers(p.workers), max(1, len(todo)))
    with progress_to(progress, len(todo), f"collect {pair_name} ({workers} worker(s))") as advance:
        if groups is not None:
            context = (OmegaConf.to_container(cfg, resolve=True), settings, pair_name, str(collect_dir))
            spawn_pull(_collect_on_gpus, [context] * workers, groups[:workers], todo, weights, advance)
        else:
            fork_pull(lambda group, report: _collect_prompts(decoder, pp, pair_name, collect_dir, group, report),
                      todo, weights, workers, advance)


def _collect_setup(cfg, settings: RunSettings, pair_name: str, collect_dir: Path, console):
    """The pair, its `fixed` decoder (eager middle prefill), and its runtime context measured and written
    to ``runtime.json``."""
    p, pp = cfg.pipeline, pair_settings(cfg.pipeline, pair_name)
    tree = settings.tree
    if p.get("collect_schedule") is not None:  # the decoding between enumerated turns (the planner's state)
        tree = settings.tree_with(schedule=[int(a) for a in p.collect_schedule])
    pair = load_engine_pair(pair_spec(pair_name), cfg, log=console.print, device=p.device, dtype=p.dtype)
    decoder = decoder_for("fixed", pair, tree, cache_dir=cfg.paths.cache_dir, eager_middle_prefill=True,
                          small=settings.small)  # small=: the small drafter
    budget = decoder.budget()
    first = p.fit_benchmarks[0]
    warm_ids = stage_prompts(cfg, pair.tokenizer, first, int(pp.prompts_per_benchmark), int(p.prompt_offset))[0][1]
    # runtime context, not used as data: medians over repeated all-call warm-ups
    t_tgt, t_mid = decoder.warm_up(warm_ids, int(p.warmup_tokens), repeats=int(p.get("warmup_repeats", 1)))
    # the report's figure, and budget=auto's (the same measurement, cached once)
    curve = decoder.engine.verify_curve(cfg.paths.cache_dir, decoder.cfg.auto_max_budget)
    atomic_write_json({"pair": pair_name, "runtime": pair.runtime, "middle_runtime": pair.middle_runtime,
                       **engines_of(pair).info(), **machine_info(devices_of(pair.target, pair.middle)), "budget": budget,
                       "budget_setting": settings.budget_setting, "tree_shape": settings.tree_shape,
                       "collect_schedule": list(decoder.cfg.schedule),
                       "t_tgt_ms": t_tgt, "t_mid_ms": t_mid, "context_samples": decoder.context_samples,
                       "warmup_repeats": int(p.get("warmup_repeats", 1)), "verify_curve": curve},
                      collect_dir / pair_name / "runtime.json")
    console.print(f"[bold]{pair_name}[/]: runtime {pair.runtime} (middle drafter {pair.middle_runtime}), planned "
                  f"B_ver={budget} ({settings.budget_setting}), t_tgt={t_tgt:.1f} ms, t_mid={t_mid:.1f} ms")
    return pair, decoder


def _collect_prompts(decoder, pp, pair_name: str, collect_dir: Path, group, report) -> None:
    """One worker's prompts: decode and enumerate each, one shard per prompt."""
    for bench, qid, ids in group:
        meta = {"pair": pair_name, "benchmark": bench, "report": f"{pair_name}/{bench}", "question_id": qid}
        rows = run_prompt(decoder, ids, pp, meta)
        if rows:
            atomic_write_parquet(pd.DataFrame(rows), shard_path(collect_dir, pair_name, bench, qid))
        report(1)


def _collect_on_gpus(context: tuple, pull, report) -> None:
    """One spawned GPU worker of :func:`_collect_pair`: its own pair and runtime context on the GPUs it
    sees (each worker's ``runtime.json`` is a measurement of the same pair; the last one written stays),
    then the prompts it pulls."""
    cfg_dict, settings, pair_name, collect_dir = context
    cfg = OmegaConf.create(cfg_dict)
    pair, decoder = _collect_setup(cfg, settings, pair_name, Path(collect_dir), Console(stderr=True))
    _collect_prompts(decoder, pair_settings(cfg.pipeline, pair_name), pair_name, Path(collect_dir), pull, report)
