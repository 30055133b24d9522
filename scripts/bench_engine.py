"""Benchmark the decoding engine on one pair: methods side by side on real prompts (not a test).

Run:
    python scripts/bench_engine.py pair=qwen-coder-1.5b__0.5b prompts_per_benchmark=3 max_new_tokens=64
    python scripts/bench_engine.py pair=smollm2-135m__self dtype=bfloat16 methods=[ar,all_small]
    python scripts/bench_engine.py pair=tiny-random prompts_per_benchmark=1 max_new_tokens=16 max_prompt_tokens=256

Spec-Bench style: a warm-up generation per method first (not scored), then every prompt with every
method; greedy; speedup = ar's total time / the method's total time over the same prompts.
Prints one table (method, tokens/s, speedup vs ar, mean AL, middle ms/call, n-gram ms/call,
share of turn time outside model forwards, mismatches vs ar), the target's verification-latency
curve, and the n-gram drafter's cost per call at a long context. Writes
outputs/bench/<pair>/engine.csv (one row per method and dtype) and verify_curve.csv.
"""

from __future__ import annotations

import hashlib
import json
import random
import statistics
import sys
import time
from pathlib import Path

import hydra
import pandas as pd
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from rich.console import Console
from rich.table import Table
from tqdm.auto import tqdm

from treegraft.config import CONF_DIR
from treegraft.data import BenchmarkConfig, format_prompt, load_benchmark
from treegraft.decoding.budget import measure_verify_curve
from treegraft.decoding.equality import compare_outputs
from treegraft.decoding.factory import build_decoder
from treegraft.decoding import GenerationResult, TreeGraftDecoder
from treegraft.decoding.factory import tree_config_from
from treegraft.drafters import NGramConfig, NGramDrafter
from treegraft.scheduling import FixedScheduler
from treegraft.models import load_model, load_pair


def load_prompts(cfg: DictConfig, tokenizer) -> list[tuple[str, int, list[int]]]:
    prompts = []
    for name in cfg.benchmarks:
        ds = load_benchmark(BenchmarkConfig(name=name, benchmarks_dir=cfg.paths.benchmarks_dir,
                                            num_prompts=cfg.prompts_per_benchmark))
        for rec in ds:
            text = format_prompt(tokenizer, rec["turns"][0])
            ids = tokenizer(text, add_special_tokens=False).input_ids
            if cfg.max_prompt_tokens:
                ids = ids[-cfg.max_prompt_tokens :]
            prompts.append((name, rec["question_id"], ids))
    return prompts


def ngram_cost_ms(tokens: list[int], top_m: int, calls: int = 2000, seed: int = 0) -> float:
    """Mean ms per `propose` call with a context of len(tokens), on random paths of depth 0..4."""
    drafter = NGramDrafter(NGramConfig(top_m=top_m))
    n = len(tokens)
    gen = torch.Generator().manual_seed(seed)
    drafter.reset(tokens, torch.randint(0, 1000, (n - 1, top_m), generator=gen), -torch.rand(n - 1, top_m, generator=gen))
    rng = random.Random(seed)
    paths = []
    for _ in range(calls):
        start = rng.randrange(0, n - 5)
        paths.append(tokens[start : start + rng.randrange(0, 5)])
    t0 = time.perf_counter()
    for path in paths:
        drafter.propose(path)
    return (time.perf_counter() - t0) / calls * 1000


def save_run(path: Path, key: dict, results: list) -> None:
    """One method's outputs and times, so a later invocation can reuse them (e.g. ar as the reference)."""
    data = {"key": key, "results": [{"tokens": r.tokens, "prompt_tokens": r.prompt_tokens, "wall_time_s": r.wall_time_s,
                                     "prefill_time_s": r.prefill_time_s, "stop_reason": r.stop_reason,
                                     "turns": r.turns} for r in results]}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)


def load_run(path: Path, key: dict) -> list | None:
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    if data["key"] != key:
        return None
    return [GenerationResult(**r) for r in data["results"]]


class SignalTimer(FixedScheduler):
    """The fixed schedule, but asking for the tree signals so their cost shows in `schedule_s`."""

    needs_signals = True


