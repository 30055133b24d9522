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
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import sys
from dataclasses import asdict
from pathlib import Path

import pandas as pd
import torch
from omegaconf import DictConfig, OmegaConf, open_dict
from rich.console import Console
from tqdm.auto import tqdm

from .equality import compare_outputs
from ..decoding.methods import (LEARNED_ARTIFACTS, LEARNED_METHODS, load_learned_scheduler, method_small, parse_method,
                                small_settings)
from ..front import EngineSettings, decoder_for, engines_of, load_engine_pair
from ..decoding.sampling import SamplingConfig
from ..decoding.tree_decoder import TreeGraftDecoder
from ..devices import devices_of, peak_memory, reset_peak_memory
from ..machine import machine_info, machine_line
from ..models import load_model, load_tokenizer
from ..models.runtime.memory import return_freed_memory
from ..stats import Interval
from .artifacts import atomic_write_json, atomic_write_parquet, atomic_write_text, file_hash, record_stage, stage_dir
from .common import fold_intervals, pair_spec, print_table, stage_prompts, stage_records
from .estimates import PromptTable, method_intervals
from .records import make_record, read_records, summarize_records
from .parallel import fork_pull, gpu_worker_groups, one_thread_with_workers, spawn_pull
from .shards import shard_from
from .tracking import stage_logger
from ..devices import now

__all__ = ["run_evaluate", "explain_mismatches", "size_by_precision", "main_interval", "evaluated_methods", "make_record", "summarize_records", "read_records", "eval_pairs", "run_key", "method_prompts",
           "evaluation_units", "evaluate_coverage", "evaluate_benchmarks", "evaluation_offset", "method_files"]


def eval_pairs(cfg: DictConfig, whole: bool = False) -> list[str]:
    """The pairs this evaluate job runs: a sweep job's ``pair``, else (and with ``whole``) the experiment's
    evaluated pairs, held-out ones included."""
    if cfg.get("pair") and not whole:  # a sweep job: one pair
        return [cfg.pair.name]
    p = cfg.pipeline
    pairs = list(p.eval_pairs) if p.get("eval_pairs") else list(p.pairs)
    return pairs + [h for h in (p.held_out_pairs or []) if h not in pairs]


SHARD_SUFFIX = re.compile(r"\.shard\d+of\d+$")


def _method_of(path: Path) -> str:
    """The method of a record file (``fixed.jsonl``, ``fixed.shard0of2.jsonl`` -> ``fixed``)."""
    return SHARD_SUFFIX.sub("", Path(path).stem)


def small_for(cfg: DictConfig, method: str) -> dict | None:
    """The small drafter settings ``method`` runs with: the one its variant names (``fixed@self_draft``), else
    the configured ``small`` group (default ``ngram``); None for the n-gram drafter."""
    name = method_small(method)
    settings = small_settings(name) if name else (OmegaConf.to_container(cfg.small, resolve=True) if cfg.get("small") else None)
    return None if not settings or settings.get("name") == "ngram" else settings


def evaluate_benchmarks(cfg: DictConfig) -> list[str]:
    """The benchmarks this evaluate job covers: a sweep job's ``data``, else ``evaluation.benchmarks``."""
    return [cfg.data.name] if cfg.get("data") else list(cfg.evaluation.benchmarks)


def evaluation_offset(cfg: DictConfig) -> int:
    """The first evaluated prompt of each benchmark: ``evaluation.prompt_offset``, else right after the
    prompts `collect` used (never evaluate on fitting prompts)."""
    e, p = cfg.evaluation, cfg.pipeline
    return int(e.prompt_offset) if e.prompt_offset is not None else int(p.prompt_offset) + int(p.prompts_per_benchmark)


def evaluate_coverage(cfg: DictConfig, out_dir: Path):
    """Which (pair, benchmark, method) prompts of the whole evaluation have a record on disk (any prompt
    range's file; records of an older config count as present: the run key is the job's to check)."""
    from .shards import Coverage

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
                rerun[key] = f"python scripts/evaluate.py experiment={cfg.pipeline.name} pair={pair} data={bench}"
    return Coverage("evaluate", expected, present, rerun)


NOT_IN_RUN_KEY = ("methods", "benchmarks", "prompts_per_benchmark", "ablations", "ablation_prompts", "prompt_offset",
                  "target_half_width", "max_prompts_per_benchmark", "min_prompts_per_benchmark", "round_prompts", "sensitivity", "sensitivity_prompts", "scheduler_from")


