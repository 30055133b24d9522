"""Benchmark engine=llama_cpp against the PyTorch engine and stock llama.cpp, in one process (not a test).

Run:
    python scripts/bench_llama_engine.py --pair qwen-coder-1.5b__0.5b --prompts-per-benchmark 2 --max-new-tokens 64
    python scripts/bench_llama_engine.py --pair smollm2-135m__self --methods torch:ar llama:ar llama:all_small
    python scripts/bench_llama_engine.py --experiment cpu_llama --artifacts outputs/pipeline/cpu_llama \
        --methods llama:ar llama:treegraft tool:plain tool:ngram-map-k:4

``--experiment`` gives every llama tree method the experiment's tree settings (and the middle drafter's weights), so
``llama:treegraft`` decodes as the pipeline that fitted its scheduler did.

A method is ``<engine>:<method>``, a tree method optionally with tree settings of its own
(``llama:all_small+ngram.prefill_scores=false``; the learned ``treegraft`` / ``direct_planner`` load a pipeline run's
scheduler from ``--artifacts outputs/pipeline/<name>``): ``torch`` (the PyTorch engine, ``--torch-runtime``, default: the
runtime ``runtime=auto`` picks on this machine), ``llama`` (llama.cpp, the exact default: batch-invariant
kernels, weights not repacked) or ``llama-stock`` (llama.cpp's stock fast kernels: outputs equal to its
own ``ar`` up to batch rounding). Every decoder is built and warmed up first; then the methods run
*interleaved prompt by prompt* (every method on a prompt, then the next prompt), greedy, so a slow
patch of a shared machine lands on every method alike. Speedups are ratios of tokens/s over the same
prompts with a paired bootstrap 95% CI (prompts resampled within benchmarks, treegraft.stats).
Mismatches count prompts whose tokens differ from the same engine's ``ar`` (for ``llama`` any is a
bug; for ``llama-stock`` they are the batch-rounding flips the stock kernels allow; ``torch:ar`` is
compared with ``llama:ar`` for information: other numerics, other text).
Prints the CPU line, the build and one table; writes outputs/bench/llama/<pair>/engine.csv and one
file per prompt under runs/ (a rerun with the same settings reuses the prompts already done).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from omegaconf import OmegaConf
from rich.console import Console
from rich.table import Table
from tqdm.auto import tqdm

from treegraft.atomic import atomic_write_json, read_json
from treegraft.config import CONF_DIR
from treegraft.data import BENCHMARKS, BenchmarkConfig, format_prompt, load_benchmark
from treegraft.decoding import GenerationResult
from treegraft.engines.llama_cpp import gguf_path
from treegraft.machine import cpu_line
from treegraft.paths import REPO_ROOT, default_benchmarks_dir, default_cache_dir, default_models_dir
from treegraft.stats import bootstrap_weights, interval

ENGINES = ("torch", "llama", "llama-stock", "tool")
DEFAULT_METHODS = ["torch:ar", "llama:ar", "llama-stock:ar", "llama:all_small", "llama:all_mid", "llama:fixed",
                   "llama:csd", "llama-stock:all_small", "llama-stock:fixed"]


def artifacts_key(folder: str, methods: list[str]) -> dict:
    """The learned methods' artifact files by content (a scheduler refitted in the same folder redoes the prompts)."""
    from treegraft.decoding.methods import LEARNED_ARTIFACTS
    from treegraft.pipeline.artifacts import file_hash

    names = {m.split(":", 1)[1].split("+")[0] for m in methods}
    return {f: file_hash(Path(folder) / f) for base in sorted(names & set(LEARNED_ARTIFACTS))
            for f in LEARNED_ARTIFACTS[base] if (Path(folder) / f).exists()}


def load_prompts(benchmarks, per_benchmark: int, offset: int, tokenizer, benchmarks_dir) -> list[tuple[str, int, list[int], str]]:
    prompts = []
    for name in benchmarks:
        ds = load_benchmark(BenchmarkConfig(name=name, benchmarks_dir=benchmarks_dir, num_prompts=per_benchmark,
                                            offset=offset))
        for rec in ds:
            text = format_prompt(tokenizer, rec["turns"][0])
            prompts.append((name, rec["question_id"], tokenizer(text, add_special_tokens=False).input_ids, text))
    return prompts