def signals_cost_ms(pair, tree: dict, prompts, max_new_tokens: int) -> float:
    """Mean ms per step to compute the scheduler state with all tree signals, on real trees."""
    cfg = tree_config_from("fixed", tree)
    dec = TreeGraftDecoder(pair.target, pair.middle, pair.tokenizer, cfg, scheduler=SignalTimer(cfg.actions()))
    turns = [t for _, _, ids in prompts for t in dec.generate(ids, max_new_tokens).turns]
    steps = sum(len(t["schedule"]) for t in turns)
    return 1000 * sum(t.get("schedule_s", 0.0) for t in turns) / max(steps, 1)


def summarize(method: str, results: list, ar_time: float | None, reports: list, decoder=None) -> dict:
    new_tokens = sum(r.new_tokens for r in results)
    wall = sum(r.wall_time_s for r in results)
    turns = [t for r in results for t in r.turns]
    def per_call(key_s, key_n):
        n = sum(t.get(key_n, 0) for t in turns)
        return 1000 * sum(t.get(key_s, 0.0) for t in turns) / n if n else float("nan")
    turn_s = sum(t["turn_s"] for t in turns)
    steps = sum(len(t.get("schedule", ())) for t in turns)
    budget = decoder.budget() if isinstance(decoder, TreeGraftDecoder) else None
    return {
        "method": method,
        "prompts": len(results),
        "new_tokens": new_tokens,
        "wall_s": round(wall, 2),
        "tokens_per_s": new_tokens / wall if wall else float("nan"),
        "speedup": (ar_time / wall) if ar_time else float("nan"),
        "mean_al": statistics.mean(t["accepted"] for t in turns) if turns else float("nan"),
        "budget": budget,
        # middle-drafter forwards per drafting step (steps left out as beyond the budget count as skips)
        "call_rate": sum(t["middle_calls"] for t in turns) / steps if steps else float("nan"),
        "mean_tree_nodes": statistics.mean(t["tree_nodes"] for t in turns) if turns else float("nan"),
        "middle_ms_per_call": per_call("middle_s", "middle_calls"),
        # n-gram lookups only; small_s also holds the per-turn update of the target top-m score cache
        "ngram_ms_per_call": per_call("small_propose_s", "small_calls"),
        "outside_share": sum(t["outside_forward_s"] for t in turns) / turn_s if turn_s else float("nan"),
        "mismatches": sum(not rep.equal for rep in reports),
        "mismatches_unexplained": sum(not rep.equal and not rep.explained_by_tie for rep in reports),
    }


