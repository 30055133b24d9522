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
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import pandas as pd
from omegaconf import OmegaConf

from ..decoding.tree_decoder import TreeGraftDecoder
from ..devices import devices_of
from ..machine import machine_info
from ..models.runtime.memory import return_freed_memory
from .enumeration import TurnEnumeration, enumerate_turn
from ..scheduling.features import ALL_FEATURES, state_names, state_vector, suffix_names, suffix_vector
from .artifacts import MissingArtifactError, atomic_write_json, atomic_write_parquet
from .parallel import fork_pull, one_thread_with_workers

__all__ = [
    "decode_with_enumeration",
    "enumeration_rows",
    "fit_cost_model",
    "load_rows",
    "pair_is_collected",
    "COST_FEATURES",
]

COST_FEATURES = ("small_calls", "middle_calls", "middle_tokens", "verified_nodes")


def decode_with_enumeration(
    decoder: TreeGraftDecoder,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    should_enumerate: Callable[[int], bool] = lambda turn: True,
) -> tuple[list[int], list[tuple[int, TurnEnumeration]]]:
    """Decode greedily; before every turn with ``should_enumerate(turn)``, enumerate all schedules.

    Returns (new tokens, [(turn index, enumeration)]). The output equals the decoder's own.
    """
    enumerations = []

    def before_turn(turn: int, root: int) -> None:
        if should_enumerate(turn):
            enumerations.append((turn, enumerate_turn(decoder, root)))

    result = decoder.generate(prompt_ids, max_new_tokens, before_turn=before_turn)
    return result.tokens, enumerations


def enumeration_rows(en: TurnEnumeration, depth: int, meta: dict) -> list[dict]:
    """One row per (schedule, step) of one enumerated turn; ``meta`` (pair, benchmark, ...) is copied in."""
    names = state_names(depth, ALL_FEATURES)
    features = {prefix: dict(zip(names, state_vector(state, ALL_FEATURES).tolist())) for prefix, state in en.states.items()}
    sfx_names = suffix_names(depth)
    rows = []
    for schedule, out in en.outcomes.items():
        for step in range(1, depth + 1):
            prefix, suffix = schedule[: step - 1], schedule[step:]
            rows.append({
                **meta,
                "schedule": schedule,
                "step": step,
                "action": int(schedule[step - 1]),
                "prefix": prefix,
                "suffix": suffix,
                **features[prefix],
                **dict(zip(sfx_names, suffix_vector(step, suffix, depth).tolist())),
                "accepted": out.accepted,
                "latency_measured_s": out.latency_s,
                "small_s": out.small_s,
                "middle_s": out.middle_s,
                "verify_s": out.verify_s,
                "small_calls": out.small_calls,
                "middle_calls": out.middle_calls,
                "middle_tokens": out.middle_tokens,
                "tree_nodes": out.tree_nodes,
                "verified_nodes": out.verified_nodes,
            })
    return rows


def _cost_matrix(rows: pd.DataFrame, curve: dict | None) -> tuple[np.ndarray, list[str]]:
    """The cost model's features: per-call counts, plus the target's measured verification time for
    the schedule's tree size (``curve`` seconds per row count: verification is not linear in nodes)."""
    names = list(COST_FEATURES)
    x = rows[names].to_numpy(np.float64)
    if curve:
        from ..models.runtime import curve_at

        points = {int(k): float(v) for k, v in curve.items()}
        verify = np.array([curve_at(points, int(n) + 1) for n in rows["verified_nodes"]], dtype=np.float64)
        x = np.concatenate([x, verify[:, None]], axis=1)
        names.append("verify_curve")
    return x, names


# the verification curve's coefficient in the cost model: the measured curve, up to context length and drift
CURVE_SCALE = (0.5, 2.0)


