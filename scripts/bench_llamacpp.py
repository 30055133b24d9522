"""The CPU users' reference: llama.cpp on the same GGUF files, prompts and token counts (optional; the
pipeline never needs it).

Run:
    python scripts/bench_llamacpp.py --pair qwen-coder-1.5b__0.5b --prompts-per-benchmark 1 --max-new-tokens 64

Builds llama.cpp once from the llama-cpp-python source package on PyPI (its vendored llama.cpp,
command-line tools only; cmake, several minutes on 2 cores) into outputs/llamacpp/build, writes the
pair's GGUF files there (the installed model packages' pieces, concatenated and checked), and runs on
each prompt (our chat-formatted benchmark prompts, greedy, one thread by default): plain decoding
(`llama-completion`), draft-model speculation and its n-gram mode (`llama-speculative-simple
--spec-type draft-simple | ngram-simple`), plus `llama-bench` text generation (tg) for both models.
Prints tokens/s per method and benchmark with the CPU line and writes outputs/llamacpp/<pair>.csv.
"""

from __future__ import annotations

import argparse
import io
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pandas as pd
from omegaconf import OmegaConf

from treegraft.config import CONF_DIR
from treegraft.data import BENCHMARKS, BenchmarkConfig, format_prompt, load_benchmark
from treegraft.machine import cpu_line
from treegraft.models import EMBEDDED_MODELS, load_tokenizer
from treegraft.models.embedded import _sha256_concat, gguf_parts
from treegraft.paths import REPO_ROOT

TARGETS = ("llama-bench", "llama-speculative-simple", "llama-completion")


def build(root: Path, version: str, jobs: int) -> Path:
    """The llama.cpp tools built from llama-cpp-python's source package (cached in ``root``)."""
    bin_dir = root / "build" / "bin"
    if all((bin_dir / t).exists() for t in TARGETS):
        return bin_dir
    root.mkdir(parents=True, exist_ok=True)
    spec = f"llama-cpp-python=={version}" if version else "llama-cpp-python"
    subprocess.run([sys.executable, "-m", "pip", "download", spec, "--no-binary", ":all:", "--no-deps", "-d", str(root)],
                   check=True)
    sdist = sorted(root.glob("llama_cpp_python-*.tar.gz"))[-1]
    with tarfile.open(sdist) as tar:
        tar.extractall(root, filter="data")
    src = next(root.glob("llama_cpp_python-*/vendor/llama.cpp"))
    # AMX off as in the library build (treegraft.engines.llama_cpp.build): ggml's AMX buffer type crashes on Q4_K_M
    # models on Xeons with AMX; the rest is the stock build users run
    from treegraft.engines.llama_cpp.build import AMX_OFF

    subprocess.run(["cmake", "-S", str(src), "-B", str(root / "build"), "-DCMAKE_BUILD_TYPE=Release",
                    "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DGGML_NATIVE=ON", "-DLLAMA_BUILD_SERVER=OFF",
                    "-DLLAMA_BUILD_TESTS=OFF", f"-DCMAKE_C_FLAGS={AMX_OFF}", f"-DCMAKE_CXX_FLAGS={AMX_OFF}"], check=True)
    subprocess.run(["cmake", "--build", str(root / "build"), "-j", str(jobs), "--target", *TARGETS], check=True)
    return bin_dir


def gguf_file(root: Path, name: str) -> Path:
    """The embedded model's GGUF file (its package pieces concatenated once, sha256 checked)."""
    model = EMBEDDED_MODELS[name]
    out = root / f"{name}.gguf"
    if not out.exists():
        tmp = out.with_suffix(".tmp")
        digest = _sha256_concat(gguf_parts(model), tmp, progress=False)
        if digest != model.sha256:
            raise SystemExit(f"error: sha256 of {name} is {digest}, expected {model.sha256}")
        tmp.rename(out)
    return out