def _write_records(records: list[dict], path: Path) -> None:
    atomic_write_text("".join(json.dumps(r) + "\n" for r in records), path)


def run_key(cfg: DictConfig, pair: str, method: str, artifacts: Path) -> str:
    """What a method's records depend on: the tree and evaluation settings, dtype, device, the engine
    (and its build), the prompts' offset and, for the learned methods, the scheduler artifacts. Saved records are reused
    only under the same key (a changed config or a refitted scheduler redoes them)."""
    e = OmegaConf.to_container(cfg.evaluation, resolve=True)
    for k in NOT_IN_RUN_KEY:  # which prompts and methods run, not what a record of one prompt holds
        e.pop(k, None)
    parts = {"pair": pair, "method": method, "evaluation": e,
             "tree": OmegaConf.to_container(cfg.tree, resolve=True), "dtype": cfg.pipeline.dtype,
             "runtime": cfg.runtime, "middle_runtime": cfg.middle_runtime, "cpu": machine_line([cfg.pipeline.device]),
             "device": cfg.pipeline.device, "warmup_tokens": cfg.pipeline.warmup_tokens,
             "warmup_repeats": cfg.pipeline.warmup_repeats}
    engine = asdict(EngineSettings.of(cfg))
    if engine["name"] != "torch":  # (absent for the PyTorch engine: its records of earlier runs stay valid)
        from ..engines.llama_cpp.build import installed_build

        parts["engine"] = {**engine, "build": (installed_build() or {}).get("patch_id")}
    small = small_for(cfg, method)
    if small is not None:  # (absent for the n-gram drafter: records of earlier runs stay valid)
        parts["small"] = small
    base, _ = parse_method(method)
    if base in LEARNED_ARTIFACTS:
        parts["artifacts"] = {name: file_hash(artifacts / name) for name in LEARNED_ARTIFACTS[base]}
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def method_files(folder: Path, method: str) -> list[Path]:
    """Every record file of ``method`` in a benchmark folder: the whole range's ``<method>.jsonl`` and the
    prompt ranges' ``<method>.shard<i>of<n>.jsonl`` of sharded jobs."""
    import glob

    folder = Path(folder)
    files = [folder / f"{method}.jsonl"] + sorted(folder.glob(f"{glob.escape(method)}.shard*of*.jsonl"))
    return [f for f in files if f.exists()]


def _saved_records(path: Path, key: str, prompts: list[tuple[int, list[int]]]) -> dict[int, dict]:
    """question id -> the record an earlier run saved for that prompt under the same key and the same
    prompt (token ids, so a changed prompt format redoes it), in any record file of the method (a sharded
    job's included; the newest where several hold one); prompts without one are missing."""
    wanted = {q: list(ids) for q, ids in prompts}
    out = {}
    method = _method_of(path)
    for file in method_files(path.parent, method):
        for line in file.read_text().splitlines():
            r = json.loads(line)
            q = r.get("question_id")
            if q in wanted and r.get("prompt_ids") == wanted[q] and r.get("run_key") == key:
                if q not in out or r.get("tstamp", 0) > out[q].get("tstamp", 0):
                    out[q] = r
    return out


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


