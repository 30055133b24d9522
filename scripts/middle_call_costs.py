"""What a middle-drafter call costs on llama.cpp, per call shape, against one target step (not a test).

Run:
    python scripts/middle_call_costs.py --rows 1 2 4 8 12 16 --draft-vocab 8192

A call of ``n`` rows is one ``llama_decode`` of the middle drafter (``n`` tokens after a ``--context``-token
cache, every row's distribution read) plus the log-softmax the drafter takes of each row. Three ways:
``full head`` (llama.cpp's LM head over the whole vocabulary on every row, as the drafter ran before it had
a draft vocabulary on llama.cpp), ``draft head`` (llama.cpp stops at the hidden states; the drafter's
:class:`~treegraft.engines.llama_cpp.head.VocabHead` reads the ``--draft-vocab`` most frequent tokens plus
the context's) and ``draft head, q4_0`` (the same with ``engine.middle_weights=q4_0``: the matrices
requantized to Q4_0 on llama.cpp's stock repacked kernels). t_tgt is the target's one-row step with logits (what a plain decoding step costs). The shapes
and the modes alternate, median of ``--repeats``. Prints the CPU line and one table; writes a CSV.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys

import pandas as pd
import torch
from omegaconf import OmegaConf
from rich.console import Console
from rich.table import Table

from treegraft.atomic import atomic_write
from treegraft.config import CONF_DIR
from treegraft.drafters.vocab import frequent_tokens
from treegraft.engines.llama_cpp import gguf_path, load_llama_pair
from treegraft.engines.llama_cpp.costs import timed_decode
from treegraft.engines.llama_cpp.head import VocabHead
from treegraft.engines.llama_cpp.model import GGUFModel
from treegraft.engines.llama_cpp.requant import requantized
from treegraft.machine import cpu_line
from treegraft.paths import REPO_ROOT, default_cache_dir, default_models_dir


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pair", default="qwen-coder-1.5b__0.5b", help="a conf/pair/<name>.yaml of GGUF models")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 12, 16])
    parser.add_argument("--draft-vocab", type=int, default=8192)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None, help="CSV (default outputs/bench/llama/middle_calls_<pair>.csv)")
    args = parser.parse_args()
    if any(n < 1 or n > 256 for n in args.rows):
        print(f"error: --rows must lie in 1..256, got {args.rows}", file=sys.stderr)
        return 2

    spec = OmegaConf.load(CONF_DIR / "pair" / f"{args.pair}.yaml")
    pair = load_llama_pair(spec.target, spec.middle, threads=args.threads)
    target, full = pair.target, pair.middle
    hidden = full.hidden_state_sibling()
    q4_0 = GGUFModel(str(requantized(full.path, default_models_dir())), n_ctx=full.n_ctx, n_seq=full.n_seq,
                     threads=args.threads, exact=False, hidden_states=True)
    vocab = frequent_tokens(pair.tokenizer, args.draft_vocab, full.n_vocab, default_cache_dir())
    rng = random.Random(0)
    context = [rng.randrange(full.n_vocab) for _ in range(args.context)]
    ids = torch.unique(torch.cat([vocab, torch.tensor(context)]))
    head = VocabHead(str(gguf_path(spec.middle)))
    for m in (target, full, hidden, q4_0):
        m.clear()
        m.decode(context, list(range(len(context))), [[0]] * len(context), [False] * len(context), fast=True)

    def read_full(n):
        torch.log_softmax(full.logits_rows(list(range(n))), dim=-1)

    def read_draft(n):
        torch.log_softmax(head.logits(hidden.hidden_rows(list(range(n))), ids), dim=-1)

    def read_q4_0(n):
        torch.log_softmax(head.logits(q4_0.hidden_rows(list(range(n))), ids), dim=-1)

    def read_target(n):
        torch.log_softmax(target.logits_rows(list(range(n))), dim=-1)

    rows, t_tgt = [], []
    for n in args.rows:
        tokens = [rng.randrange(full.n_vocab) for _ in range(n)]
        t_tgt.append(timed_decode(target, tokens[:1], args.context, args.repeats, read=read_target))
        before = timed_decode(full, tokens, args.context, args.repeats, read=read_full)
        after = timed_decode(hidden, tokens, args.context, args.repeats, read=read_draft)
        quant = timed_decode(q4_0, tokens, args.context, args.repeats, read=read_q4_0)
        rows.append({"rows": n, "full_head_ms": 1000 * before, "draft_head_ms": 1000 * after,
                     "draft_head_q4_0_ms": 1000 * quant})
    step = statistics.median(t_tgt)
    line = cpu_line()
    table = Table(title=f"middle-drafter call against one target step ({args.pair}, draft vocabulary "
                        f"{len(ids)} = {args.draft_vocab} frequent + context; t_tgt {1000 * step:.1f} ms)")
    modes = ("full_head", "draft_head", "draft_head_q4_0")
    table.add_column("rows", justify="right")
    for mode in modes:
        table.add_column(f"{mode.replace('_', ' ')} ms (t_mid/t_tgt)", justify="right")
    for r in rows:
        r["t_tgt_ms"] = 1000 * step
        for mode in modes:
            r[f"{mode}_ratio"] = r[f"{mode}_ms"] / r["t_tgt_ms"]
        table.add_row(str(r["rows"]), *(f"{r[f'{m}_ms']:.1f} ({r[f'{m}_ratio']:.2f})" for m in modes))
    console = Console()
    console.print(f"CPU line: {line}")
    console.print(table)
    out = args.out or REPO_ROOT / "outputs" / "bench" / "llama" / f"middle_calls_{args.pair}.csv"
    frame = pd.DataFrame(rows).assign(draft_vocab=len(ids), cpu=line)
    atomic_write(out, lambda tmp: frame.to_csv(tmp, index=False, float_format="%.4g"))
    console.print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