def result_to_json(r: GenerationResult) -> dict:
    return {"tokens": r.tokens, "prompt_tokens": r.prompt_tokens, "wall_time_s": r.wall_time_s,
            "prefill_time_s": r.prefill_time_s, "stop_reason": r.stop_reason, "turns": r.turns,
            "n_tokens": len(r.tokens), "decode_s": r.wall_time_s - r.prefill_time_s}


TOOL_KINDS = ("plain", "draft-simple", "ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod")
# the flag that sets each n-gram mode's draft length (draft-simple: --spec-draft-n-max, passed to every mode as a cap)
TOOL_DRAFT_FLAG = {"ngram-simple": "--spec-ngram-simple-size-m", "ngram-map-k": "--spec-ngram-map-k-size-m",
                   "ngram-map-k4v": "--spec-ngram-map-k4v-size-m", "ngram-mod": "--spec-ngram-mod-n-max"}


class ToolPeer:
    """Stock llama.cpp's own decoding on one prompt: ``llama-completion`` (``plain``) or
    ``llama-speculative-simple --spec-type <kind>`` with a draft length N (``<kind>:N``; ``draft-simple:N:P``
    also sets ``--spec-draft-p-min P``), each optionally with ``+nr`` (``--no-repack``: the weights as loaded) and
    ``+fa=on|off|auto`` (flash attention), the tools built by scripts/bench_llamacpp.py from the same source
    package (stock build: repacked weights, its default attention; AMX off where the CPU has it). Times are the
    tools' own: the prompt's (``prompt eval time`` / ``encoded``) and the decoding's (``eval time`` /
    ``decoded``); end to end is their sum, without loading the models (our decoders' times exclude it too)."""

    def __init__(self, spec: str, bins: Path, target: Path, draft: Path, threads: int, work: Path):
        base, *mods = spec.split("+")
        self.flags: list[str] = []
        for mod in mods:
            if mod == "nr":
                self.flags.append("--no-repack")
            elif mod in ("fa=on", "fa=off", "fa=auto"):
                self.flags += ["-fa", mod[3:]]
            else:
                raise ValueError(f"tool method {spec!r}: modifier {mod!r} is not nr or fa=on|off|auto")
        parts = base.split(":")
        self.kind = parts[0]
        if self.kind not in TOOL_KINDS:
            raise ValueError(f"tool method {spec!r}: expected plain or <kind>:<n_max> with kind one of "
                             f"{', '.join(TOOL_KINDS[1:])} (draft-simple:<n_max>:<p_min> also)")
        try:
            self.n_max = int(parts[1]) if len(parts) > 1 else None
            self.p_min = float(parts[2]) if len(parts) > 2 else None
        except ValueError:
            raise ValueError(f"tool method {spec!r}: n_max must be an integer and p_min a number") from None
        if (self.kind != "plain") != (self.n_max is not None) or (self.p_min is not None and self.kind != "draft-simple"):
            raise ValueError(f"tool method {spec!r}: expected plain, <kind>:<n_max> or draft-simple:<n_max>:<p_min>")
        self.bins, self.target, self.draft, self.threads, self.work = bins, target, draft, threads, work

    def generate(self, text: str, max_new_tokens: int) -> dict:
        import re
        import subprocess

        prompt = self.work / "prompt.txt"
        prompt.write_text(text)
        common = ["-m", str(self.target), "-f", str(prompt), "-n", str(max_new_tokens), "--temp", "0",
                  "-t", str(self.threads), "--seed", "0", *self.flags]
        if self.kind == "plain":
            cmd = [str(self.bins / "llama-completion"), *common, "-no-cnv"]
        else:
            cmd = [str(self.bins / "llama-speculative-simple"), *common, "--spec-type", self.kind,
                   "--spec-draft-n-max", str(self.n_max)]
            if self.kind in TOOL_DRAFT_FLAG:
                cmd += [TOOL_DRAFT_FLAG[self.kind], str(self.n_max)]
            if self.kind == "draft-simple":
                cmd += ["-md", str(self.draft)] + (["--spec-draft-p-min", str(self.p_min)] if self.p_min is not None else [])
        # the generated text may end inside a multi-byte character: never fail on the tool's bytes
        proc = subprocess.run(cmd, capture_output=True, text=True, encoding="utf-8", errors="replace", timeout=1800)
        out = proc.stdout + proc.stderr
        if proc.returncode != 0:
            raise RuntimeError(f"{Path(cmd[0]).name} failed: {(proc.stderr.strip().splitlines() or ['?'])[-1]}")
        if self.kind == "plain":
            pre = re.findall(r"prompt eval time =\s*([\d.]+) ms", out)
            found = re.findall(r"\beval time =\s*([\d.]+) ms /\s*(\d+) runs", out)
            n, seconds = (int(found[-1][1]), float(found[-1][0]) / 1000) if found else (0, float("nan"))
            prefill = float(pre[-1]) / 1000 if pre else float("nan")
        else:
            enc = re.findall(r"encoded\s+\d+ tokens in\s+([\d.]+) seconds", out)
            found = re.findall(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", out)
            n, seconds = (int(found[-1][0]), float(found[-1][1])) if found else (0, float("nan"))
            prefill = float(enc[-1]) if enc else float("nan")
        if not n:
            raise RuntimeError(f"{Path(cmd[0]).name}: no decode timing in its output")
        return {"tokens": [], "n_tokens": n, "decode_s": seconds, "wall_time_s": prefill + seconds,
                "prefill_time_s": prefill, "turns": []}


def build_decoders(methods: list[str], pair_cfg, args, console: Console) -> tuple[dict, dict, object]:
    """The decoders of ``methods`` (llama pairs loaded once per mode), their build facts, the tokenizer."""
    from treegraft.engines.llama_cpp import load_llama_pair
    from treegraft.engines.llama_cpp.build import installed_build
    from treegraft.decoding.methods import LEARNED_METHODS, load_learned_scheduler
    from treegraft.front import decoder_for

    tree = args.tree  # the experiment's tree settings (None: TreeConfig's defaults, conf/tree/default.yaml's)
    middle = pair_cfg.middle
    pairs, decoders, facts = {}, {}, {"build": installed_build(), "middle_weights": args.middle_weights}
    for method in methods:
        engine, name = method.split(":", 1)
        if engine == "tool":
            decoders[method] = ("tool", name)  # built by main once the tools are
            continue
        if engine not in ENGINES:
            raise ValueError(f"method {method!r}: engine {engine!r} is not one of {', '.join(ENGINES)}")
        if engine == "torch":
            from treegraft.engines.torch import TorchEngines
            from treegraft.models import load_model, load_tokenizer
            from treegraft.models.loading import resolve_runtime

            if name != "ar":
                raise ValueError(f"method {method!r}: this benchmark runs only ar on the PyTorch engine "
                                 f"(scripts/bench_engine.py runs every method there)")
            runtime = resolve_runtime(pair_cfg.target, args.torch_runtime, "cpu", args.models_dir, args.cache_dir,
                                      log=console.print)
            model = load_model(pair_cfg.target, device="cpu", models_dir=args.models_dir, runtime=runtime)
            decoders[method] = decoder_for("ar", TorchEngines(model, None, load_tokenizer(pair_cfg.target, args.models_dir)))
            facts["torch_runtime"] = runtime
            continue
        exact = engine == "llama"
        if exact not in pairs:
            pairs[exact] = load_llama_pair(pair_cfg.target, middle, threads=args.threads, exact=exact,
                                           n_ctx=args.n_ctx, models_dir=args.models_dir,
                                           middle_weights=args.middle_weights)
        name, *overrides = name.split("+")  # llama:all_small+ngram.prefill_scores=false: tree settings of its own
        settings = (OmegaConf.to_container(OmegaConf.merge(tree or {}, OmegaConf.from_dotlist(overrides)))
                    if overrides else tree)
        scheduler = None
        if name in LEARNED_METHODS:  # treegraft / direct_planner: the artifacts of a pipeline run on this engine
            if args.artifacts is None:
                raise ValueError(f"method {method!r} needs --artifacts (a pipeline folder with fit/ and distill/)")
            scheduler = load_learned_scheduler(name, args.artifacts)
        decoders[method] = decoder_for(name, pairs[exact], settings, scheduler=scheduler, cache_dir=args.cache_dir)
    tokenizer = next(iter(pairs.values())).tokenizer
    return decoders, facts, tokenizer


def invariance_table(pair_cfg, args, console: Console) -> pd.DataFrame:
    """Batch invariance of the pair's GGUF files in both modes: chains and trees in one batch against
    one-token decoding, KV below and above 512 cells (treegraft.engines.llama_cpp.check)."""
    from treegraft.engines.llama_cpp import GGUFModel, gguf_path
    from treegraft.engines.llama_cpp.check import batch_invariance

    rows = []
    for role, source in (("target", pair_cfg.target), ("middle", pair_cfg.middle)):
        path = str(gguf_path(source, args.models_dir))
        for exact in (True, False):
            model, reference = (GGUFModel(path, n_ctx=2048, n_seq=256, threads=args.threads, exact=exact)
                                for _ in range(2))
            for context in (40, 530):
                for r in batch_invariance(model, reference, context):
                    rows.append({"model": f"{role} {Path(path).name}", "mode": "exact" if exact else "stock",
                                 **vars(r)})
            model.close(), reference.close()
    df = pd.DataFrame(rows)
    summary = df.groupby(["model", "mode", "kind", "context"]).agg(
        rows=("rows", "sum"), exact_rows=("exact_rows", "sum"), max_abs_diff=("max_abs_diff", "max"),
        argmax_flips=("argmax_flips", "sum")).reset_index()
    console.print(f"batch invariance (chains of 2-8, trees of 16-64 rows, each row vs one-token decoding), "
                  f"{args.threads} threads, {cpu_line()}")
    console.print(summary.to_string(index=False))
    return df


def curve_table(pair_cfg, args, console: Console) -> pd.DataFrame:
    """t(n) of one decode of n chained rows on a 256-token cache, exact against stock, both models
    (median of 5 after a warm-up; treegraft.engines.llama_cpp.costs)."""
    from treegraft.engines.llama_cpp import GGUFModel, gguf_path
    from treegraft.engines.llama_cpp.costs import engine_curve

    sizes = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
    rows = []
    for role, source in (("target", pair_cfg.target), ("middle", pair_cfg.middle)):
        path = str(gguf_path(source, args.models_dir))
        models = {exact: GGUFModel(path, n_ctx=1024, n_seq=8, threads=args.threads, exact=exact) for exact in (True, False)}
        curves = {exact: {} for exact in models}
        for _ in range(5):  # the modes alternate, so a slow patch of the machine hits both
            for exact, model in models.items():
                for n, sec in engine_curve(model, sizes=sizes, repeats=1, seed=len(curves[exact])).items():
                    curves[exact].setdefault(n, []).append(sec)
        for exact in models:
            rows.append({"model": f"{role} {Path(path).name}", "mode": "exact" if exact else "stock",
                         **{f"t{n}_ms": 1000 * float(np.median(curves[exact][n])) for n in sizes}})
        for model in models.values():
            model.close()
    df = pd.DataFrame(rows)
    for role in df["model"].unique():
        ex, st = (df[(df["model"] == role) & (df["mode"] == m)].iloc[0] for m in ("exact", "stock"))
        rows.append({"model": role, "mode": "exact / stock",
                     **{c: ex[c] / st[c] for c in df.columns if c.startswith("t")}})
    df = pd.DataFrame(rows)
    console.print(f"t(n) ms, one decode of n rows after 256 cached tokens, {args.threads} threads, {cpu_line()}")
    console.print(df.round(2).to_string(index=False))
    return df


def _tokens(r: dict) -> int:
    return r.get("n_tokens", len(r["tokens"]))


def _decode_s(r: dict) -> float:
    return r.get("decode_s", r["wall_time_s"] - r["prefill_time_s"])


def speedup(results: dict, method: str, reference: str, weights: np.ndarray, decode_only: bool = False):
    """tokens/s of ``method`` over tokens/s of ``reference`` on the same prompts (end to end, or decode
    only: after the prompt), with its paired bootstrap CI."""
    seconds = _decode_s if decode_only else (lambda r: r["wall_time_s"])
    tok_m, t_m, tok_r, t_r = (np.array([f(r) for r in results[k]], float)
                              for k in (method, reference) for f in (_tokens, seconds))
    return interval(lambda w: (w @ tok_m / (w @ t_m)) / (w @ tok_r / (w @ t_r)), weights, n=weights.shape[1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pair", default="qwen-coder-1.5b__0.5b", help="a conf/pair/<name>.yaml of embedded models")
    parser.add_argument("--methods", nargs="+", default=DEFAULT_METHODS)
    parser.add_argument("--benchmarks", nargs="+", default=list(BENCHMARKS))
    parser.add_argument("--prompts-per-benchmark", type=int, default=2)
    parser.add_argument("--prompt-offset", type=int, default=0)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2, help="llama.cpp threads and torch threads")
    parser.add_argument("--n-ctx", type=int, default=4096)
    parser.add_argument("--artifacts", default=None,
                        help="a pipeline folder (outputs/pipeline/<name>) whose fit/ and distill/ the learned methods load")
    parser.add_argument("--middle-weights", default=None, choices=["file", "q4_0"],
                        help="llama.cpp's middle drafter: its file as is, or requantized to Q4_0 on stock kernels "
                             "(default: the experiment's engine.middle_weights, else file)")
    parser.add_argument("--experiment", default=None,
                        help="conf/experiment/<name>.yaml: its tree settings (and engine.middle_weights) for every "
                             "llama tree method, as the pipeline decodes; a method's own +settings go on top")
    parser.add_argument("--torch-runtime", default="auto")
    parser.add_argument("--benchmarks-dir", default=None)
    parser.add_argument("--models-dir", default=None)
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument("--out-dir", default=None)
    parser.add_argument("--no-resume", action="store_true")
    parser.add_argument("--curves", action="store_true", help="first, exact vs stock t(n) for both models")
    parser.add_argument("--check-exact", action="store_true",
                        help="first, the batch-invariance check of both GGUF files in both modes")
    args = parser.parse_args()
    args.models_dir = args.models_dir or str(default_models_dir())
    args.cache_dir = args.cache_dir or str(default_cache_dir())
    console = Console(width=200)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    pair_file = CONF_DIR / "pair" / f"{args.pair}.yaml"
    if not pair_file.is_file():
        print(f"error: pair {args.pair!r} not found: expected conf/pair/{args.pair}.yaml", file=sys.stderr)
        return 2
    pair_cfg = OmegaConf.load(pair_file)
    args.tree, experiment_weights = None, None
    if args.experiment:  # composed as the pipeline composes it (an experiment may inherit another's settings)
        from hydra import compose, initialize_config_dir

        if not (CONF_DIR / "experiment" / f"{args.experiment}.yaml").is_file():
            print(f"error: experiment {args.experiment!r} not found: expected conf/experiment/{args.experiment}.yaml",
                  file=sys.stderr)
            return 2
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            exp = compose(config_name="evaluate", overrides=[f"experiment={args.experiment}"])
        from treegraft.settings import RunSettings

        settings = RunSettings.of(exp)
        args.tree, experiment_weights = dict(settings.tree), settings.engine.middle_weights
    args.middle_weights = args.middle_weights or experiment_weights or "file"
    if pair_cfg.middle is None:  # a self-draft pair: llama.cpp cannot run a layer prefix, so the whole file drafts
        pair_cfg.middle = pair_cfg.target
    methods = list(dict.fromkeys(["llama:ar"] + args.methods))
    for m in list(methods):  # every engine's own ar, the reference of its mismatches
        engine = m.split(":", 1)[0]
        if engine.startswith("llama") and f"{engine}:ar" not in methods:
            methods.insert(methods.index(m), f"{engine}:ar")
    console.print(f"CPU: {cpu_line()}")
    out_dir = Path(args.out_dir or REPO_ROOT / "outputs" / "bench" / "llama" / args.pair)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.curves:
        curve_table(pair_cfg, args, console).to_csv(out_dir / "curves.csv", index=False)
    if args.check_exact:
        invariance_table(pair_cfg, args, console).to_csv(out_dir / "invariance.csv", index=False)
    try:
        decoders, facts, tokenizer = build_decoders(methods, pair_cfg, args, console)
    except (ValueError, FileNotFoundError, RuntimeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    console.print(f"llama.cpp build: {json.dumps(facts['build'])}; torch runtime: {facts.get('torch_runtime', '-')}; "
                  f"{args.threads} threads")
    try:
        prompts = load_prompts(args.benchmarks, args.prompts_per_benchmark, args.prompt_offset, tokenizer,
                               args.benchmarks_dir or default_benchmarks_dir())
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    console.print(f"{len(prompts)} prompts x {args.max_new_tokens} new tokens, interleaved prompt by prompt: "
                  f"{', '.join(methods)}")
    tools = [m for m in methods if m.startswith("tool:")]
    if tools:  # stock llama.cpp's own tools, built from the same source package (scripts/bench_llamacpp.py)
        sys.path.insert(0, str(Path(__file__).parent))
        import bench_llamacpp

        root = REPO_ROOT / "outputs" / "llamacpp"
        bins = bench_llamacpp.build(root, "0.3.36", 2)
        files = [gguf_path(str(x), args.models_dir) for x in (pair_cfg.target, pair_cfg.middle)]
        for m in tools:
            decoders[m] = ToolPeer(m.split(":", 1)[1], bins, files[0], files[1], args.threads, out_dir)
        facts["tools"] = str(bins)

    def run_one(m: str, i: int, max_new_tokens: int) -> dict:
        dec = decoders[m]
        if isinstance(dec, ToolPeer):
            return dec.generate(prompts[i][3], max_new_tokens)
        return result_to_json(dec.generate(prompts[i][2], max_new_tokens))

    for m in methods:  # warm-ups (and each tree decoder's measured cost curve) before any timing
        run_one(m, 0, 8)

    runs = out_dir / "runs"
    key = {"prompts": hashlib.sha256(json.dumps([p[2] for p in prompts]).encode()).hexdigest()[:16],
           "max_new_tokens": args.max_new_tokens, "threads": args.threads, "cpu": cpu_line(),
           "build": facts["build"], "torch_runtime": facts.get("torch_runtime"),
           **({"middle_weights": args.middle_weights} if args.middle_weights != "file" else {}),
           **({"tree": args.tree} if args.tree else {}),
           **({"artifacts": artifacts_key(args.artifacts, methods)} if args.artifacts else {})}

    def saved(i: int) -> dict:
        record = read_json(runs / f"prompt_{i:03d}.json", {})
        return record.get("results", {}) if record.get("key") == key and not args.no_resume else {}

    start = time.perf_counter()
    per_prompt = []
    for i in tqdm(range(len(prompts)), desc="prompts (every method)", file=sys.stderr):
        results = saved(i)
        for m in methods:
            if m not in results:
                results[m] = run_one(m, i, args.max_new_tokens)
        atomic_write_json({"key": key, "pair": args.pair, "benchmark": prompts[i][0], "question_id": prompts[i][1],
                           "prompt_ids": prompts[i][2], "results": results}, runs / f"prompt_{i:03d}.json")
        per_prompt.append(results)
    wall = time.perf_counter() - start

    # from memory, not from the files: with --no-resume `saved` ignores them
    results = {m: [per_prompt[i][m] for i in range(len(prompts))] for m in methods}
    strata = [p[0] for p in prompts]
    weights = bootstrap_weights(strata)
    refs = {"x_llama_exact_ar": ("llama:ar", False), "x_llama_stock_ar": ("llama-stock:ar", False),
            "x_torch_ar": ("torch:ar", False), "x_tool_plain": ("tool:plain", False),
            "decode_x_tool_plain": ("tool:plain", True)}
    spec_tools = [m for m in results if m.startswith("tool:") and not m.split(":")[1].startswith("plain")]
    if spec_tools:  # stock llama.cpp's best speculative mode here (decode tokens/s), the line to beat
        best = max(spec_tools, key=lambda m: sum(_tokens(r) for r in results[m]) / sum(r["wall_time_s"] for r in results[m]))
        refs["x_best_stock_spec"] = (best, False)
        refs["decode_x_best_stock_spec"] = (best, True)
        facts["best_stock_spec"] = best
    refs = {c: ref for c, ref in refs.items() if ref[0] in results}
    rows = []
    for m in methods:
        engine, name = m.split(":", 1)
        own_ar = {"torch": "llama:ar", "tool": None}.get(engine, f"{engine}:ar")
        turns = [t for r in results[m] for t in r["turns"]]
        row = {"method": m, "n_prompts": len(prompts), "tokens": sum(_tokens(r) for r in results[m]),
               "tokens_per_s": sum(_tokens(r) for r in results[m]) / sum(r["wall_time_s"] for r in results[m]),
               "decode_tokens_per_s": sum(_tokens(r) for r in results[m]) / sum(_decode_s(r) for r in results[m])}
        for col, (ref, decode_only) in refs.items():
            row[col] = speedup(results, m, ref, weights, decode_only)
        row.update({
            "mean_al": (sum(t["accepted"] for t in turns) + len(turns)) / len(turns) if turns else float("nan"),
            "call_rate": (float(np.mean([np.mean(t["schedule"]) for t in turns if t.get("schedule")]))
                          if any(t.get("schedule") for t in turns) else 0.0),
            "differs_from_own_ar": (f"{sum(r['tokens'] != a['tokens'] for r, a in zip(results[m], results[own_ar]))}"
                                    f"/{len(prompts)} vs {own_ar}" if own_ar else "-"),
            "cpu": cpu_line(), "threads": args.threads})
        rows.append(row)
    df = pd.DataFrame(rows)
    table = Table(title=f"{args.pair}: {len(prompts)} prompts x {args.max_new_tokens} tokens, interleaved, "
                        f"{args.threads} threads, on {cpu_line()} ({wall / 60:.1f} min)")
    cols = ["method", "tokens_per_s", "decode_tokens_per_s", *refs, "mean_al", "call_rate", "differs_from_own_ar"]
    for c in cols:
        table.add_column(c)
    for r in rows:
        table.add_row(*[f"{r[c]:.2f}" if isinstance(r[c], float) else str(r[c] if r[c] is not None else "-")
                        for c in cols])
    console.print(table)
    if "best_stock_spec" in facts:
        console.print(f"x_best_stock_spec: over {facts['best_stock_spec']}, stock llama.cpp's fastest speculative mode "
                      "here end to end (the tools' prompt + decoding times, models' loading excluded; they decode their "
                      "own text: the same tokens as stock plain up to batch rounding)")
    per_bench = pd.DataFrame([{"method": m, "benchmark": b,
                               "x": speedup({k: [v[i] for i in idx] for k, v in results.items()}, m, "llama:ar",
                                            bootstrap_weights([b] * len(idx))).format()}
                              for m in methods if not m.startswith("tool:") for b in args.benchmarks
                              for idx in [[i for i, s in enumerate(strata) if s == b]]])
    console.print("end-to-end speedup over llama:ar per benchmark")
    console.print(per_bench.pivot(index="method", columns="benchmark", values="x")[args.benchmarks].to_string())
    csv = df.copy()
    for c in refs:
        for part in ("value", "low", "high"):
            csv[f"{c}_{part}"] = [getattr(v, part) if v is not None else None for v in df[c]]
        csv = csv.drop(columns=c)
    csv.to_csv(out_dir / "engine.csv", index=False)
    console.print(f"wrote {out_dir / 'engine.csv'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