def _evaluate_benchmarks(cfg, pair, pair_name: str, benchmarks: list[str], pulled, prompts, categories, saved, paths,
                         keys, methods, schedulers, sampling, progress) -> None:
    """One worker: build and warm up every decoder that ``benchmarks`` (every benchmark with work left)
    need, then for each benchmark it pulls (``pulled``, shared with the other workers) run the missing
    (prompt, method) generations, methods interleaved prompt by prompt, compare each with ``ar``'s
    output and rewrite that method's records after every prompt (an interruption loses at most one
    prompt's generations)."""
    p, e = cfg.pipeline, cfg.evaluation
    tree = OmegaConf.to_container(cfg.tree, resolve=True)
    context = {"runtime": pair.runtime, "middle_runtime": pair.middle_runtime, **engines_of(pair).info(),
               "tree_shape": cfg.tree.shape, "budget_setting": str(cfg.tree.budget),
               # bfloat16_packed: products wider than this many rows ran on oneDNN's copy (None: one kernel)
               "bf16_onednn_above": getattr(pair.target, "treegraft_bf16_max_rows", None),
               **machine_info(devices_of(pair.target, pair.middle))}
    target_fp32 = pair.target if pair.runtime in ("float32", "float32_packed") else None
    on_llama = engines_of(pair).name == "llama_cpp"
    reuses = []
    if on_llama and e.get("share_prefill", True):  # one encoding of each prompt per model, charged to every method
        from ..engines.llama_cpp import PromptReuse

        for model in [pair.target] + [pair.middle] * (pair.middle is not None and pair.middle is not pair.target):
            model.prompt_reuse = PromptReuse()
            reuses.append(model.prompt_reuse)
    context["prefill_shared"] = bool(reuses)
    wanted = {(b, m): method_prompts(cfg, m, prompts[b]) for b in benchmarks for m in methods}
    missing = {k: [q for q, _ in v if q not in saved[k]] for k, v in wanted.items()}
    todo = [m for m in methods if any(missing[b, m] for b in benchmarks)]
    warm_ids = prompts[benchmarks[0]][0][1]
    decoders, contexts = {}, {}
    for method in sorted(todo, key=lambda m: "@" in m):  # every warm-up before any timing; variants after their base
        base, scales = parse_method(method)
        small = small_for(cfg, method)
        dec = decoder_for(base, pair, tree, sampling, schedulers.get(base), cfg.paths.cache_dir, small=small)
        if isinstance(dec, TreeGraftDecoder) and dec.middle is not None:
            if scales and base in decoders:  # a sensitivity variant: its base's calibrated context, rescaled
                dec.generate(warm_ids, int(p.warmup_tokens))
                dec.t_tgt_ms, dec.t_mid_ms = decoders[base].t_tgt_ms, decoders[base].t_mid_ms
            else:  # runtime context: medians over repeated all-call warm-ups, not scored
                dec.warm_up(warm_ids, int(p.warmup_tokens), repeats=int(p.warmup_repeats))
            dec.t_tgt_ms *= scales.get("t_tgt", 1.0)
            dec.t_mid_ms *= scales.get("t_mid", 1.0)
            sched = schedulers.get(base)
            if hasattr(sched, "for_context"):  # the cost-aware fallback: the schedule this context picks
                sched = sched.for_context(dec.t_tgt_ms, dec.t_mid_ms)
            contexts[method] = {"t_tgt_ms": dec.t_tgt_ms, "t_mid_ms": dec.t_mid_ms,
                                "scheduler_policy": getattr(sched, "policy_name", None)}
        if isinstance(dec, TreeGraftDecoder):  # which small drafter the tree method drafted with
            contexts.setdefault(method, {})["small_drafter"] = (small or {}).get("name", "ngram") + (
                f":{small['layers']}" if (small or {}).get("layers") else "")
        else:
            dec.generate(warm_ids, int(p.warmup_tokens))  # warm-up, not scored
        decoders[method] = dec
    for reuse in reuses:
        reuse.forget()  # every decoder's score request is known now; timed prompts are encoded afresh
    for bench in pulled:
        records = {m: dict(saved[bench, m]) for m in methods}
        for k, (qid, ids) in enumerate(prompts[bench]):  # methods interleaved prompt by prompt: drift hits all alike
            fresh = [m for m in rotated_order(methods, k) if qid in missing[bench, m]]
            for method in fresh:
                result = decoders[method].generate(ids, int(e.max_new_tokens))
                text = pair.tokenizer.decode(result.tokens, skip_special_tokens=True)
                record = make_record(pair_name, bench, method, qid, result, text, {**context, **contexts.get(method, {})},
                                     categories[bench].get(qid, ""))
                record.update(prompt_ids=ids, run_key=keys[method])
                if method != "ar" and sampling.greedy:
                    rep = compare_outputs(records["ar"][qid]["tokens"], record["tokens"], ids, target_fp32,
                                          float(e.tie_tolerance))
                    record["matches_ar"], record["mismatch_explained"] = rep.equal, rep.explained_by_tie
                    if not rep.equal:
                        record["mismatch_position"] = rep.position
                        # a float32 near-tie check (PyTorch) is left to explain_mismatches, after the workers; on
                        # llama.cpp the exact kernels leave no mismatch to explain and the stock ones round by
                        # batch: a mismatch there is reported as it is
                        if target_fp32 is None and not on_llama:
                            record["mismatch_explained"] = None  # pending
                records[method][qid] = record
                progress(1)
            for method in fresh:
                _write_records([records[method][q] for q, _ in wanted[bench, method] if q in records[method]],
                               paths[bench, method])


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