def fit_cost_model(rows: pd.DataFrame, curve: dict | None = None) -> dict:
    """Per-call costs: latency = c0 + sum_k c_k * feature_k, fitted over schedules by bounded least squares
    on *relative* errors; with ``curve`` (the target's measured verification curve: verification is not
    linear in nodes) one more term is the curve at the schedule's tree size, times a scale.

    * Every coefficient >= 0, c0 included: a negative c0 (a free intercept takes one when the curve grows
      faster than the latencies) prices small trees at zero and makes their tokens/s label unbounded.
    * Relative errors (each schedule weighted by 1 / its latency): downstream a schedule's label is
      tokens/s = AL / latency, so a latency's relative error is its label's. Absolute squares let a few
      slow schedules (a middle drafter's first call of a prompt encodes the whole prompt: seconds) set
      every coefficient; on a llama.cpp `make all` they priced verification and every call at 0, each
      all-skip schedule at 1e-6 s (tokens/s 1.5e6), and every offline policy came out at 100% of the oracle.
    * The curve's scale within ``CURVE_SCALE``: so no schedule costs less than half its tree's measured
      verification.
    """
    from scipy.optimize import lsq_linear

    per_schedule = rows[rows["step"] == 1]  # one row per (turn, schedule)
    x, names = _cost_matrix(per_schedule, curve)
    y = per_schedule["latency_measured_s"].to_numpy(np.float64)
    if len(y) == 0 or np.any(y <= 0):
        raise ValueError(f"fit_cost_model needs positive measured latencies, got {len(y)} schedules "
                         f"with minimum {y.min() if len(y) else float('nan')}")
    a = np.concatenate([np.ones((len(x), 1)), x], axis=1)
    low, high = np.zeros(a.shape[1]), np.full(a.shape[1], np.inf)
    if curve:
        low[-1], high[-1] = CURVE_SCALE
    fit = lsq_linear(a / y[:, None], np.ones_like(y), bounds=(low, high), method="bvls")
    intercept, coef = float(fit.x[0]), fit.x[1:]
    pred = intercept + x @ coef
    r2 = 1 - np.sum((y - pred) ** 2) / max(np.sum((y - y.mean()) ** 2), 1e-18)
    return {"intercept_s": intercept, **{f"{k}_s": float(c) for k, c in zip(names, coef)},
            "r2": float(r2), "median_relative_error": float(np.median(np.abs(pred / y - 1))),
            "schedules": int(len(per_schedule)),
            "verify_curve": {str(k): float(v) for k, v in curve.items()} if curve else None}


# the cost model's terms that scale with a target forward and with a middle-drafter forward
TARGET_TERMS = ("verified_nodes", "verify_curve")
MIDDLE_TERMS = ("middle_calls", "middle_tokens")


