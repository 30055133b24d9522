"""How much could any n-gram drafter gain on a run's own outputs, at its engine's measured costs?

Replays the `ar` records of an evaluate run against model-free n-gram drafters (a hindsight bound on any
n-gram tree, a hindsight chain, a calibrated chain that sees no future), each step verified at the
target's measured t(n) (the run's warm-up curve, or --curve); prints decode-only and end-to-end speedups
over `ar` with paired bootstrap 95% CIs. What each policy means: `treegraft.pipeline.headroom`.

Run:
    python scripts/ngram_headroom.py outputs/pipeline/cpu_llama_full
    python scripts/ngram_headroom.py outputs/bench/llama/<out> --decoders llama:all_small --curve 1:30,2:37,...
    python scripts/ngram_headroom.py RUN --curve 1:59,2:70,3:87,4:105 --max-depth 6
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rich.console import Console

from treegraft.pipeline.headroom import headroom, load_ar_records, load_bench_records, replay_all, step_table


def _curve_from_run(run: Path, pair: str) -> dict[int, float]:
    path = run / "collect" / pair / "runtime.json"
    if not path.exists():
        raise SystemExit(f"error: {path} not found: pass --curve 1:ms,2:ms,... (the target's t(n))")
    return {int(n): float(s) for n, s in json.loads(path.read_text())["verify_curve"].items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="outputs/pipeline/<experiment>")
    parser.add_argument("--pair", default=None, help="the pair (default: the records' first)")
    parser.add_argument("--curve", default=None, help="t(n) as n:ms pairs, e.g. 1:59,2:70,4:105 (default: the run's warm-up curve)")
    parser.add_argument("--max-n", type=int, default=5, help="longest n-gram looked up")
    parser.add_argument("--max-depth", type=int, default=8, help="deepest draft")
    parser.add_argument("--markdown", type=Path, default=None, help="also write the table here")
    parser.add_argument("--decoders", nargs="*", default=[],
                        help="a bench folder's measured methods on the same prompts (e.g. llama:all_small llama:treegraft): "
                             "their speedups and the fraction of the bound they reach")
    args = parser.parse_args()
    records = load_ar_records(args.run, args.pair)
    pair = args.pair or records["pair"].iloc[0]
    records = records[records["pair"] == pair].reset_index(drop=True)
    if args.curve:
        try:
            curve = {int(n): float(ms) for n, ms in (item.split(":") for item in args.curve.split(","))}
        except ValueError:
            sys.exit(f"error: --curve {args.curve!r}: expected n:ms pairs such as 1:59,2:70,4:105")
    else:
        curve = _curve_from_run(args.run, pair)
    if args.decoders and not (args.run / "runs").is_dir():
        sys.exit(f"error: --decoders reads a bench folder (scripts/bench_llama_engine.py --out-dir); {args.run} is not one")
    decoders = {m: load_bench_records(args.run, m) for m in args.decoders}
    replays = replay_all(records, curve, args.max_n, args.max_depth)
    table = headroom(records, curve, args.max_n, args.max_depth, decoders=decoders, replays=replays)
    console = Console(width=160)
    console.print(f"{pair}, {len(records)} prompts, {records['runtime'].iloc[0]} on {records['cpu'].iloc[0]}; "
                  f"t(n) ms: " + ", ".join(f"{n}: {curve[n] * (1000 if curve[n] < 10 else 1):.0f}" for n in sorted(curve)))
    console.print(table.to_string(index=False))
    steps = step_table(records, replays, decoders=decoders)
    console.print("\nper step, over every prompt (a replay's milliseconds are ar's per token times its t(1) units):")
    console.print(steps.to_string(index=False))
    if args.markdown:
        args.markdown.write_text(table.to_markdown(index=False) + "\n\n" + steps.to_markdown(index=False) + "\n")


if __name__ == "__main__":
    main()
