"""Speed of two checkouts of this project, interleaved prompt by prompt (before/after a change).

Run (the old checkout from `git worktree add /tmp/old <commit>`):
    python scripts/compare_checkouts.py --old /tmp/old --new . --engine torch --methods ar all_small treegraft
    python scripts/compare_checkouts.py --old /tmp/old --new . --engine llama_cpp

Each checkout runs in a worker process of its own (``PYTHONPATH=<checkout>/src``) that loads the pair once
and decodes on request; the driver sends every prompt to both, one generation at a time (never two at
once), alternating which goes first and rotating the methods, so a slow spell of a shared machine lands on
both alike. Greedy; a warm-up generation per method first (not scored). ``treegraft`` runs the learned
method's path with a fixed schedule (``--schedule``, default 01000: the PyTorch full experiment's best fixed
schedule), as the cost-aware fallback deploys it, so no fitted artifacts are needed.

Prints, per method and checkout, tokens/s and the speedup over ``ar`` of the same checkout, and new /
old time ratios with paired-bootstrap 95% CIs over prompts, n, and the CPU line; outputs must be equal.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def serve(args) -> None:
    """Worker: load the pair once, then answer one JSON request per line: {"method", "prompt", "max_new_tokens"}."""
    import torch

    from treegraft.scheduling.policy import FixedScheduler

    try:  # the front door: (method, pair, tree, sampling, scheduler, cache_dir) on either engine
        from treegraft.front import decoder_for
        from treegraft.engines.llama_cpp import load_llama_pair
    except ImportError:  # a checkout from before the engines layer: the same call under its old names
        from treegraft.llama_cpp.pair import load_llama_pair
        from treegraft.llama_cpp.select import engine_decoder as decoder_for

    torch.set_num_threads(args.threads)
    if args.engine == "llama_cpp":
        from treegraft.models import PairSpec

        target, middle = args.target, args.middle
        pair = load_llama_pair(target, middle, threads=args.threads)
        pair.spec = PairSpec(name=args.pair, target=target, middle=middle)
    else:
        from treegraft.models import PairSpec, load_pair

        pair = load_pair(PairSpec(name=args.pair, target=args.target, middle=args.middle), runtime=args.runtime,
                         middle_runtime="auto", log=lambda *a: None)
    make = lambda m, sched: decoder_for(m, pair, {}, None, sched, None)  # noqa: E731
    decoders = {}
    print(json.dumps({"ready": True, "runtime": getattr(pair, "runtime", None)}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        method = req["method"]
        if method not in decoders:
            sched = FixedScheduler([int(a) for a in args.schedule]) if method == "treegraft" else None
            decoders[method] = make(method, sched)
        dec = decoders[method]
        if req.get("warmup"):
            if hasattr(dec, "warm_up") and getattr(dec, "middle", None) is not None and method == "treegraft":
                dec.warm_up(req["prompt"], 8, repeats=2)
            dec.generate(req["prompt"], 8)
            print(json.dumps({"ok": True}), flush=True)
            continue
        out = dec.generate(req["prompt"], int(req["max_new_tokens"]))
        print(json.dumps({"tokens": out.tokens, "wall_s": out.wall_time_s}), flush=True)


class Worker:
    def __init__(self, checkout: Path, args, extra: list[str]):
        # both checkouts read the same converted models and per-machine caches (this checkout's, unless set)
        env = {"TREEGRAFT_MODELS": str(REPO / "data" / "models"), "TREEGRAFT_CACHE": str(REPO / "outputs" / "cache"),
               **os.environ, "PYTHONPATH": str(Path(checkout).resolve() / "src"), "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--serve", *extra], cwd=checkout,
                                     env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.info = self._read()

    def _read(self) -> dict:
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError("a worker stopped")
            if line.startswith("{"):
                return json.loads(line)

    def ask(self, **req) -> dict:
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", type=Path)
    ap.add_argument("--new", type=Path, default=REPO)
    ap.add_argument("--engine", choices=["torch", "llama_cpp"], default="torch")
    ap.add_argument("--pair", default="qwen-coder-1.5b__0.5b")
    ap.add_argument("--target", default="embedded:qwen-coder-1.5b")
    ap.add_argument("--middle", default="embedded:qwen-coder-0.5b")
    ap.add_argument("--runtime", default="auto")
    ap.add_argument("--methods", nargs="+", default=["ar", "all_small", "treegraft"])
    ap.add_argument("--schedule", default="01000")
    ap.add_argument("--benchmarks", nargs="+", default=["gsm8k", "alpaca", "nq", "humaneval", "cnndm", "mt_bench"])
    ap.add_argument("--prompts-per-benchmark", type=int, default=2)
    ap.add_argument("--prompt-offset", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve(args)
        return

    import numpy as np

    sys.path.insert(0, str(REPO / "src"))
    from treegraft.data import BenchmarkConfig, format_prompt, load_benchmark
    from treegraft.machine import cpu_line
    from treegraft.models import load_tokenizer
    from treegraft.stats import bootstrap_weights, interval, ratio_of_sums

    def paired_bootstrap_ratio(a, b):  # sum(a) / sum(b), prompts resampled in pairs (within benchmarks)
        return interval(ratio_of_sums(a, b), bootstrap_weights([bench for bench, _ in prompts]))

    tok = load_tokenizer(args.target)
    prompts = []
    for bench in args.benchmarks:
        data = load_benchmark(BenchmarkConfig(name=bench, offset=args.prompt_offset, num_prompts=args.prompts_per_benchmark))
        prompts += [(bench, tok(format_prompt(tok, turns[0])).input_ids) for turns in data["turns"]]
    extra = ["--engine", args.engine, "--pair", args.pair, "--target", args.target, "--middle", args.middle,
             "--runtime", args.runtime, "--schedule", args.schedule, "--threads", str(args.threads)]
    workers = {"old": Worker(args.old, args, extra), "new": Worker(args.new, args, extra)}
    for w in workers.values():  # warm-ups, not scored
        for m in args.methods:
            w.ask(method=m, prompt=prompts[0][1], warmup=True)
    wall = {(v, m): [] for v in workers for m in args.methods}
    mismatches = {"old vs new": [], "old vs its ar": [], "new vs its ar": []}
    records = []
    for k, (bench, ids) in enumerate(prompts):
        methods = args.methods[k % len(args.methods):] + args.methods[:k % len(args.methods)]
        tokens = {}
        for m in methods:
            order = ["old", "new"] if (k + methods.index(m)) % 2 == 0 else ["new", "old"]
            for v in order:
                r = workers[v].ask(method=m, prompt=ids, max_new_tokens=args.max_new_tokens)
                wall[v, m].append(r["wall_s"])
                tokens[v, m] = r["tokens"]
        for m in args.methods:
            if tokens["old", m] != tokens["new", m]:
                mismatches["old vs new"].append(f"{bench}#{k}:{m}")
            for v in workers:
                if "ar" in args.methods and tokens[v, m] != tokens[v, "ar"]:
                    mismatches[f"{v} vs its ar"].append(f"{bench}#{k}:{m}")
        records.append({"benchmark": bench, "prompt": k, **{f"{v}:{m}": wall[v, m][-1] for v in workers for m in args.methods}})
        print(f"[{k + 1}/{len(prompts)}] {bench}: " + ", ".join(
            f"{m} {wall['old', m][-1]:.2f}/{wall['new', m][-1]:.2f}s" for m in args.methods), flush=True)
    for w in workers.values():
        w.close()
    print(f"\n{args.engine} engine ({workers['new'].info.get('runtime')}), {len(prompts)} prompts x "
          f"{args.max_new_tokens} new tokens, interleaved; {cpu_line()}")
    print(f"{'method':<11} {'old s':>8} {'new s':>8} {'new/old time [95% CI]':>28} {'speedup old':>12} {'speedup new':>12}")
    rows = []
    for m in args.methods:
        old, new = np.array(wall["old", m]), np.array(wall["new", m])
        ratio = paired_bootstrap_ratio(new, old)
        sp = {v: paired_bootstrap_ratio(np.array(wall[v, "ar"]), np.array(wall[v, m])) for v in workers} \
            if "ar" in args.methods else {}
        rows.append({"method": m, "old_s": old.sum(), "new_s": new.sum(), "new_over_old": ratio.value,
                     "lo": ratio.low, "hi": ratio.high, "n": len(old),
                     **{f"speedup_{v}": sp[v].value for v in sp}, **{f"speedup_{v}_ci": [sp[v].low, sp[v].high] for v in sp}})
        print(f"{m:<11} {old.sum():>8.1f} {new.sum():>8.1f} {ratio.value:>10.3f} [{ratio.low:.3f}, {ratio.high:.3f}]"
              f"      " + " ".join(f"{sp[v].value:>6.2f} [{sp[v].low:.2f}, {sp[v].high:.2f}]" for v in sp))
    for what, where in mismatches.items():
        print(f"outputs differing, {what}: {len(where)} {where}")
    if args.out:
        args.out.write_text(json.dumps({"cpu": cpu_line(), "engine": args.engine, "rows": rows, "records": records,
                                        "mismatches": mismatches}, indent=1, default=float))


if __name__ == "__main__":
    main()