def cost_model_latency(rows: pd.DataFrame, model: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(latency, its target part, its middle part), seconds [len(rows)] each, from one cost matrix (the
    verification curve is read row by row: build it once)."""
    if model["intercept_s"] < 0:
        raise ValueError(f"cost_model.json has a negative intercept_s ({model['intercept_s']:.4f} s; expected >= 0): "
                         "it was fitted before the intercept was constrained; rerun collect to refit it")
    x, names = _cost_matrix(rows, model.get("verify_curve"))
    coef = np.array([model[f"{k}_s"] for k in names])
    part = lambda terms: x @ np.where([k in terms for k in names], coef, 0.0)
    lat = np.maximum(np.full(len(rows), model["intercept_s"]) + x @ coef, 1e-6)
    return lat, part(TARGET_TERMS), part(MIDDLE_TERMS)


def apply_cost_model(rows: pd.DataFrame, model: dict) -> np.ndarray:
    """The cost model's latency of every row, in seconds [len(rows)]."""
    return cost_model_latency(rows, model)[0]


PAIR_SETTINGS = ("prompts_per_benchmark", "enumerate_every", "max_enumerated_turns")


def pair_settings(p, pair_name: str):
    """``pipeline`` with the pair's entry of ``pipeline.pair_overrides`` applied (collect sizing only:
    fewer prompts or sparser enumeration for a pair whose turns are slow)."""
    override = (p.get("pair_overrides") or {}).get(pair_name) or {}
    bad = set(override) - set(PAIR_SETTINGS)
    if bad:
        raise ValueError(f"pipeline.pair_overrides.{pair_name} sets {sorted(bad)}; only {list(PAIR_SETTINGS)} can differ per pair")
    if int(override.get("prompts_per_benchmark", 0)) > int(p.prompts_per_benchmark):
        raise ValueError(f"pipeline.pair_overrides.{pair_name}.prompts_per_benchmark must be <= "
                         f"pipeline.prompts_per_benchmark={p.prompts_per_benchmark} (evaluation prompts follow those)")
    return OmegaConf.merge(p, override)


def _shards(collect_dir: Path, pair: str, benchmark: str) -> list[Path]:
    return sorted((Path(collect_dir) / pair / benchmark).glob("q*.parquet"))


def row_files(collect_dir: Path, pairs: Sequence[str], benchmarks: Sequence[str], latency_label: str = "measured") -> list[Path]:
    """The files :func:`load_rows` reads (what `fit` and `distill` record as their inputs)."""
    files = [p for pair in pairs for bench in benchmarks for p in _shards(collect_dir, pair, bench)]
    if latency_label == "cost_model":
        files += [Path(collect_dir) / pair / "cost_model.json" for pair in pairs]
    return files


def load_rows(collect_dir: Path, pairs: Sequence[str], benchmarks: Sequence[str], experiment: str,
              latency_label: str = "measured", allow_missing: bool = False) -> pd.DataFrame:
    """All collected rows of ``pairs`` x ``benchmarks``, with the ``latency_s`` label set.

    ``allow_missing``: a pair x benchmark without any shard yet (a sharded collect still running) is left
    out instead of an error; an error only when no pair has any row.

    ``latency_label``: ``measured`` (wall times) or ``cost_model`` (each pair's fitted per-call costs).
    ``latency_target_s`` and ``latency_middle_s`` are the parts of ``latency_s`` that scale with the
    target's and the middle drafter's forward cost (verification, middle calls), for relabelling a turn
    under other timings.
    """
    if latency_label not in ("measured", "cost_model"):
        raise ValueError(f"latency_label must be measured or cost_model, got {latency_label!r}")
    frames = []
    for pair in pairs:
        pair_rows = []
        for bench in benchmarks:
            shards = _shards(collect_dir, pair, bench)
            if not shards and allow_missing:
                continue
            if not shards:
                raise MissingArtifactError(
                    f"no collected rows for pair {pair}, benchmark {bench} under {collect_dir}: "
                    f"run the `collect` stage first (make collect EXPERIMENT={experiment})"
                )
            pair_rows += [pd.read_parquet(p) for p in shards]
        if not pair_rows:
            continue
        df = pd.concat(pair_rows, ignore_index=True)
        if latency_label == "cost_model":
            path = Path(collect_dir) / pair / "cost_model.json"
            if not path.exists():
                raise MissingArtifactError(f"missing {path}: rerun `collect` (make collect EXPERIMENT={experiment})")
            df["latency_s"], df["latency_target_s"], df["latency_middle_s"] = cost_model_latency(df, json.loads(path.read_text()))
        else:
            df["latency_s"] = df["latency_measured_s"]
            df["latency_target_s"], df["latency_middle_s"] = df["verify_s"], df["middle_s"]
        frames.append(df)
    if not frames:
        raise MissingArtifactError(f"no collected rows for pairs {list(pairs)} under {collect_dir}: run the `collect` "
                                   f"stage first (make collect EXPERIMENT={experiment})")
    return pd.concat(frames, ignore_index=True)


def collect_summary(rows: pd.DataFrame, depth: int) -> list[dict]:
    """Per report: prompts, turns, rows, enumeration cost, prefix-sharing saving, verifications per
    turn, mean oracle / all-skip / all-call throughput (tokens/s per turn, measured latencies)."""
    out = []
    for (pair_name, bench), g in rows.groupby(["pair", "benchmark"], sort=False):
        first = g[g["step"] == 1].assign(tau=lambda d: (d["accepted"] + 1) / d["latency_measured_s"])
        per_turn = first.groupby(["question_id", "turn"])
        enum = g.drop_duplicates(["question_id", "turn"])
        out.append({
            "pair": pair_name, "benchmark": bench, "prompts": g["question_id"].nunique(),
            "turns": len(per_turn), "rows": len(g),
            "enum_wall_s": float(enum["enum_wall_s"].sum()),
            # what 2^D separate constructions and verifications would have cost / what the walk cost
            "sharing_saving": float(enum["enum_independent_s"].sum() / max(enum["enum_wall_s"].sum(), 1e-9)),
            "verifications_per_turn": float(enum["enum_verifications"].mean()),
            "oracle_tau": float(per_turn["tau"].max().mean()),
            "all_skip_tau": float(first[first["schedule"] == "0" * depth]["tau"].mean()),
            "all_call_tau": float(first[first["schedule"] == "1" * depth]["tau"].mean()),
        })
    return out


def shard_path(collect_dir: Path, pair: str, benchmark: str, question_id: int) -> Path:
    return Path(collect_dir) / pair / benchmark / f"q{question_id}.parquet"


def collect_pairs(cfg) -> list[str]:
    """The pairs this collect job collects: the ``pair`` of a sweep job, else every fitting pair. A
    held-out pair is never collected (one line)."""
    from .common import fit_pairs

    held = set(cfg.pipeline.held_out_pairs or [])
    if cfg.get("pair"):
        name = cfg.pair.name
        if name in held:
            raise ValueError(f"pair {name} is held out (pipeline.held_out_pairs): it is never collected, fitted or "
                             f"distilled; collect one of {fit_pairs(cfg)}")
        return [name]
    return fit_pairs(cfg)


def collect_benchmarks(cfg) -> list[str]:
    """The fitting benchmarks this collect job covers: the ``data`` of a sweep job, else all of them."""
    fit = list(cfg.pipeline.fit_benchmarks)
    if cfg.get("data"):
        name = cfg.data.name
        if name not in fit:
            raise ValueError(f"benchmark {name} is not a fitting benchmark (pipeline.fit_benchmarks={fit}); "
                             "held-out benchmarks are never collected")
        return [name]
    return fit


def collect_question_ids(cfg, pair: str, benchmark: str) -> list[int]:
    """The question ids collect uses of ``benchmark`` for ``pair`` (all prompt ranges; no tokenizer)."""
    from .common import stage_records

    p, pp = cfg.pipeline, pair_settings(cfg.pipeline, pair)
    return [int(r["question_id"]) for r in stage_records(cfg, benchmark, int(pp.prompts_per_benchmark), int(p.prompt_offset))]


def collect_coverage(cfg, collect_dir: Path):
    """Which prompts of the whole experiment (every fitting pair x fitting benchmark) have their shard on disk."""
    from .common import fit_pairs
    from .shards import Coverage

    expected, present, rerun = {}, {}, {}
    for pair in fit_pairs(cfg):
        for bench in cfg.pipeline.fit_benchmarks:
            ids = collect_question_ids(cfg, pair, bench)
            expected[pair, bench] = ids
            present[pair, bench] = [q for q in ids if shard_path(collect_dir, pair, bench, q).exists()]
            rerun[pair, bench] = f"python scripts/collect.py experiment={cfg.pipeline.name} pair={pair} data={bench}"
    return Coverage("collect", expected, present, rerun)


def pair_is_collected(cfg, collect_dir: Path, pair: str, benchmarks: Sequence[str] | None = None, shard=None) -> bool:
    """Whether a pair's runtime context and every prompt shard of this job (``benchmarks``, ``shard``'s range)
    are on disk, so a rerun of `collect` need not load its models (the question ids come from the benchmark
    files alone)."""
    from .shards import Shard

    shard = shard or Shard()
    if not (Path(collect_dir) / pair / "runtime.json").exists():
        return False
    return all(shard_path(collect_dir, pair, bench, q).exists()
               for bench in (benchmarks or cfg.pipeline.fit_benchmarks)
               for q in shard.take(collect_question_ids(cfg, pair, bench)))


def merge_collect(cfg, collect_dir: Path, console=None):
    """What every collect job, `fit` and `distill` do with the shards on disk: per fitting pair with rows,
    the cost model refitted from all of them (seconds; the same rows give the same file), the summary
    table of what is there, and ``coverage.json`` (the prompts still missing). Returns (summary, coverage)."""
    from .artifacts import atomic_write_text
    from .common import fit_pairs, to_markdown

    p = cfg.pipeline
    coverage = collect_coverage(cfg, collect_dir)
    summary = []
    for pair in fit_pairs(cfg):
        if not any(coverage.present.get((pair, b)) for b in p.fit_benchmarks):
            continue
        rows = load_rows(collect_dir, [pair], list(p.fit_benchmarks), p.name, allow_missing=True)
        runtime = Path(collect_dir) / pair / "runtime.json"
        curve = json.loads(runtime.read_text()).get("verify_curve") if runtime.exists() else None
        model = fit_cost_model(rows, curve)
        path = Path(collect_dir) / pair / "cost_model.json"
        if not path.exists() or json.loads(path.read_text()) != json.loads(json.dumps(model)):
            atomic_write_json(model, path)  # rewritten only when it changed: `fit` hashes it
        summary += collect_summary(rows, int(cfg.tree.depth))
    df = pd.DataFrame(summary)
    atomic_write_parquet(df, Path(collect_dir) / "summary.parquet")
    atomic_write_text(to_markdown(df) if not df.empty else "no prompt collected yet\n", Path(collect_dir) / "summary.md")
    coverage.write(Path(collect_dir) / "coverage.json")
    if console is not None:
        console.print(coverage.line())
    return df, coverage


def _collect_pair(cfg, pair_name: str, collect_dir: Path, console, progress=None, benchmarks=None, shard=None) -> None:
    """Load a pair, measure its runtime context (runtime.json), then decode and enumerate every prompt of
    ``benchmarks`` (``shard``'s range of each) not collected yet, one shard per prompt. On CUDA with
    ``workers`` > 1, one spawned worker per GPU (group) does all of that with a pair of its own
    (:func:`_collect_on_gpus`)."""
    import sys

    import torch
    from tqdm.auto import tqdm

    from ..front import engines_of
    from .common import pair_spec, stage_prompts
    from .parallel import gpu_worker_groups, spawn_pull
    from .shards import Shard

    shard = shard or Shard()
    benchmarks = list(benchmarks or cfg.pipeline.fit_benchmarks)
    p, pp = cfg.pipeline, pair_settings(cfg.pipeline, pair_name)
    on_gpus = torch.device(p.device).type == "cuda" and int(p.get("workers") or 1) > 1
    if on_gpus:  # refused here, before any model is loaded, when the GPUs are too few
        groups = gpu_worker_groups(p.workers, p.get("gpus_per_worker", 1))
        pair = decoder = None
        from ..models import load_tokenizer

        tokenizer = load_tokenizer(pair_spec(pair_name).target, cfg.paths.models_dir)
    else:
        pair, decoder = _collect_setup(cfg, pair_name, collect_dir, console)
        tokenizer = pair.tokenizer
    prompts = {b: shard.take(stage_prompts(cfg, tokenizer, b, int(pp.prompts_per_benchmark), int(p.prompt_offset)))
               for b in benchmarks}
    jobs = [(b, qid, ids) for b, items in prompts.items() for qid, ids in items]
    todo = [job for job in jobs if not shard_path(collect_dir, pair_name, job[0], job[1]).exists()]
    if len(todo) < len(jobs):  # finished before an interruption
        console.print(f"{pair_name}: {len(jobs) - len(todo)} prompt(s) already collected, skipped")
    weights = [len(ids) + 4 * int(pp.max_new_tokens) for _, _, ids in todo]
    workers = min(len(groups) if on_gpus else engines_of(pair).workers(p.workers), max(1, len(todo)))
    bar = None if progress is not None else tqdm(total=len(todo), desc=f"collect {pair_name} ({workers} worker(s))",
                                                 file=sys.stderr)
    if on_gpus:
        context = (OmegaConf.to_container(cfg, resolve=True), pair_name, str(collect_dir))
        spawn_pull(_collect_on_gpus, [context] * workers, groups[:workers], todo, weights, progress or bar.update)
    else:
        fork_pull(lambda group, report: _collect_prompts(decoder, pp, pair_name, collect_dir, group, report),
                  todo, weights, workers, progress or bar.update)
    if bar is not None:
        bar.close()


def _collect_setup(cfg, pair_name: str, collect_dir: Path, console):
    """The pair, its `fixed` decoder (eager middle prefill), and its runtime context measured and written
    to ``runtime.json``."""
    from ..front import decoder_for, engines_of, load_engine_pair
    from .common import pair_spec, stage_prompts

    p, pp = cfg.pipeline, pair_settings(cfg.pipeline, pair_name)
    tree = OmegaConf.to_container(cfg.tree, resolve=True)
    if p.get("collect_schedule") is not None:  # the decoding between enumerated turns (the planner's state)
        tree["schedule"] = [int(a) for a in p.collect_schedule]
    pair = load_engine_pair(pair_spec(pair_name), cfg, log=console.print, device=p.device, dtype=p.dtype)
    small = OmegaConf.to_container(cfg.small, resolve=True) if cfg.get("small") else None  # small=: the small drafter
    decoder = decoder_for("fixed", pair, tree, cache_dir=cfg.paths.cache_dir, eager_middle_prefill=True, small=small)
    budget = decoder.budget()
    first = p.fit_benchmarks[0]
    warm_ids = stage_prompts(cfg, pair.tokenizer, first, int(pp.prompts_per_benchmark), int(p.prompt_offset))[0][1]
    # runtime context, not used as data: medians over repeated all-call warm-ups
    t_tgt, t_mid = decoder.warm_up(warm_ids, int(p.warmup_tokens), repeats=int(p.get("warmup_repeats", 1)))
    # the report's figure, and budget=auto's (the same measurement, cached once)
    curve = decoder.engine.verify_curve(cfg.paths.cache_dir, decoder.cfg.auto_max_budget)
    atomic_write_json({"pair": pair_name, "runtime": pair.runtime, "middle_runtime": pair.middle_runtime,
                       **engines_of(pair).info(), **machine_info(devices_of(pair.target, pair.middle)), "budget": budget,
                       "budget_setting": str(cfg.tree.budget), "tree_shape": cfg.tree.shape,
                       "collect_schedule": list(decoder.cfg.schedule),
                       "t_tgt_ms": t_tgt, "t_mid_ms": t_mid, "context_samples": decoder.context_samples,
                       "warmup_repeats": int(p.get("warmup_repeats", 1)), "verify_curve": curve},
                      collect_dir / pair_name / "runtime.json")
    console.print(f"[bold]{pair_name}[/]: runtime {pair.runtime} (middle drafter {pair.middle_runtime}), planned B_ver={budget} ({cfg.tree.budget}), "
                  f"t_tgt={t_tgt:.1f} ms, t_mid={t_mid:.1f} ms")
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
    from rich.console import Console

    cfg_dict, pair_name, collect_dir = context
    cfg = OmegaConf.create(cfg_dict)
    pair, decoder = _collect_setup(cfg, pair_name, Path(collect_dir), Console(stderr=True))
    _collect_prompts(decoder, pair_settings(cfg.pipeline, pair_name), pair_name, Path(collect_dir), pull, report)


def run_prompt(decoder: TreeGraftDecoder, prompt_ids: list[int], cfg, meta: dict) -> list[dict]:
    """Decode one prompt, enumerating the sampled turns; the rows of every enumerated turn."""
    every, cap = int(cfg.enumerate_every), cfg.max_enumerated_turns

    def should(turn: int) -> bool:
        return turn % every == 0 and (cap is None or turn // every < int(cap))

    _, enumerations = decode_with_enumeration(decoder, prompt_ids, int(cfg.max_new_tokens), should)
    rows = []
    for turn, en in enumerations:
        # the turn's enumeration cost, for the prefix-sharing figures: the walk's wall time and what
        # 2^D separate constructions and verifications would have cost
        cost = {"enum_wall_s": en.wall_s, "enum_verifications": en.verifications,
                "enum_independent_s": sum(o.latency_s for o in en.outcomes.values())}
        rows += enumeration_rows(en, decoder.cfg.depth, {**meta, "turn": turn, **cost})
    return rows


@one_thread_with_workers
def run_collect(cfg, progress=None) -> pd.DataFrame:
    """The `collect` stage for this job's pairs and benchmarks (every fitting pair x fitting benchmark, or a
    sweep job's ``pair`` / ``data`` / ``shard``), then the merge of every shard on disk
    (:func:`merge_collect`); returns the summary table. ``progress(n)``: advance an outer progress bar by n
    prompts (else one bar per pair here)."""
    from rich.console import Console

    from .artifacts import record_stage, stage_dir
    from .common import print_table
    from .shards import shard_from
    from .tracking import stage_logger

    console = Console(width=200, stderr=True)
    p = cfg.pipeline
    out_dir = stage_dir(cfg.paths.output_dir, p.name, "collect")
    benchmarks, shard = collect_benchmarks(cfg), shard_from(cfg)
    pairs = collect_pairs(cfg)
    if not shard.whole or cfg.get("pair") or cfg.get("data"):
        console.print(f"collect job: {', '.join(pairs)} x {', '.join(benchmarks)}, {shard}")
    for pair_name in pairs:
        if pair_is_collected(cfg, out_dir, pair_name, benchmarks, shard):
            console.print(f"{pair_name}: every prompt already collected, skipped (no model loaded)")
        else:
            _collect_pair(cfg, pair_name, out_dir, console, progress, benchmarks, shard)
            return_freed_memory()  # the pair's heap pages, before the next pair or stage loads its own
    # refitted on every run (seconds), so a resumed collect never keeps a model fitted by older code
    df, coverage = merge_collect(cfg, out_dir, console)
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
