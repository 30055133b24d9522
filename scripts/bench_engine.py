"""Benchmark the decoding engine on one pair: methods side by side on real prompts (not a test).

Run:
    python scripts/bench_engine.py pair=qwen-coder-1.5b__0.5b prompts_per_benchmark=3 max_new_tokens=64
    python scripts/bench_engine.py pair=smollm2-135m__self runtime=float32 'methods=[ar,all_small]'
    python scripts/bench_engine.py pair=tiny-random prompts_per_benchmark=1 max_new_tokens=16 max_prompt_tokens=256

A method may carry tree overrides after a colon, so variants run side by side in one process:
    'methods=[ar,all_mid,"all_mid:shape=paper","all_small:ngram.scoring=target,ngram.copy_len=0"]'
A learned method's ``artifacts=<dir>`` override loads its scheduler from another experiment's artifacts,
``threshold=<x>`` sets the distilled scheduler's call threshold (its margin must exceed x):
    'methods=[ar,treegraft,"treegraft:artifacts=/tmp/other/pipeline/cpu","treegraft:threshold=-1"]'

Spec-Bench style, on a shared machine: every method is built and warmed up first (not scored), then
the methods run *interleaved prompt by prompt* (ar, m1, m2, ..., then the next prompt), so a slow
patch of the machine lands on every method alike; greedy; speedup = ar's total time / the method's
total time over the same prompts, all on one runtime (``runtime=auto`` picks it by measuring).
Prints the CPU line, one table (tokens/s, speedup, mean AL, B_ver, tree nodes, call rate, middle
ms/call, prefill vs ar, mismatches vs ar raw / not a near-tie), speedup per benchmark, the n-gram
cost per call at a long context and the scheduler-state cost. ``runtimes=true`` first measures every
runtime of the target, one model at a time: its verification curve, ar tokens/s against the float32
default and its logits against float32 (``runtimes_only=true``: that table alone). Writes
outputs/bench/<pair>/engine.csv (rows keyed by runtime and method), runtimes.csv and one file per prompt under runs/<runtime>/ (a rerun
with the same settings reuses the prompts already done). ``workers=2`` splits the prompts across two
forked processes (one thread each) that share the loaded pair: both cores work, every method of a
prompt still runs back to back in one worker.
"""

from __future__ import annotations

import gc
import hashlib
import json
import random
import re
import statistics
import sys
import time
from pathlib import Path

import hydra
import pandas as pd
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig
from rich.console import Console
from rich.table import Table
from tqdm.auto import tqdm

from treegraft.atomic import atomic_write, atomic_write_json, read_json
from treegraft.config import CONF_DIR, check_config_choices
from treegraft.data import BenchmarkConfig, format_prompt, load_benchmark
from treegraft.decoding import GenerationResult, TreeGraftDecoder
from treegraft.pipeline.equality import compare_outputs
from treegraft.decoding.methods import LEARNED_METHODS, load_learned_scheduler
from treegraft.decoding.tree_config import tree_config_from
from treegraft.engines.torch import TorchEngines
from treegraft.front import decoder_for
from treegraft.errors import MissingArtifactError
from treegraft.models import ModelLoadError, TokenizerMismatchError
from treegraft.drafters import NGramConfig, NGramDrafter
from treegraft.machine import cpu_info, cpu_line
from treegraft.models import load_model, load_pair_from_settings, load_tokenizer
from treegraft.pipeline.parallel import fork_pull, one_thread_if_forking
from treegraft.models.runtime import RUNTIMES, RuntimeUnavailable, forward_curve, runtime_unavailable
from treegraft.scheduling import FixedScheduler
from treegraft.settings import RunSettings, tree_variant


def load_prompts(cfg: DictConfig, tokenizer) -> list[tuple[str, int, list[int]]]:
    prompts = []
    for name in cfg.benchmarks:
        ds = load_benchmark(BenchmarkConfig(name=name, benchmarks_dir=cfg.paths.benchmarks_dir,
                                            num_prompts=cfg.prompts_per_benchmark, offset=int(cfg.prompt_offset)))
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


