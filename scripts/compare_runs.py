"""Two runs of the same experiment side by side: each method's mean speedup with its 95% CI in either
run, and the difference with a CI from resampling the prompts both runs evaluated (issue: two
fresh-clone `make all` runs must agree within +-0.05x, or their CIs must say why not).

Run:
    python scripts/compare_runs.py /path/to/run1/outputs/pipeline/cpu /path/to/run2/outputs/pipeline/cpu
    python scripts/compare_runs.py RUN1 RUN2 --pair qwen-coder-1.5b__0.5b --markdown comparison.md
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd
from omegaconf import OmegaConf
from rich.console import Console

from treegraft.pipeline.common import fold_intervals, print_table, to_markdown
from treegraft.pipeline.estimates import PromptTable
from treegraft.pipeline.evaluate import read_records


def compare(run_a: Path, run_b: Path, pair: str | None = None, tolerance: float = 0.05,
            n_resamples: int = 2000) -> pd.DataFrame:
    """One row per method of ``pair`` (default: run A's first configured pair)."""
    a, b = read_records(Path(run_a) / "evaluate"), read_records(Path(run_b) / "evaluate")
    config = Path(run_a) / "evaluate" / "config.yaml"
    pair = pair or (OmegaConf.load(config).pipeline.pairs[0] if config.exists() else a["pair"].iloc[0])
    a, b = a[a["pair"] == pair].assign(pair="A"), b[b["pair"] == pair].assign(pair="B")
    table = PromptTable(pd.concat([a, b], ignore_index=True), n_resamples)
    rows = []
    for method in dict.fromkeys([*a["method"], *b["method"]]):
        row = {"pair": pair, "method": method}
        for run in ("A", "B"):
            ci = table.speedup(method, [run])
            row.update({f"run {run}": ci.value, f"run {run} lo": ci.low, f"run {run} hi": ci.high})
        diff = table.run_difference(method, "A", "B")
        row.update({"B - A": diff.value, "B - A lo": diff.low, "B - A hi": diff.high, "n common prompts": diff.n,
                    f"within +-{tolerance:g}x": bool(abs(diff.value) <= tolerance)})
        rows.append(row)
    return pd.DataFrame(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_a", type=Path, help="outputs/pipeline/<experiment> of the first run")
    parser.add_argument("run_b", type=Path, help="outputs/pipeline/<experiment> of the second run")
    parser.add_argument("--pair", default=None, help="the pair to compare (default: run A's first configured pair)")
    parser.add_argument("--tolerance", type=float, default=0.05, help="agreement tolerance on a mean speedup")
    parser.add_argument("--markdown", type=Path, default=None, help="also write the table here")
    args = parser.parse_args()
    for run in (args.run_a, args.run_b):
        if not (run / "evaluate").is_dir():
            print(f"error: no evaluate/ records under {run}: expected outputs/pipeline/<experiment>", file=sys.stderr)
            sys.exit(2)
    df = compare(args.run_a, args.run_b, args.pair, args.tolerance)
    print_table(fold_intervals(df), "mean speedup per method, two runs (95% CIs over prompts)", Console(width=200))
    if args.markdown:
        args.markdown.write_text(to_markdown(fold_intervals(df), "{}"))


if __name__ == "__main__":
    main()
