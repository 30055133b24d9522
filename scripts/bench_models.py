"""Measure the embedded models on this machine: load time, forward latency, self-draft agreement.

Run:
    python scripts/bench_models.py                        # all converted embedded models
    python scripts/bench_models.py --models smollm2-135m --dtypes float32 --new-tokens 1 8
    python scripts/bench_models.py --agreement-only       # only the self-draft table

Prints two tables and writes them to outputs/bench/models/{latency,self_draft}.csv:
1. per model and dtype: load time, and the latency of one forward of 1/8/16/32/64 new tokens on
   top of a 512-token KV cache (the shape of a verification forward over a draft tree);
2. per self-draft depth k: top-1 agreement with the full model on 200 positions of real text
   (benchmark prompts), the relative cost k/L, and the chain speedup that agreement implies
   (see `self_draft_score`); the best k is the default of the `<model>__self` pair configs.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import pandas as pd
import torch
from rich.console import Console
from rich.table import Table

from treegraft.data import BenchmarkConfig, load_benchmark
from treegraft.models import EMBEDDED_MODELS, load_model, load_tokenizer, make_self_draft
from treegraft.models.embedded import is_converted
from treegraft.paths import REPO_ROOT, default_models_dir


def forward_latency(model, context: int, new_tokens: int, repeats: int) -> float:
    """Median ms of one forward of ``new_tokens`` tokens over a ``context``-token KV cache."""
    from treegraft.model_io import new_cache, truncate_cache

    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, vocab, (1, context), generator=gen)
    step = torch.randint(0, vocab, (1, new_tokens), generator=gen)
    times = []
    with torch.inference_mode():
        cache = new_cache()  # every layer keeps all positions, so the step can be dropped again
        model(input_ids=prefix, cache=cache, use_cache=True, logits_to_keep=1)
        for _ in range(repeats + 1):  # the first run is a warm-up
            start = time.perf_counter()
            model(input_ids=step, cache=cache, use_cache=True)
            times.append((time.perf_counter() - start) * 1000)
            truncate_cache(cache, context)  # drop the step again: every repeat sees the same context
    return statistics.median(times[1:])


def real_text_ids(tokenizer, positions: int) -> torch.Tensor:
    """``positions`` + 1 tokens of real text: the first prompts of several benchmarks, concatenated."""
    text = []
    for name in ("alpaca", "gsm8k", "humaneval", "cnndm"):
        ds = load_benchmark(BenchmarkConfig(name=name, num_prompts=3))
        text.extend(t[0] for t in ds["turns"])
    ids = tokenizer("\n\n".join(text)).input_ids[: positions + 1]
    if len(ids) < positions + 1:
        raise ValueError(f"benchmark text gave only {len(ids)} tokens, need {positions + 1}")
    return torch.tensor([ids])


def self_draft_score(agreement: float, cost: float, max_len: int = 8) -> float:
    """Expected speedup of chain drafting with per-token acceptance ``agreement`` and relative cost ``cost``.

    With gamma drafted tokens, a turn costs gamma*cost + 1 target forwards and yields
    (1 - a^(gamma+1)) / (1 - a) tokens (Leviathan et al., 2023); the best gamma in 1..max_len is taken.
    """
    a = min(agreement, 0.999)
    return max((1 - a ** (g + 1)) / (1 - a) / (g * cost + 1) for g in range(1, max_len + 1))


def agreement_table(model, tokenizer, name: str, positions: int) -> list[dict]:
    ids = real_text_ids(tokenizer, positions)
    total = len(model.base_model.layers)
    rows = []
    with torch.inference_mode():
        target_top1 = model(input_ids=ids[:, :-1]).logits[0].argmax(-1)
        for k in range(1, total + 1):
            draft = make_self_draft(model, k)
            top1 = draft(input_ids=ids[:, :-1]).logits[0].argmax(-1)
            agreement = (top1 == target_top1).float().mean().item()
            rows.append(
                {"model": name, "k": k, "layers": total, "agreement": agreement, "cost": k / total,
                 "chain_speedup": self_draft_score(agreement, k / total)}
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=None)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--new-tokens", nargs="+", type=int, default=[1, 8, 16, 32, 64])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--positions", type=int, default=200)
    parser.add_argument("--agreement-only", action="store_true")
    parser.add_argument("--no-agreement", action="store_true", help="skip the self-draft table")
    parser.add_argument("--out-dir", default=str(REPO_ROOT / "outputs" / "bench" / "models"))
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    models_dir = default_models_dir()
    names = args.models or [n for n, m in EMBEDDED_MODELS.items() if is_converted(models_dir / n, m)]
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    console = Console()

    latency_rows, agreement_rows = [], []
    for name in names:
        tokenizer = load_tokenizer(f"embedded:{name}")
        for dtype in args.dtypes if not args.agreement_only else ["float32"]:
            start = time.perf_counter()
            model = load_model(f"embedded:{name}", dtype=dtype)
            load_s = time.perf_counter() - start
            if not args.agreement_only:
                row = {"model": name, "dtype": dtype, "load_s": round(load_s, 2)}
                for n in args.new_tokens:
                    row[f"ms_{n}"] = round(forward_latency(model, args.context, n, args.repeats), 1)
                latency_rows.append(row)
                console.print(row)
            if dtype == "float32" and not args.no_agreement:
                agreement_rows.extend(agreement_table(model, tokenizer, name, args.positions))
            del model

    if latency_rows:
        df = pd.DataFrame(latency_rows)
        df.to_csv(out_dir / "latency.csv", index=False)
        table = Table(title=f"forward latency (ms) at a {args.context}-token context, median of {args.repeats}")
        for col in df.columns:
            table.add_column(col)
        for _, r in df.iterrows():
            table.add_row(*[str(v) for v in r.values])
        console.print(table)
    if not agreement_rows:
        return
    df = pd.DataFrame(agreement_rows)
    df.to_csv(out_dir / "self_draft.csv", index=False)
    table = Table(title=f"self-draft top-1 agreement on {args.positions} positions (best k marked *)")
    for col in ("model", "k", "agreement", "cost k/L", "chain speedup"):
        table.add_column(col)
    for name, group in df.groupby("model", sort=False):
        best = group.loc[group["chain_speedup"].idxmax(), "k"]
        for _, r in group.iterrows():
            mark = "*" if r["k"] == best else ""
            table.add_row(name, f"{r['k']}{mark}", f"{r['agreement']:.3f}", f"{r['cost']:.2f}", f"{r['chain_speedup']:.2f}")
    console.print(table)


if __name__ == "__main__":
    main()