def result_to_json(r: GenerationResult) -> dict:
    return {"tokens": r.tokens, "prompt_tokens": r.prompt_tokens, "wall_time_s": r.wall_time_s,
            "prefill_time_s": r.prefill_time_s, "stop_reason": r.stop_reason, "turns": r.turns}


class SignalTimer(FixedScheduler):
    """The fixed schedule, but asking for the tree signals so their cost shows in `schedule_s`."""

    needs_signals = True


def signals_cost_ms(pair, tree: dict, prompts, max_new_tokens: int, cache_dir) -> float:
    """Mean ms per step to compute the scheduler state with all tree signals, on real trees."""
    cfg = tree_config_from("fixed", {**tree, "call_backoff": False})  # every step's state is computed
    dec = decoder_for("fixed", pair, cfg, scheduler=SignalTimer(cfg.actions()), cache_dir=cache_dir)
    turns = [t for _, _, ids in prompts for t in dec.generate(ids, max_new_tokens).turns]
    steps = sum(len(t["schedule"]) for t in turns)
    return 1000 * sum(t.get("schedule_s", 0.0) for t in turns) / max(steps, 1)


POLICY_OVERRIDES = ("artifacts", "threshold")  # a learned method's, not the tree's


def method_overrides(method: str) -> tuple[list[str], dict[str, str]]:
    """The tree overrides of ``"<method>:key=value,key=value"`` and its policy overrides (POLICY_OVERRIDES)."""
    if ":" not in method:
        return [], {}
    overrides = re.split(r",(?![^\[]*\])", method.split(":", 1)[1])  # commas inside [...] belong to a list value
    policy = dict(o.split("=", 1) for o in overrides if o.split("=", 1)[0] in POLICY_OVERRIDES)
    return [o for o in overrides if o.split("=", 1)[0] not in POLICY_OVERRIDES], policy


def variant_tree(tree: dict, method: str) -> dict:
    """The tree settings of ``method``, or of ``"<method>:key=value,key=value"`` (dotted keys, YAML values)."""
    overrides, _ = method_overrides(method)
    return tree_variant(tree, overrides) if overrides else tree


def summarize(method: str, results: list, ar_results: list | None, reports: list, prompts) -> dict:
    new_tokens = sum(r.new_tokens for r in results)
    wall = sum(r.wall_time_s for r in results)
    turns = [t for r in results for t in r.turns]

    def per_call(key_s, key_n):
        n = sum(t.get(key_n, 0) for t in turns)
        return 1000 * sum(t.get(key_s, 0.0) for t in turns) / n if n else float("nan")

    def mean(key):  # over the turns that report it (the HF peers report AL only)
        values = [t[key] for t in turns if key in t]
        return statistics.mean(values) if values else float("nan")

    turn_s = sum(t.get("turn_s", 0.0) for t in turns)
    steps = sum(len(t.get("schedule", ())) for t in turns)
    row = {
        "method": method,
        "prompts": len(results),
        "new_tokens": new_tokens,
        "wall_s": round(wall, 2),
        "tokens_per_s": new_tokens / wall if wall else float("nan"),
        "speedup": float("nan"),
        "mean_al": mean("accepted"),
        "mean_budget": mean("budget"),
        "mean_tree_nodes": mean("tree_nodes"),
        # middle-drafter forwards per drafting step (steps left out as beyond the budget count as skips)
        "call_rate": sum(t.get("middle_calls", 0) for t in turns) / steps if steps else float("nan"),
        "middle_ms_per_call": per_call("middle_s", "middle_calls"),
        "ngram_ms_per_call": per_call("small_propose_s", "small_calls"),
        "outside_share": sum(t.get("outside_forward_s", 0.0) for t in turns) / turn_s if turn_s else float("nan"),
        "prefill_s": sum(r.prefill_time_s for r in results),
        "prefill_x_ar": float("nan"),
        "prefill_x_ar_cnndm": float("nan"),
        "mismatches": sum(not rep.equal for rep in reports),
        "mismatches_unexplained": sum(not rep.equal and not rep.explained_by_tie for rep in reports),
    }
    if ar_results is not None:
        ar_wall = sum(r.wall_time_s for r in ar_results)
        row["speedup"] = ar_wall / wall if wall else float("nan")
        ar_prefill = sum(r.prefill_time_s for r in ar_results)
        if results and results[0].prefill_time_s == results[0].prefill_time_s:  # HF peers: NaN (not measured)
            row["prefill_x_ar"] = row["prefill_s"] / ar_prefill
            cnn = [i for i, (b, _, _) in enumerate(prompts) if b == "cnndm"]
            if cnn:
                row["prefill_x_ar_cnndm"] = sum(results[i].prefill_time_s for i in cnn) / sum(
                    ar_results[i].prefill_time_s for i in cnn)
    return row