def write_csv(csv: Path, df: pd.DataFrame, dtype: str) -> None:
    """Atomically write the rows, replacing earlier rows of the same dtype and method."""
    if csv.exists():
        old = pd.read_csv(csv)
        old = old[~((old["dtype"] == dtype) & old["method"].isin(df["method"]))]
        df = pd.concat([old, df], ignore_index=True)
    tmp = csv.with_suffix(".csv.tmp")
    df.to_csv(tmp, index=False)
    tmp.replace(csv)


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="bench_engine")
def main(cfg: DictConfig) -> None:
    console = Console(width=160)
    torch.manual_seed(0)
    out_dir = Path(cfg.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    pair = load_pair(instantiate(cfg.pair), dtype=cfg.dtype, device=cfg.device, models_dir=cfg.paths.models_dir)
    tree = OmegaConf.to_container(cfg.tree, resolve=True)
    prompts = load_prompts(cfg, pair.tokenizer)
    console.print(f"{len(prompts)} prompts, {cfg.max_new_tokens} new tokens, dtype {cfg.dtype}, pair {cfg.pair.name}")

    target_fp32 = pair.target if cfg.dtype == "float32" else None
    outputs: dict[str, list] = {}
    rows = []
    runs_dir = out_dir / f"runs_{cfg.dtype}"
    runs_dir.mkdir(exist_ok=True)
    prompt_hash = hashlib.sha256(json.dumps([ids for _, _, ids in prompts]).encode()).hexdigest()[:16]
    methods = list(cfg.methods)
    if "ar" not in methods:
        ar_prev = load_run(runs_dir / "ar.json", {"prompts": prompt_hash, "max_new_tokens": cfg.max_new_tokens,
                                                  "tree": None})
        if ar_prev is not None:  # the reference from an earlier invocation on the same prompts
            outputs["ar"] = ar_prev
            console.print("ar: reusing the saved reference run")
    for method in methods:
        decoder = build_decoder(method, pair, tree)
        key = {"prompts": prompt_hash, "max_new_tokens": cfg.max_new_tokens,
               "tree": tree if isinstance(decoder, TreeGraftDecoder) else None}
        results = load_run(runs_dir / f"{method}.json", key) if cfg.resume else None
        if results is None:
            decoder.generate(prompts[0][2], 8)  # warm-up, not scored
            results = [decoder.generate(ids, cfg.max_new_tokens)
                       for _, _, ids in tqdm(prompts, desc=method, file=sys.stderr)]
            save_run(runs_dir / f"{method}.json", key, results)
        else:
            console.print(f"{method}: reusing the saved run")
        outputs[method] = results
        reports = []
        if method != "ar" and "ar" in outputs:
            if target_fp32 is None and any(r.tokens != a.tokens for r, a in zip(results, outputs["ar"])):
                target_fp32 = load_model(cfg.pair.target, "float32", cfg.device, cfg.paths.models_dir)
            reports = [compare_outputs(a.tokens, r.tokens, ids, target_fp32, cfg.tie_tolerance)
                       for (_, _, ids), r, a in zip(prompts, results, outputs["ar"])]
        ar_time = sum(r.wall_time_s for r in outputs["ar"]) if "ar" in outputs else None
        rows.append({"dtype": cfg.dtype, **summarize(method, results, ar_time, reports, decoder)})
        console.print(rows[-1])
        write_csv(out_dir / "engine.csv", pd.DataFrame(rows), cfg.dtype)

    df = pd.DataFrame(rows)
    table = Table(title=f"engine on {cfg.pair.name} ({cfg.dtype}, {len(prompts)} prompts x {cfg.max_new_tokens} tokens)")
    cols = ["method", "tokens_per_s", "speedup", "mean_al", "call_rate", "budget", "middle_ms_per_call",
            "ngram_ms_per_call", "outside_share", "mismatches", "mismatches_unexplained"]
    for c in cols:
        table.add_column(c)
    for _, r in df.iterrows():
        table.add_row(*[f"{r[c]:.3f}" if isinstance(r[c], float) else str(r[c]) for c in cols])
    console.print(table)

    if cfg.curve:
        curve = measure_verify_curve(pair.target, context=cfg.curve_context, sizes=list(cfg.curve_sizes),
                                     max_size=max(cfg.curve_sizes))
        base = curve[min(curve)]
        ct = Table(title=f"verification latency at a {cfg.curve_context}-token context ({cfg.dtype})")
        for c in ("tree size", "ms", "x one-token forward"):
            ct.add_column(c)
        for n, s in curve.items():
            ct.add_row(str(n), f"{1000 * s:.1f}", f"{s / base:.2f}")
        console.print(ct)
        pd.DataFrame({"tree_size": list(curve), "seconds": list(curve.values()), "dtype": cfg.dtype}).to_csv(
            out_dir / f"verify_curve_{cfg.dtype}.csv", index=False)

    long_ctx = [t for _, _, ids in prompts for t in ids]
    while len(long_ctx) < cfg.ngram_context:
        long_ctx = long_ctx + long_ctx
    cost = ngram_cost_ms(long_ctx[: cfg.ngram_context], tree["ngram"]["top_m"])
    console.print(f"n-gram drafter: {cost:.3f} ms per call at a {cfg.ngram_context}-token context")
    if pair.middle is not None and "fixed" in cfg.methods:
        ms = signals_cost_ms(pair, tree, prompts[:2], min(cfg.max_new_tokens, 16))
        console.print(f"scheduler state with all tree signals: {ms:.3f} ms per step (fixed schedule, real trees)")


if __name__ == "__main__":
    main()
