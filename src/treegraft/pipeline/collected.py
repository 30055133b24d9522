"""What collect has on disk and which prompts a collect job covers: the pairs, benchmarks and per-pair
sizing of a job, the prompt shards (``q<id>.parquet``) and the rows `fit` and `distill` read from them
(:func:`load_rows`), the coverage of the whole experiment, and the merge every job ends with
(:func:`merge_collect`: cost models, summary, ``coverage.json``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import pandas as pd
from omegaconf import OmegaConf

from ..settings import RunSettings
from .artifacts import MissingArtifactError, atomic_write_json, atomic_write_parquet, atomic_write_text
from .collect_rows import collect_summary
from .common import fit_pairs, stage_records, to_markdown
from .cost_model import cost_model_latency, fit_cost_model
from .shards import Coverage, Shard
from .stage_jobs import job_command

__all__ = ["PAIR_SETTINGS", "pair_settings", "collect_pairs", "collect_benchmarks", "collect_question_ids", "shard_path",
           "row_files", "load_rows", "collect_coverage", "pair_is_collected", "merge_collect"]

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


def shard_path(collect_dir: Path, pair: str, benchmark: str, question_id: int) -> Path:
    """The rows of one collected prompt."""
    return Path(collect_dir) / pair / benchmark / f"q{question_id}.parquet"


def collect_pairs(cfg) -> list[str]:
    """The pairs this collect job collects: the ``pair`` of a sweep job, else every fitting pair. A
    held-out pair is never collected (one line)."""
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
    p, pp = cfg.pipeline, pair_settings(cfg.pipeline, pair)
    return [int(r["question_id"]) for r in stage_records(cfg, benchmark, int(pp.prompts_per_benchmark), int(p.prompt_offset))]


def collect_coverage(cfg, collect_dir: Path):
    """Which prompts of the whole experiment (every fitting pair x fitting benchmark) have their shard on disk."""
    expected, present, rerun = {}, {}, {}
    for pair in fit_pairs(cfg):
        for bench in cfg.pipeline.fit_benchmarks:
            ids = collect_question_ids(cfg, pair, bench)
            expected[pair, bench] = ids
            present[pair, bench] = [q for q in ids if shard_path(collect_dir, pair, bench, q).exists()]
            rerun[pair, bench] = job_command("collect", cfg, pair, bench)
    return Coverage("collect", expected, present, rerun)


def pair_is_collected(cfg, collect_dir: Path, pair: str, benchmarks: Sequence[str] | None = None, shard=None) -> bool:
    """Whether a pair's runtime context and every prompt shard of this job (``benchmarks``, ``shard``'s range)
    are on disk, so a rerun of `collect` need not load its models (the question ids come from the benchmark
    files alone)."""
    shard = shard or Shard()
    if not (Path(collect_dir) / pair / "runtime.json").exists():
        return False
    return all(shard_path(collect_dir, pair, bench, q).exists()
               for bench in (benchmarks or cfg.pipeline.fit_benchmarks)
               for q in shard.take(collect_question_ids(cfg, pair, bench)))


def merge_collect(cfg, collect_dir: Path, console=None, settings: RunSettings | None = None):
    """What every collect job, `fit` and `distill` do with the shards on disk: per fitting pair with rows,
    the cost model refitted from all of them (seconds; the same rows give the same file), the summary
    table of what is there, and ``coverage.json`` (the prompts still missing). Returns (summary, coverage).
    ``settings``: the caller's (else built from ``cfg``)."""
    depth = RunSettings.of(settings or cfg).depth
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
        summary += collect_summary(rows, depth)
    df = pd.DataFrame(summary)
    atomic_write_parquet(df, Path(collect_dir) / "summary.parquet")
    atomic_write_text(to_markdown(df) if not df.empty else "no prompt collected yet\n", Path(collect_dir) / "summary.md")
    coverage.write(Path(collect_dir) / "coverage.json")
    if console is not None:
        console.print(coverage.line())
    return df, coverage