def write_csv(csv: Path, df: pd.DataFrame, keys: list[str]) -> None:
    """Atomically write the rows, replacing earlier rows with the same values in ``keys``."""
    if csv.exists():
        old = pd.read_csv(csv)
        if set(keys) <= set(old.columns):
            merged = old.merge(df[keys].drop_duplicates(), on=keys, how="left", indicator=True)
            old = old[(merged["_merge"] == "left_only").to_numpy()]
            df = pd.concat([old, df], ignore_index=True)
    atomic_write(csv, lambda tmp: df.to_csv(tmp, index=False))


def runtime_table(cfg: DictConfig, prompts, console: Console, out_dir: Path) -> None:
    """Every available runtime of the target alone: its verification curve and ar tokens/s on the first
    prompts, against the float32 default (one model loaded at a time)."""
    rows = []
    sizes = list(cfg.curve_sizes)
    some = prompts[: int(cfg.runtime_prompts)]
    probe = torch.tensor([some[0][2][:64]])
    with torch.inference_mode():
        ref = load_model(cfg.pair.target, "float32", cfg.device, cfg.paths.models_dir)(probe).logits[0].float()
    for runtime in RUNTIMES:
        why = runtime_unavailable(runtime, cfg.device)
        if why:
            console.print(f"runtime {runtime}: skipped ({why})")
            continue
        model = load_model(cfg.pair.target, device=cfg.device, models_dir=cfg.paths.models_dir, runtime=runtime)
        curve = forward_curve(model, sizes=sizes, context=int(cfg.curve_context))
        dec = decoder_for("ar", TorchEngines(model))
        dec.generate(some[0][2], 4)  # warm-up
        res = [dec.generate(ids, int(cfg.runtime_tokens)) for _, _, ids in some]
        tok = sum(r.new_tokens for r in res) / sum(r.wall_time_s - r.prefill_time_s for r in res)
        with torch.inference_mode():  # how far its numerics are from the float32 conversion (64 prompt positions)
            logits = model(probe).logits[0].float()
        rows.append({"runtime": runtime, **{f"t{n}_ms": 1000 * curve[n] for n in sizes},
                     **{f"x{n}": curve[n] / curve[1] for n in sizes if n > 1}, "ar_decode_tokens_per_s": tok,
                     "logit_max_rel_diff": float((logits - ref).abs().max() / ref.abs().max()),
                     "top1_agreement": float((logits.argmax(-1) == ref.argmax(-1)).float().mean()),
                     "cpu": cpu_line()})
        del model, dec
        gc.collect()  # one model in memory at a time
    df = pd.DataFrame(rows)
    if "float32" in set(df.get("runtime", [])):
        base = float(df.loc[df["runtime"] == "float32", "ar_decode_tokens_per_s"].iloc[0])
        df["ar_x_float32"] = df["ar_decode_tokens_per_s"] / base
    table = Table(title=f"runtimes of {cfg.pair.target} (verification at a {cfg.curve_context}-token context; "
                        f"ar decoding after prefill, {len(some)} prompts x {cfg.runtime_tokens} tokens)")
    cols = ["runtime", *[f"t{n}_ms" for n in sizes], "x8", "x16", "ar_decode_tokens_per_s", "ar_x_float32",
            "logit_max_rel_diff", "top1_agreement"]
    cols = [c for c in cols if c in df.columns]
    for c in cols:
        table.add_column(c)
    for _, r in df.iterrows():
        table.add_row(*[f"{r[c]:.2f}" if isinstance(r[c], float) else str(r[c]) for c in cols])
    console.print(table)
    write_csv(out_dir / "runtimes.csv", df, ["runtime", "cpu"])


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="bench_engine")
def main(cfg: DictConfig) -> None:
    try:
        with one_thread_if_forking(cfg.workers):  # measure (runtime, curves, warm-up) as the workers run
            run(cfg)
    except (MissingArtifactError, ModelLoadError, TokenizerMismatchError, RuntimeUnavailable, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)


