"""Build the six benchmark question files from the public Hugging Face datasets (needs a network).

Run:  python scripts/build_benchmarks.py                          # all six, 80 each, into the default dir
      python scripts/build_benchmarks.py --benchmarks gsm8k nq --num 80 --seed 0 --out-dir data/benchmarks

Writes <out-dir>/<name>/question.jsonl in the FastChat question format
({"question_id", "category", "turns", "reference"?}), the format `treegraft.data.load_benchmark`
reads; <out-dir> defaults to treegraft.paths.default_benchmarks_dir() ($TREEGRAFT_BENCHMARKS,
else <repo>/data/benchmarks). Without --seed the first --num rows of each split are taken; with
--seed the split is shuffled with that seed first. Question ids are sequential from the start id
of the reference files (gsm8k/alpaca/humaneval 0, mt_bench 81, cnndm 241, nq 321).

Sources:  gsm8k      openai/gsm8k (main, test): question, reference = answer ("... #### N")
          alpaca     tatsu-lab/alpaca (train): instruction of rows with an empty `input`, reference = output
          nq         google-research-datasets/nq_open (validation): question (capitalised, "?"), no reference
          humaneval  openai/openai_humaneval (test): "Complete the code I provided.\\n\\n" + prompt,
                     reference = canonical_solution
          cnndm      abisee/cnn_dailymail (3.0.0, test): "Summarize: " + article, reference = highlights
          mt_bench   HuggingFaceH4/mt_bench_prompts (train): prompt (two turns), category, reference

Each file is written atomically (temp file + os.replace) and read back with load_benchmark.
The underlying data keeps its own license (see the dataset cards).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from treegraft.data import BENCHMARKS, BenchmarkConfig, load_benchmark
from treegraft.paths import default_benchmarks_dir

Row = dict[str, Any]


def _gsm8k(row: Row) -> tuple[str, list[str], list[str]]:
    return "math", [row["question"]], [row["answer"]]


def _alpaca(row: Row) -> tuple[str, list[str], list[str]]:
    return "", [row["instruction"]], [row["output"]]


def _nq(row: Row) -> tuple[str, list[str], list[str]]:
    q = row["question"].strip()
    q = q[:1].upper() + q[1:]
    if not q.endswith("?"):
        q += "?"
    return "qa", [q], []


def _humaneval(row: Row) -> tuple[str, list[str], list[str]]:
    return "code", ["Complete the code I provided.\n\n" + row["prompt"]], [row["canonical_solution"]]


def _cnndm(row: Row) -> tuple[str, list[str], list[str]]:
    return "summarization", ["Summarize: " + row["article"]], [row["highlights"]]


def _mt_bench(row: Row) -> tuple[str, list[str], list[str]]:
    return row["category"], list(row["prompt"]), list(row.get("reference") or [])


@dataclass(frozen=True)
class Source:
    path: str
    config: str | None
    split: str
    start_id: int
    convert: Callable[[Row], tuple[str, list[str], list[str]]]
    keep: Callable[[Row], bool] | None = None  # row filter applied before selecting


SOURCES: dict[str, Source] = {
    "gsm8k": Source("openai/gsm8k", "main", "test", 0, _gsm8k),
    "alpaca": Source("tatsu-lab/alpaca", None, "train", 0, _alpaca, keep=lambda r: not r["input"].strip()),
    "nq": Source("google-research-datasets/nq_open", None, "validation", 321, _nq),
    "humaneval": Source("openai/openai_humaneval", None, "test", 0, _humaneval),
    "cnndm": Source("abisee/cnn_dailymail", "3.0.0", "test", 241, _cnndm),
    "mt_bench": Source("HuggingFaceH4/mt_bench_prompts", None, "train", 81, _mt_bench),
}
assert tuple(SOURCES) == BENCHMARKS


def build_records(name: str, num: int, seed: int | None) -> list[Row]:
    """Download one benchmark's split and turn `num` rows of it into question records."""
    import datasets  # imported here so that --help works quickly

    src = SOURCES[name]
    ds = datasets.load_dataset(src.path, src.config, split=src.split)
    if src.keep is not None:
        ds = ds.filter(src.keep)
    if seed is not None:
        ds = ds.shuffle(seed=seed)
    if len(ds) < num:
        raise ValueError(f"{name}: asked for {num} rows but {src.path} {src.split} has only {len(ds)}")
    records = []
    for i, row in enumerate(ds.select(range(num))):
        category, turns, reference = src.convert(row)
        rec: Row = {"question_id": src.start_id + i, "category": category, "turns": turns}
        if reference:
            rec["reference"] = reference
        records.append(rec)
    return records


def write_jsonl_atomic(records: list[Row], path: Path) -> None:
    """Write one JSON object per line to `path` via a temp file in the same folder + os.replace."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for rec in records:
                f.write(json.dumps(rec) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--benchmarks", nargs="+", default=list(BENCHMARKS), choices=list(BENCHMARKS), metavar="NAME",
                        help=f"which to build (default: all of {', '.join(BENCHMARKS)})")
    parser.add_argument("--num", type=int, default=80, help="questions per benchmark (default: 80)")
    parser.add_argument("--seed", type=int, default=None,
                        help="shuffle each split with this seed before taking --num rows (default: first rows)")
    parser.add_argument("--out-dir", default=str(default_benchmarks_dir()),
                        help="folder to write <name>/question.jsonl into (default: %(default)s)")
    args = parser.parse_args(argv)
    if args.num < 1:
        parser.error(f"--num must be >= 1, got {args.num}")

    out_dir = Path(args.out_dir)
    failed = []
    for name in args.benchmarks:
        target = out_dir / name / "question.jsonl"
        try:
            records = build_records(name, args.num, args.seed)
            write_jsonl_atomic(records, target)
            n = len(load_benchmark(BenchmarkConfig(name=name, benchmarks_dir=str(out_dir))))
        except Exception as e:  # report every benchmark, then fail at the end
            print(f"{name}: FAILED: {type(e).__name__}: {e}", file=sys.stderr)
            failed.append(name)
            continue
        print(f"{name}: wrote {n} questions to {target}")
    if failed:
        print(f"error: could not build {failed} (see above; downloading needs access to the Hugging Face Hub)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
