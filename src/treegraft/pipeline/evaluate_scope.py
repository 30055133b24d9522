"""What an evaluate job covers: its pairs, benchmarks, first prompt and methods (``ar`` first, sensitivity
variants after), the prompts each method runs on, the order the methods run on a prompt, and which
records of the whole evaluation are on disk (:func:`evaluate_coverage`)."""

from __future__ import annotations

import json
from pathlib import Path

from omegaconf import DictConfig

from ..decoding.methods import parse_method
from .common import stage_records
from .record_files import method_files
from .shards import Coverage
from .stage_jobs import job_command

__all__ = ["eval_pairs", "evaluate_benchmarks", "evaluation_offset", "evaluated_methods", "method_prompts",
           "evaluation_units", "rotated_order", "evaluate_coverage"]

def eval_pairs(cfg: DictConfig, whole: bool = False) -> list[str]:
    """The pairs this evaluate job runs: a sweep job's ``pair``, else (and with ``whole``) the experiment's
    evaluated pairs, held-out ones included."""
    if cfg.get("pair") and not whole:  # a sweep job: one pair
        return [cfg.pair.name]
    p = cfg.pipeline
    pairs = list(p.eval_pairs) if p.get("eval_pairs") else list(p.pairs)
    return pairs + [h for h in (p.held_out_pairs or []) if h not in pairs]


def evaluate_benchmarks(cfg: DictConfig) -> list[str]:
    """The benchmarks this evaluate job covers: a sweep job's ``data``, else ``evaluation.benchmarks``."""
    return [cfg.data.name] if cfg.get("data") else list(cfg.evaluation.benchmarks)


def evaluation_offset(cfg: DictConfig) -> int:
    """The first evaluated prompt of each benchmark: ``evaluation.prompt_offset``, else right after the
    prompts `collect` used (never evaluate on fitting prompts)."""
    e, p = cfg.evaluation, cfg.pipeline
    return int(e.prompt_offset) if e.prompt_offset is not None else int(p.prompt_offset) + int(p.prompts_per_benchmark)


def evaluated_methods(cfg: DictConfig) -> list[str]:
    """``ar`` first (the reference of speedup and equality), the configured methods, then treegraft's
    runtime-context sensitivity variants (``treegraft@t_mid_x1.25``, ...) when ``evaluation.sensitivity``
    lists any and treegraft is evaluated."""
    e = cfg.evaluation
    methods = ["ar"] + [m for m in e.methods if m != "ar"]
    if "treegraft" in methods:
        methods += [f"treegraft@{v}" for v in (e.get("sensitivity") or [])]
    for m in methods:
        parse_method(m)  # a bad variant is one line now, not an hour in
    return methods


def method_prompts(cfg: DictConfig, method: str, prompts: list) -> list:
    """The prompts a method is evaluated on: all, or for an ablation with ``evaluation.ablation_prompts``
    = k, the first k of each benchmark (``ar`` runs on every prompt, so each has its reference)."""
    e = cfg.evaluation
    if e.get("ablation_prompts") is not None and method in (e.get("ablations") or []):
        return prompts[: int(e.ablation_prompts)]
    if "@" in method and e.get("sensitivity_prompts") is not None:
        return prompts[: int(e.sensitivity_prompts)]
    return prompts


def evaluation_units(cfg: DictConfig, prompts: dict[str, list], methods: list[str]) -> int:
    """(prompt, method) generations of one pair (the unit of the progress bar)."""
    return sum(len(method_prompts(cfg, m, prompts[b])) for b in prompts for m in methods)


def rotated_order(methods: list[str], k: int) -> list[str]:
    """The order the methods run on a benchmark's ``k``-th prompt: ``ar`` first (every other method's
    output is compared with it), then the others rotated by one place every two prompts, reversed on
    odd prompts, so that no method always runs in the same place or right after the same method (one
    after ``all_mid``, which streams the middle drafter's weights at every step, would otherwise always
    start where that left the machine)."""
    rest = [m for m in methods if m != "ar"]
    if rest:
        shift = (k // 2) % len(rest)
        rest = rest[shift:] + rest[:shift]
        if k % 2:
            rest.reverse()
    return ["ar"] * ("ar" in methods) + rest


def evaluate_coverage(cfg: DictConfig, out_dir: Path):
    """Which (pair, benchmark, method) prompts of the whole evaluation have a record on disk (any prompt
    range's file; records of an older config count as present: the run key is the job's to check)."""
    e = cfg.evaluation
    n = int(e.prompts_per_benchmark)
    precision = Path(out_dir) / "precision.json"
    if e.get("target_half_width") is not None and precision.exists():  # sized by precision: what it reached
        n = int(json.loads(precision.read_text())["prompts_per_benchmark"])
    methods = evaluated_methods(cfg)
    pairs = eval_pairs(cfg, whole=True)
    expected, present, rerun = {}, {}, {}
    for bench in e.benchmarks:
        ids = [int(r["question_id"]) for r in stage_records(cfg, bench, n, evaluation_offset(cfg))]
        for pair in pairs:
            for method in methods:
                key = (pair, bench, method)
                expected[key] = method_prompts(cfg, method, ids)
                have = {json.loads(line)["question_id"] for f in method_files(Path(out_dir) / pair / bench, method)
                        for line in f.read_text().splitlines()}
                present[key] = [q for q in expected[key] if q in have]
                rerun[key] = job_command("evaluate", cfg, pair, bench)
    return Coverage("evaluate", expected, present, rerun)