def scheduler_for(method: str, cfg: DictConfig):
    """The learned scheduler of ``method`` (or ``method:overrides``) from ``cfg.artifacts`` or its own
    ``artifacts=``, None for a fixed method; a bad override or a missing artifact (which names the stage to
    run) fails here, before any model is loaded."""
    name = method.split(":")[0]
    policy = method_overrides(method)[1]
    if (policy and name not in LEARNED_METHODS) or ("threshold" in policy and name != "treegraft"):
        raise ValueError(f"method {method!r}: {', '.join(sorted(policy))}= applies to "
                         f"{'treegraft' if 'threshold' in policy else ' / '.join(LEARNED_METHODS)} only")
    threshold = float(policy["threshold"]) if "threshold" in policy else None
    return (load_learned_scheduler(name, policy.get("artifacts", cfg.artifacts), threshold)
            if name in LEARNED_METHODS else None)


def build(method: str, pair, tree: dict, cfg: DictConfig, scheduler=None):
    """The decoder of ``method`` (or ``method:overrides``) with its scheduler (:func:`scheduler_for`)."""
    return decoder_for(method.split(":")[0], pair, variant_tree(tree, method), scheduler=scheduler,
                       cache_dir=cfg.paths.cache_dir)


def run(cfg: DictConfig) -> None:
    console = Console(width=200)
    torch.manual_seed(0)
    out_dir = Path(cfg.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    console.print(f"CPU: {cpu_line()}")
    settings = RunSettings.of(cfg)  # a bad tree setting: one line, before any model is loaded
    methods = ["ar"] + [m for m in cfg.methods if m != "ar"]
    schedulers = {m: scheduler_for(m, cfg) for m in methods}  # a missing artifact fails before the models load
    if cfg.runtimes:  # first, one target at a time, before the pair takes its memory
        runtime_table(cfg, load_prompts(cfg, load_tokenizer(cfg.pair.target, cfg.paths.models_dir)), console, out_dir)
        if cfg.runtimes_only:
            return
    pair = load_pair_from_settings(instantiate(cfg.pair), cfg, log=console.print)
    tree = settings.tree
    prompts = load_prompts(cfg, pair.tokenizer)
    console.print(f"{len(prompts)} prompts x {cfg.max_new_tokens} new tokens, runtime {pair.runtime} "
                  f"(middle drafter {pair.middle_runtime}), "
                  f"pair {cfg.pair.name}, methods interleaved prompt by prompt: {', '.join(methods)}")

    decoders = {m: build(m, pair, tree, cfg, schedulers[m]) for m in methods}
    for method, dec in decoders.items():  # every warm-up (and budget=auto's curve) before any timing
        if isinstance(dec, TreeGraftDecoder) and dec.scheduler is not None and method.split(":")[0] in LEARNED_METHODS:
            dec.warm_up(prompts[0][2], 8)  # the learned policy's runtime context
        else:
            dec.generate(prompts[0][2], 8)
    prompt_hash = hashlib.sha256(json.dumps([ids for _, _, ids in prompts]).encode()).hexdigest()[:16]
    runs_dir = out_dir / "runs" / (pair.runtime if pair.middle_runtime == pair.runtime else f"{pair.runtime}+{pair.middle_runtime}")
    key = {"prompts": prompt_hash, "max_new_tokens": cfg.max_new_tokens, "tree": tree, "cpu": cpu_line()}

    def saved(i: int) -> dict:  # the methods already run on prompt i with these settings
        record = read_json(runs_dir / f"prompt_{i:03d}.json", {})
        return record.get("results", {}) if record.get("key") == key else {}

    todo = [i for i in range(len(prompts)) if not cfg.resume or set(methods) - set(saved(i))]
    if len(todo) < len(prompts):
        console.print(f"resuming: {len(prompts) - len(todo)} prompt(s) saved with the same settings")

    def work(group: list[int], report) -> None:
        for i in group:
            results = saved(i) if cfg.resume else {}
            for m in methods:
                if m not in results:
                    results[m] = result_to_json(decoders[m].generate(prompts[i][2], cfg.max_new_tokens))
            atomic_write_json({"key": key, "results": results}, runs_dir / f"prompt_{i:03d}.json")
            report(1)

    # both cores: forked workers (one thread each) sharing the loaded pair pull prompts from one queue;
    # each worker still runs every method on a prompt before the next one
    workers = min(int(cfg.workers), len(todo))
    with tqdm(total=len(todo), desc=f"prompts (every method, {workers} worker(s))", file=sys.stderr) as bar:
        fork_pull(work, todo, [1 + len(prompts[i][2]) / 256 for i in todo], workers, progress=bar.update)
    results: dict[str, list] = {m: [] for m in methods}
    for i in range(len(prompts)):
        record = saved(i)
        for m in methods:
            results[m].append(GenerationResult(**record[m]))

    target_fp32 = pair.target if pair.runtime in ("float32", "float32_packed") else None
    rows = []
    for m in methods:
        reports = []
        if m != "ar":
            if target_fp32 is None and any(r.tokens != a.tokens for r, a in zip(results[m], results["ar"])):
                target_fp32 = load_model(cfg.pair.target, "float32", cfg.device, cfg.paths.models_dir)
            reports = [compare_outputs(a.tokens, r.tokens, ids, target_fp32, cfg.tie_tolerance)
                       for (_, _, ids), r, a in zip(prompts, results[m], results["ar"])]
        rows.append({"runtime": pair.runtime, **summarize(m, results[m], results["ar"], reports, prompts),
                     **cpu_info()})
    df = pd.DataFrame(rows)
    write_csv(out_dir / "engine.csv", df, ["runtime", "method", "cpu"])
    table = Table(title=f"engine on {cfg.pair.name} (runtime {pair.runtime}, {len(prompts)} prompts x "
                        f"{cfg.max_new_tokens} tokens, interleaved) on {cpu_line()}")
    cols = ["method", "tokens_per_s", "speedup", "mean_al", "mean_budget", "mean_tree_nodes", "call_rate",
            "middle_ms_per_call", "ngram_ms_per_call", "outside_share", "prefill_x_ar", "prefill_x_ar_cnndm",
            "mismatches", "mismatches_unexplained"]
    for c in cols:
        table.add_column(c)
    for _, r in df.iterrows():
        table.add_row(*[f"{r[c]:.3f}" if isinstance(r[c], float) else str(r[c]) for c in cols])
    console.print(table)
    per_bench = pd.DataFrame([{"method": m, "benchmark": b,
                               "speedup": sum(a.wall_time_s for a, (bb, _, _) in zip(results["ar"], prompts) if bb == b)
                               / sum(r.wall_time_s for r, (bb, _, _) in zip(results[m], prompts) if bb == b)}
                              for m in methods for b in cfg.benchmarks]).pivot(index="method", columns="benchmark",
                                                                               values="speedup")
    console.print(per_bench[list(cfg.benchmarks)].round(2).to_string())

    long_ctx = [t for _, _, ids in prompts for t in ids]
    while len(long_ctx) < cfg.ngram_context:
        long_ctx = long_ctx + long_ctx
    cost = ngram_cost_ms(long_ctx[: cfg.ngram_context], tree["ngram"]["top_m"])
    console.print(f"n-gram drafter: {cost:.3f} ms per call at a {cfg.ngram_context}-token context")
    if pair.middle is not None and "fixed" in methods:
        ms = signals_cost_ms(pair, tree, prompts[:2], min(cfg.max_new_tokens, 16), cfg.paths.cache_dir)
        console.print(f"scheduler state with all tree signals: {ms:.3f} ms per step (fixed schedule, real trees)")


if __name__ == "__main__":
    check_config_choices()
    main()