def speed(pattern: str, text: str) -> float:
    found = re.findall(pattern, text)
    return float(found[-1]) if found else float("nan")


def run(cmd: list[str], threads: int) -> tuple[str, str]:
    """(stdout, stderr) of a llama.cpp tool; a failure is one line."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise SystemExit(f"error: {Path(cmd[0]).name} failed: {last}")
    return proc.stdout, proc.stderr


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pair", default="qwen-coder-1.5b__0.5b")
    parser.add_argument("--prompts-per-benchmark", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--draft-max", type=int, default=8, help="draft tokens per step (llama.cpp's --spec-draft-n-max)")
    parser.add_argument("--version", default="0.3.36", help="llama-cpp-python source package version")
    parser.add_argument("--jobs", type=int, default=2, help="parallel compile jobs")
    parser.add_argument("--out", default=str(REPO_ROOT / "outputs" / "llamacpp"))
    args = parser.parse_args()
    if shutil.which("cmake") is None:
        print("error: cmake not found: install it (Debian: apt install cmake) to build llama.cpp", file=sys.stderr)
        return 2
    pair = OmegaConf.load(CONF_DIR / "pair" / f"{args.pair}.yaml")
    if not str(pair.target).startswith("embedded:") or not str(pair.get("middle") or "").startswith("embedded:"):
        print(f"error: pair {args.pair} is not a pair of two embedded GGUF models", file=sys.stderr)
        return 2
    root = Path(args.out)
    bins = build(root, args.version, args.jobs)
    target, draft = (gguf_file(root, str(m).split(":", 1)[1]) for m in (pair.target, pair.middle))
    tokenizer = load_tokenizer(str(pair.target))
    print(f"CPU: {cpu_line()} | llama.cpp threads {args.threads}")
    common = ["-n", str(args.max_new_tokens), "--temp", "0", "-t", str(args.threads), "--seed", "0", "-no-cnv"]
    rows = []
    prompt_file = root / "prompt.txt"
    for bench in BENCHMARKS:
        for rec in load_benchmark(BenchmarkConfig(name=bench, num_prompts=args.prompts_per_benchmark)):
            prompt_file.write_text(format_prompt(tokenizer, rec["turns"][0]))
            plain = "".join(run([str(bins / "llama-completion"), "-m", str(target), "-f", str(prompt_file), *common],
                                args.threads))
            row = {"benchmark": bench, "question_id": rec["question_id"],
                   "plain": speed(r"eval time =.*?([\d.]+) tokens per second", plain)}
            for kind, extra in (("draft-simple", ["-md", str(draft)]), ("ngram-simple", [])):
                out = run([str(bins / "llama-speculative-simple"), "-m", str(target), "-f", str(prompt_file), *common[:-1],
                           "--spec-type", kind, "--spec-draft-n-max", str(args.draft_max), *extra], args.threads)
                row[kind] = speed(r"speed:\s*([\d.]+)\s*t/s", "".join(out))
            rows.append(row)
            print(row, flush=True)
    df = pd.DataFrame(rows)
    bench_rows = []
    for name, path in (("target", target), ("draft", draft)):
        csv, _ = run([str(bins / "llama-bench"), "-m", str(path), "-t", str(args.threads), "-p", "0", "-n", "64",
                      "-o", "csv"], args.threads)
        tg = pd.read_csv(io.StringIO(csv))["avg_ts"].iloc[-1]
        bench_rows.append(f"llama-bench tg64, {name} ({path.name}): {tg:.2f} tokens/s")
    summary = df.groupby("benchmark")[["plain", "draft-simple", "ngram-simple"]].mean().reindex(BENCHMARKS)
    summary.loc["mean"] = summary.mean()
    print(summary.round(2).to_string())
    for line in bench_rows:
        print(line)
    df.assign(cpu=cpu_line(), threads=args.threads, max_new_tokens=args.max_new_tokens).to_csv(
        root / f"{args.pair}.csv", index=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