def size_by_precision(cfg: DictConfig, progress, console) -> dict:
    """Evaluate in rounds: ``evaluation.prompts_per_benchmark`` prompts per benchmark first, then
    ``round_prompts`` more a round (records of earlier rounds are kept), until the headline CI's
    half-width (:func:`main_interval`) is at most ``target_half_width`` (with at least
    ``MIN_PROMPTS_FOR_CI`` and ``min_prompts_per_benchmark`` prompts per benchmark), or ``max_prompts_per_benchmark``
    is reached, or the next round would end past ``time_budget_min`` (predicted from the last round's
    seconds per prompt). Returns what it reached, also written to ``evaluate/precision.json``."""
    e = cfg.evaluation
    out_dir = stage_dir(cfg.paths.output_dir, cfg.pipeline.name, "evaluate")
    target = float(e.target_half_width)
    n = int(e.prompts_per_benchmark)
    top = max(n, int(e.get("max_prompts_per_benchmark") or n))
    step = max(1, int(e.get("round_prompts") or 2))
    least = max(MIN_PROMPTS_FOR_CI, int(e.get("min_prompts_per_benchmark") or 0))
    budget_s = 60 * float(e.time_budget_min) if e.get("time_budget_min") else math.inf
    start, done, rounds = now(), 0, []
    while True:
        t0 = now()
        with open_dict(cfg):
            cfg.evaluation.prompts_per_benchmark = n
        _evaluate_prompts(cfg, progress)
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


@one_thread_with_workers
def run_evaluate(cfg: DictConfig, progress=None) -> pd.DataFrame:
    """Every method on every pair x benchmark, then the summary with CIs; sized by precision when
    ``evaluation.target_half_width`` is set (:func:`size_by_precision`). ``progress(n)``: advance an outer
    progress bar by n (prompt, method) generations (else one bar here)."""
    console = Console(width=200, stderr=True)
    p = cfg.pipeline
    out_dir = stage_dir(cfg.paths.output_dir, p.name, "evaluate")
    if cfg.evaluation.get("target_half_width") is not None:
        if not shard_from(cfg).whole:
            raise ValueError(f"evaluation.target_half_width={cfg.evaluation.target_half_width} sizes the evaluation by "
                             f"its headline CI, which one prompt range cannot see; shard.count={cfg.shard.count} expects "
                             "evaluation.target_half_width=null (a fixed evaluation.prompts_per_benchmark)")
        size_by_precision(cfg, progress, console)
    else:
        _evaluate_prompts(cfg, progress)
    return _summarize(cfg, out_dir, console)


