"""Stage `evaluate` (SPEC 6): every method on every pair x benchmark, one record per prompt.

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
import sys
import time
from pathlib import Path

import pandas as pd
from omegaconf import DictConfig, OmegaConf
from rich.console import Console
from tqdm.auto import tqdm

from ..data import spec_bench_category
from ..decoding.equality import compare_outputs
from ..decoding.factory import LEARNED_ARTIFACTS, LEARNED_METHODS, build_decoder, load_learned_scheduler
from ..decoding.sampling import SamplingConfig
from ..decoding.tree_decoder import TreeGraftDecoder
from ..machine import cpu_info, cpu_line
from ..models import load_model, load_pair, load_tokenizer
from ..models.runtime import effective_runtime
from .artifacts import atomic_write_parquet, atomic_write_text, file_hash, record_stage, stage_dir
from .common import fold_intervals, pair_spec, print_table, stage_prompts, stage_records
from .estimates import method_intervals
from .parallel import fork_map, split_jobs, one_thread_with_workers
from .tracking import stage_logger

__all__ = ["run_evaluate", "make_record", "summarize_records", "read_records", "eval_pairs", "run_key", "method_prompts",
           "evaluation_units"]


def eval_pairs(cfg: DictConfig) -> list[str]:
    if cfg.get("pair"):  # a sweep job: one pair
        return [cfg.pair.name]
    p = cfg.pipeline
    pairs = list(p.eval_pairs) if p.get("eval_pairs") else list(p.pairs)
    return pairs + [h for h in (p.held_out_pairs or []) if h not in pairs]


def make_record(pair: str, benchmark: str, method: str, question_id: int, result, text: str,
                context: dict | None = None, category: str = "") -> dict:
    """One Spec-Bench/FastChat answer record; ``context``: what it was measured on (runtime, tree
    shape, CPU line), copied into the record; ``category``: the question file's own category.

    ``accept_lengths`` (tokens per target forward, bonus included) come from the turns of the tree
    methods and of the HF peers, and are 1 per token for ``ar``; the field is left out where a
    method reports no steps."""
    turns = result.turns
    choice = {"index": 0, "turns": [text], "new_tokens": [result.new_tokens], "wall_time": [result.wall_time_s]}
    if turns:
        lengths = [t["accepted"] + 1 for t in turns]
        lengths[-1] -= max(0, sum(lengths) - result.new_tokens)  # the last turn may be cut at EOS / max_new_tokens
        choice["accept_lengths"] = lengths
    elif method == "ar":
        choice["accept_lengths"] = [1] * result.new_tokens
    split = {k: sum(t.get(k, 0.0) for t in turns) for k in ("small_s", "middle_s", "verify_s", "other_s")}
    budgets = [t["budget"] for t in turns if "budget" in t]
    model_id = f"{pair}/{method}"
    return {
        "question_id": question_id,
        "answer_id": hashlib.sha256(f"{model_id}/{benchmark}/{question_id}".encode()).hexdigest()[:22],
        "model_id": model_id,
        "category": spec_bench_category(benchmark, category),
        "method": method,
        "pair": pair,
        "benchmark": benchmark,
        "choices": [choice],
        "tokens": result.tokens,
        "prompt_tokens": result.prompt_tokens,
        "stop_reason": result.stop_reason,
        "turns": len(turns),
        "accepted": [t["accepted"] for t in turns],
        "middle_calls": sum(t.get("middle_calls", 0) for t in turns),
        "steps": sum(len(t.get("schedule", ())) for t in turns),
        "time_split": split,
        "mean_budget": sum(budgets) / len(budgets) if budgets else None,  # B_ver verified per turn
        "prefill_s": result.prefill_time_s,
        **(context or {}),
        "tstamp": time.time(),
    }


def read_records(eval_dir: Path) -> pd.DataFrame:
    """Every record under ``eval_dir`` as a flat frame (one row per prompt x method)."""
    rows = []
    for path in sorted(Path(eval_dir).glob("*/*/*.jsonl")):
        for line in path.read_text().splitlines():
            r = json.loads(line)
            c = r["choices"][0]
            rows.append({
                "pair": r["pair"], "benchmark": r["benchmark"], "method": r["method"], "question_id": r["question_id"],
                "new_tokens": c["new_tokens"][0], "wall_time": c["wall_time"][0], "turns": r["turns"],
                "accepted_sum": sum(r["accepted"]), "middle_calls": r["middle_calls"], "steps": r["steps"],
                **{f"t_{k}": v for k, v in r["time_split"].items()},
                "matches_ar": r.get("matches_ar"), "mismatch_explained": r.get("mismatch_explained"),
                "mean_budget": r.get("mean_budget"), "runtime": r.get("runtime"), "tree_shape": r.get("tree_shape"),
                "cpu": r.get("cpu"), "cpu_capability": r.get("cpu_capability"),
                "bf16_onednn_above": r.get("bf16_onednn_above"),
            })
    if not rows:
        raise FileNotFoundError(f"no evaluation records under {eval_dir}")
    return pd.DataFrame(rows)


def summarize_records(records: pd.DataFrame) -> pd.DataFrame:
    """One row per pair x benchmark x method: speedup vs ar (ratio of total wall times on the same
    prompts), tokens/s, mean AL, tau (tokens per turn), call rate, time split, mismatch counts."""
    out = []
    for (pair, bench), g in records.groupby(["pair", "benchmark"], sort=False):
        ar = g[g["method"] == "ar"].set_index("question_id")["wall_time"]
        for method, m in g.groupby("method", sort=False):
            # ar's time on the same prompts (an ablation may run on a subset)
            same = m["question_id"].isin(ar.index)
            ar_wall = float(ar.loc[m.loc[same, "question_id"]].sum()) if same.all() and len(ar) else float("nan")
            turns = m["turns"].sum()
            spent = sum(m[f"t_{k}"].sum() for k in ("small_s", "middle_s", "verify_s", "other_s"))
            row = {
                "pair": pair, "benchmark": bench, "method": method, "prompts": len(m),
                "new_tokens": int(m["new_tokens"].sum()), "wall_s": float(m["wall_time"].sum()),
                "tokens_per_s": float(m["new_tokens"].sum() / m["wall_time"].sum()),
                "speedup": float(ar_wall / m["wall_time"].sum()) if ar_wall == ar_wall else float("nan"),
                "mean_al": float(m["accepted_sum"].sum() / turns) if turns else float("nan"),
                "tau": float(m["new_tokens"].sum() / turns) if turns else float("nan"),
                "call_rate": float(m["middle_calls"].sum() / m["steps"].sum()) if m["steps"].sum() else float("nan"),
                "mean_budget": float(m["mean_budget"].mean()) if m["mean_budget"].notna().any() else float("nan"),
                "runtime": m["runtime"].iloc[0], "tree_shape": m["tree_shape"].iloc[0], "cpu": m["cpu"].iloc[0],
                "cpu_capability": m["cpu_capability"].iloc[0],
                "mismatches": int((m["matches_ar"] == False).sum()),  # noqa: E712 (None = not compared)
                "mismatches_unexplained": int(((m["matches_ar"] == False) & (m["mismatch_explained"] != True)).sum()),  # noqa: E712
            }
            for k in ("small_s", "middle_s", "verify_s", "other_s"):
                row[f"share_{k[:-2]}"] = float(m[f"t_{k}"].sum() / spent) if spent else float("nan")
            out.append(row)
    return pd.DataFrame(out)


def _write_records(records: list[dict], path: Path) -> None:
    atomic_write_text("".join(json.dumps(r) + "\n" for r in records), path)


def run_key(cfg: DictConfig, pair: str, method: str, offset: int, artifacts: Path) -> str:
    """What a method's records depend on: the tree and evaluation settings, dtype, device, the
    prompts' offset and, for the learned methods, the scheduler artifacts. Saved records are reused
    only under the same key (a changed config or a refitted scheduler redoes them)."""
    e = OmegaConf.to_container(cfg.evaluation, resolve=True)
    for k in ("methods", "benchmarks"):
        e.pop(k, None)
    parts = {"pair": pair, "method": method, "offset": offset, "evaluation": e,
             "tree": OmegaConf.to_container(cfg.tree, resolve=True), "dtype": cfg.pipeline.dtype,
             "runtime": cfg.runtime, "middle_runtime": cfg.middle_runtime, "cpu": cpu_line(),
             "device": cfg.pipeline.device, "warmup_tokens": cfg.pipeline.warmup_tokens}
    if method in LEARNED_ARTIFACTS:
        parts["artifacts"] = {name: file_hash(artifacts / name) for name in LEARNED_ARTIFACTS[method]}
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _saved_records(path: Path, key: str, prompts: list[tuple[int, list[int]]]) -> list[dict] | None:
    """The records of an earlier run with the same key and the same prompts (question ids and token
    ids, so a changed prompt format redoes them), else None (missing or stale)."""
    if not path.exists():
        return None
    records = [json.loads(line) for line in path.read_text().splitlines()]
    same_prompts = [(r.get("question_id"), r.get("prompt_ids")) for r in records] == [(q, list(ids)) for q, ids in prompts]
    return records if same_prompts and all(r.get("run_key") == key for r in records) else None


def method_prompts(cfg: DictConfig, method: str, prompts: list) -> list:
    """The prompts a method is evaluated on: all, or for an ablation with ``evaluation.ablation_prompts``
    = k, the first k of each benchmark (``ar`` runs on every prompt, so each has its reference)."""
    e = cfg.evaluation
    if e.get("ablation_prompts") is not None and method in (e.get("ablations") or []):
        return prompts[: int(e.ablation_prompts)]
    return prompts


def evaluation_units(cfg: DictConfig, prompts: dict[str, list], methods: list[str]) -> int:
    """(prompt, method) generations of one pair (the unit of the progress bar)."""
    return sum(len(method_prompts(cfg, m, prompts[b])) for b in prompts for m in methods)


def _evaluate_benchmarks(cfg, pair, pair_name: str, benchmarks: list[str], prompts, categories, saved, paths, keys,
                         methods, schedulers, sampling, progress) -> None:
    """One worker's share: build and warm up every decoder it needs, then for each benchmark run the
    missing methods interleaved prompt by prompt, compare with ``ar`` and write the records."""
    p, e = cfg.pipeline, cfg.evaluation
    tree = OmegaConf.to_container(cfg.tree, resolve=True)
    context = {"runtime": pair.runtime, "middle_runtime": pair.middle_runtime, "tree_shape": cfg.tree.shape, "budget_setting": str(cfg.tree.budget),
               # bfloat16_packed: products wider than this many rows ran on oneDNN's copy (None: one kernel)
               "bf16_onednn_above": getattr(pair.target, "treegraft_bf16_max_rows", None),
               **cpu_info()}
    target_fp32 = pair.target if pair.runtime in ("float32", "float32_packed") else None
    todo = [m for m in methods if any(saved[b, m] is None for b in benchmarks)]
    warm_ids = prompts[benchmarks[0]][0][1]
    decoders = {}
    for method in todo:  # every warm-up before any timing
        dec = build_decoder(method, pair, tree, sampling, schedulers.get(method), cfg.paths.cache_dir)
        if isinstance(dec, TreeGraftDecoder) and dec.middle is not None:
            dec.warm_up(warm_ids, int(p.warmup_tokens))  # runtime context + warm-up, not scored
        else:
            dec.generate(warm_ids, int(p.warmup_tokens))  # warm-up, not scored
        decoders[method] = dec
    for bench in benchmarks:
        fresh = [m for m in methods if saved[bench, m] is None]
        records = {m: saved[bench, m] for m in methods if m not in fresh}
        records.update({m: [] for m in fresh})
        for i, (qid, ids) in enumerate(prompts[bench]):  # methods interleaved prompt by prompt: drift hits all alike
            for method in fresh:
                if i >= len(method_prompts(cfg, method, prompts[bench])):
                    continue
                result = decoders[method].generate(ids, int(e.max_new_tokens))
                text = pair.tokenizer.decode(result.tokens, skip_special_tokens=True)
                records[method].append(make_record(pair_name, bench, method, qid, result, text, context,
                                                   categories[bench].get(qid, "")))
                records[method][-1].update(prompt_ids=ids, run_key=keys[method])
                progress(1)
        reference = {r["question_id"]: r["tokens"] for r in records["ar"]}
        for method in fresh:
            if method != "ar" and sampling.greedy:
                for r in records[method]:
                    ref = reference[r["question_id"]]
                    if r["tokens"] != ref and target_fp32 is None:
                        target_fp32 = load_model(pair.spec.target, "float32", p.device, cfg.paths.models_dir)
                    rep = compare_outputs(ref, r["tokens"], r["prompt_ids"], target_fp32, float(e.tie_tolerance))
                    r["matches_ar"], r["mismatch_explained"] = rep.equal, rep.explained_by_tie
            _write_records(records[method], paths[bench, method])


@one_thread_with_workers
def run_evaluate(cfg: DictConfig, progress=None) -> pd.DataFrame:
    """``progress(n)``: advance an outer progress bar by n (prompt, method) generations (else one bar here)."""
    console = Console(width=200, stderr=True)
    p, e = cfg.pipeline, cfg.evaluation
    out_dir = stage_dir(cfg.paths.output_dir, p.name, "evaluate")
    artifacts = stage_dir(cfg.paths.output_dir, p.name, "distill").parent
    sampling = SamplingConfig(temperature=float(e.temperature), top_p=float(e.top_p), seed=int(e.seed))
    methods = list(e.methods)
    methods = ["ar"] + [m for m in methods if m != "ar"]  # ar: the reference of speedup and equality
    benchmarks = [cfg.data.name] if cfg.get("data") else list(e.benchmarks)
    offset = int(e.prompt_offset) if e.prompt_offset is not None else int(p.prompt_offset) + int(p.prompts_per_benchmark)
    schedulers = {m: load_learned_scheduler(m, artifacts) for m in methods if m in LEARNED_METHODS}
    for pair_name in eval_pairs(cfg):
        jobs = [(b, m) for b in benchmarks for m in methods]
        paths = {(b, m): out_dir / pair_name / b / f"{m}.jsonl" for b, m in jobs}
        keys = {m: run_key(cfg, pair_name, m, offset, artifacts) for m in methods}
        spec = pair_spec(pair_name)
        tokenizer = load_tokenizer(spec.target, cfg.paths.models_dir)  # prompts without loading the models
        prompts = {b: stage_prompts(cfg, tokenizer, b, int(e.prompts_per_benchmark), offset) for b in benchmarks}
        categories = {b: {int(r["question_id"]): r["category"] for r in stage_records(cfg, b, int(e.prompts_per_benchmark), offset)}
                      for b in benchmarks}
        # done before an interruption
        saved = {(b, m): _saved_records(paths[b, m], keys[m], method_prompts(cfg, m, prompts[b])) for b, m in jobs}
        todo_benches = [b for b in benchmarks if any(saved[b, m] is None for m in methods)]
        if not todo_benches:
            console.print(f"{pair_name}: every record is saved and up to date")
            continue
        pair = load_pair(spec, device=p.device, models_dir=cfg.paths.models_dir,
                         runtime=effective_runtime(cfg.runtime, p.dtype), cache_dir=cfg.paths.cache_dir,
                         log=console.print, middle_runtime=cfg.middle_runtime)
        units = {b: sum(len(method_prompts(cfg, m, prompts[b])) for m in methods if saved[b, m] is None)
                 for b in todo_benches}
        cost = {b: units[b] * (1 + sum(len(ids) for _, ids in prompts[b]) / 1000) for b in todo_benches}
        groups = split_jobs(todo_benches, [cost[b] for b in todo_benches], int(p.workers))
        bar = None
        if progress is None:
            bar = tqdm(total=sum(units.values()), desc=f"evaluate {pair_name} ({len(groups)} worker(s))", file=sys.stderr)
        fork_map(lambda group, report: _evaluate_benchmarks(cfg, pair, pair_name, group, prompts, categories, saved,
                                                            paths, keys, methods, schedulers, sampling, report),
                 groups, progress or bar.update)
        if bar is not None:
            bar.close()
        del pair
    # the summary covers every record in the folder, so the jobs of a sweep aggregate into one table
    records = read_records(out_dir)
    summary = summarize_records(records)
    atomic_write_parquet(summary, out_dir / "summary.parquet")
    intervals = method_intervals(records, int(p.bootstrap_resamples))
    atomic_write_parquet(intervals, out_dir / "intervals.parquet")
    record_stage(out_dir, OmegaConf.to_yaml(cfg, resolve=True), [])
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