def _evaluate_prompts(cfg: DictConfig, progress=None) -> None:
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
    bases = dict.fromkeys(parse_method(m)[0] for m in methods)
    schedulers = {m: load_learned_scheduler(m, artifacts) for m in bases if m in LEARNED_METHODS}
    if not shard.whole or cfg.get("pair") or cfg.get("data"):
        console.print(f"evaluate job: {', '.join(eval_pairs(cfg))} x {', '.join(benchmarks)}, {shard}")
    for pair_name in eval_pairs(cfg):
        jobs = [(b, m) for b in benchmarks for m in methods]
        # a sharded job writes files of its own (shard.suffix): two jobs never write the same file
        paths = {(b, m): out_dir / pair_name / b / f"{m}{shard.suffix}.jsonl" for b, m in jobs}
        keys = {m: run_key(cfg, pair_name, m, artifacts) for m in methods}
        spec = pair_spec(pair_name)
        tokenizer = load_tokenizer(spec.target, cfg.paths.models_dir)  # prompts without loading the models
        prompts = {b: shard.take(stage_prompts(cfg, tokenizer, b, int(e.prompts_per_benchmark), offset)) for b in benchmarks}
        categories = {b: {int(r["question_id"]): r["category"] for r in stage_records(cfg, b, int(e.prompts_per_benchmark), offset)}
                      for b in benchmarks}
        # done before an interruption
        saved = {(b, m): _saved_records(paths[b, m], keys[m], method_prompts(cfg, m, prompts[b])) for b, m in jobs}
        todo_benches = [b for b in benchmarks if any(q not in saved[b, m] for m in methods
                                                     for q, _ in method_prompts(cfg, m, prompts[b]))]
        if not todo_benches:
            console.print(f"{pair_name}: every record is saved and up to date")
            explain_mismatches(cfg, spec, sorted(set(paths.values())), console)  # any an interruption left pending
            continue
        units = {b: sum(q not in saved[b, m] for m in methods for q, _ in method_prompts(cfg, m, prompts[b]))
                 for b in todo_benches}
        cost = {b: units[b] * (1 + sum(len(ids) for _, ids in prompts[b]) / 1000) for b in todo_benches}
        on_gpus = torch.device(p.device).type == "cuda" and int(p.get("workers") or 1) > 1
        if on_gpus:  # one spawned worker per GPU (group), each loading its own pair (refused here if too few GPUs)
            groups = gpu_worker_groups(p.workers, p.get("gpus_per_worker", 1))[: len(todo_benches)]
            workers = len(groups)
        else:
            pair = load_engine_pair(spec, cfg, log=console.print, device=p.device, dtype=p.dtype)
            workers = min(engines_of(pair).workers(p.workers), len(todo_benches))
        bar = None
        if progress is None:
            bar = tqdm(total=sum(units.values()), desc=f"evaluate {pair_name} ({workers} worker(s))", file=sys.stderr)
        if on_gpus:
            context = (OmegaConf.to_container(cfg, resolve=True), pair_name, todo_benches, prompts, categories, saved,
                       paths, keys, methods, str(artifacts), sampling)
            spawn_pull(_evaluate_on_gpus, [context] * workers, groups, todo_benches, [cost[b] for b in todo_benches],
                       progress or bar.update)
        else:
            reset_peak_memory(devices_of(pair.target, pair.middle))
            fork_pull(lambda pull, report: _evaluate_benchmarks(cfg, pair, pair_name, todo_benches, pull, prompts,
                                                                categories, saved, paths, keys, methods, schedulers,
                                                                sampling, report),
                      todo_benches, [cost[b] for b in todo_benches], workers, progress or bar.update)
            _record_gpu_peak(pair, out_dir / pair_name, console)
            del pair
        if bar is not None:
            bar.close()
        return_freed_memory()
        explain_mismatches(cfg, spec, sorted(set(paths.values())), console)


def _record_gpu_peak(pair, folder: Path, console=None) -> None:
    """The peak GPU memory of a pair's evaluation, per device, in ``gpu_memory[.<gpus>].json`` (nothing on a CPU)."""
    import os

    peak = peak_memory(devices_of(pair.target, pair.middle))
    if not peak:
        return
    gpus = os.environ.get("CUDA_VISIBLE_DEVICES")
    info = {"pair": pair.spec.name, "peak_bytes": peak, "cuda_visible_devices": gpus,
            **machine_info(devices_of(pair.target, pair.middle))}
    atomic_write_json(info, folder / (f"gpu_memory.{gpus.replace(',', '-')}.json" if gpus else "gpu_memory.json"))
    if console is not None:
        console.print(f"{pair.spec.name}: peak GPU memory " + ", ".join(f"{d} {b / 1e9:.1f} GB" for d, b in peak.items()))


def _evaluate_on_gpus(context: tuple, pull, report) -> None:
    """One spawned GPU worker of :func:`_evaluate_prompts`: its own pair on the GPUs it sees, then the
    benchmarks it pulls (the same :func:`_evaluate_benchmarks` as a forked worker)."""
    cfg_dict, pair_name, benchmarks, prompts, categories, saved, paths, keys, methods, artifacts, sampling = context
    cfg = OmegaConf.create(cfg_dict)
    bases = dict.fromkeys(parse_method(m)[0] for m in methods)
    schedulers = {m: load_learned_scheduler(m, Path(artifacts)) for m in bases if m in LEARNED_METHODS}
    pair = load_engine_pair(pair_spec(pair_name), cfg, log=print, device=cfg.pipeline.device, dtype=cfg.pipeline.dtype)
    reset_peak_memory(devices_of(pair.target, pair.middle))
    _evaluate_benchmarks(cfg, pair, pair_name, benchmarks, pull, prompts, categories, saved, paths, keys, methods,
                         schedulers, sampling, report)
    _record_gpu_peak(pair, paths[benchmarks[0], methods[0]].parent.parent)


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
            _write_records(records, path)
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
        _write_records(records, path)
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
