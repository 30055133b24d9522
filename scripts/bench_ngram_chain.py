"""Measure a chain-sized n-gram drafter on llama.cpp against `ar` and `all_small`, in one process (not a test).

Run:
    python scripts/bench_ngram_chain.py --rates-from outputs/bench/llama/i50_treegraft_q4 --prompt-offset 8

The drafter of ``scripts/ngram_headroom.py``'s ``calibrated_chain``, run for real on the exact engine: each turn
drafts one chain (the longest matching n-gram's most frequent continuation, the most recent among equals, up to
``--max-depth`` tokens) and verifies the prefix k that maximizes (1 + E[accepted]) / t(k + 1), E from the
acceptance rate of each token's kind (matched order, depth, unanimous continuation) fitted on the ``ar`` outputs
of another run (``--rates-from``: a ``scripts/bench_llama_engine.py`` folder; use other prompts than the ones
measured here, ``--prompt-offset``), t from the engine's measured curve. It is a measurement of the policy before
it moves into the library's n-gram drafter, so the loop lives here. `ar`, the chain and `all_small` run
interleaved prompt by prompt, greedy; every output must equal `ar`'s. Prints the CPU line, end-to-end and
decode-only speedups with paired bootstrap 95% CIs, per benchmark; writes one row per prompt to a CSV.
``scripts/bench_llama_engine.py`` runs the same decoder as ``llama:ngram_chain`` (``--chain-rates-from``), beside
stock llama.cpp's tools.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import pandas as pd
from omegaconf import OmegaConf

from treegraft.atomic import atomic_write
from treegraft.config import CONF_DIR
from treegraft.data import BENCHMARKS, BenchmarkConfig, format_prompt, load_benchmark
from treegraft.decoding import GenerationResult
from treegraft.decoding.sampling import SamplingConfig
from treegraft.decoding.turn_stats import TurnStats
from treegraft.decoding.verify import verify_tree
from treegraft.engines.llama_cpp import load_llama_pair
from treegraft.front import decoder_for
from treegraft.machine import cpu_line
from treegraft.paths import REPO_ROOT, default_cache_dir
from treegraft.pipeline.headroom import NGramIndex, chain_rows, fit_rates, load_bench_records, relative_costs
from treegraft.stats import bootstrap_weights, interval, ratio_of_sums
from treegraft.tree import SMALL, DraftTree


class ChainDecoder:
    """Greedy decoding with one n-gram chain a turn, cut where expected tokens per unit of t(n) is best."""

    def __init__(self, engine, eos_ids: set[int], rates: dict, costs: list[float], max_n: int, max_depth: int):
        self.engine, self.eos_ids, self.rates, self.costs = engine, eos_ids, rates, costs
        self.max_n, self.max_depth = max_n, max_depth

    def generate(self, prompt: list[int], max_new_tokens: int) -> GenerationResult:
        engine, clock = self.engine, self.engine.clock
        start = clock.now()
        engine.prefill(prompt, 0, None)  # no prompt scores: the chain reads none
        start -= engine.prefill_charge_s
        prefill_s = clock.now() - start
        index, root, out, turns = NGramIndex(self.max_n, prompt), prompt[-1], [], []
        while True:
            chain = index.chain(self.max_depth)
            tree, node = DraftTree.with_root(root), 0
            for token, _ in chain[:chain_rows(chain, self.rates, self.costs)]:
                node = tree.add_child(node, token, 0.0, SMALL, 1)
            context = engine.context_len()
            inputs, acc = verify_tree(engine, tree, list(range(1, len(tree))), clock, TurnStats(), lambda cum: 1.0,
                                      SamplingConfig(), None, None)
            engine.keep(context, list(acc.rows))
            turns.append({"accepted": acc.accepted, "verified_nodes": len(tree) - 1})
            for token in [tree.token[inputs.node_ids[r]] for r in acc.rows[1:]] + [acc.bonus]:
                out.append(token)
                index.append(token)
                if token in self.eos_ids or len(out) >= max_new_tokens:
                    return GenerationResult(out, len(prompt), clock.now() - start, prefill_s,
                                            "eos" if token in self.eos_ids else "max_new_tokens", turns)
            root = out[-1]


def chain_decoder(engine, eos_ids: set[int], rates_from: Path, cache_dir=None, max_n: int = 5,
                  max_depth: int = 8) -> ChainDecoder:
    """A :class:`ChainDecoder` on ``engine`` with kind rates fitted on the ``llama:ar`` outputs under
    ``rates_from`` (a bench_llama_engine.py folder) and t(n) from the engine's measured curve."""
    fitted = load_bench_records(rates_from, "llama:ar")  # (a one-line exit when the folder has none)
    rates = fit_rates(list(zip(fitted["prompt"], fitted["output"])), max_n, max_depth)
    curve = engine.verify_curve(cache_dir or default_cache_dir(), 64)
    return ChainDecoder(engine, eos_ids, rates, relative_costs(curve, max_depth), max_n, max_depth)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pair", default="qwen-coder-1.5b__0.5b", help="a conf/pair/<name>.yaml of GGUF models")
    parser.add_argument("--rates-from", type=Path, required=True, help="a bench_llama_engine.py folder with llama:ar records")
    parser.add_argument("--prompts-per-benchmark", type=int, default=8)
    parser.add_argument("--prompt-offset", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--max-n", type=int, default=5)
    parser.add_argument("--max-depth", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "outputs" / "bench" / "llama" / "ngram_chain.csv")
    args = parser.parse_args()

    fitted = load_bench_records(args.rates_from, "llama:ar")
    spec = OmegaConf.load(CONF_DIR / "pair" / f"{args.pair}.yaml")
    pair = load_llama_pair(spec.target, None, threads=args.threads)
    tok = pair.tokenizer
    ar, small = decoder_for("ar", pair), decoder_for("all_small", pair)
    chain = chain_decoder(small.engine, small.eos_ids, args.rates_from, max_n=args.max_n, max_depth=args.max_depth)
    prompts = [(b, rec["question_id"], tok(format_prompt(tok, rec["turns"][0]), add_special_tokens=False).input_ids)
               for b in BENCHMARKS
               for rec in load_benchmark(BenchmarkConfig(name=b, num_prompts=args.prompts_per_benchmark,
                                                         offset=args.prompt_offset))]
    fitted_ids = set(zip(fitted["benchmark"], fitted["question_id"]))
    overlap = [p[:2] for p in prompts if p[:2] in fitted_ids]
    print(f"rates: {len(chain.rates)} kinds from {len(fitted)} prompts of {args.rates_from}; "
          f"{len(overlap)} of the {len(prompts)} measured prompts among them")
    ar.generate(prompts[0][2], 8), chain.generate(prompts[0][2], 8), small.generate(prompts[0][2], 8)  # warm-up
    rows = []
    for i, (bench, qid, ids) in enumerate(prompts):
        a, c, s = ar.generate(ids, args.max_new_tokens), chain.generate(ids, args.max_new_tokens), small.generate(ids, args.max_new_tokens)
        if not (c.tokens == a.tokens == s.tokens):
            print(f"error: prompt {bench}/{qid}: an output differs from ar's", file=sys.stderr)
            return 1
        rows.append({"benchmark": bench, "question_id": qid, "new_tokens": len(a.tokens), "ar_s": a.wall_time_s,
                     "ar_prefill_s": a.prefill_time_s, "chain_s": c.wall_time_s, "chain_prefill_s": c.prefill_time_s,
                     "chain_turns": len(c.turns), "all_small_s": s.wall_time_s, "all_small_prefill_s": s.prefill_time_s})
        print(f"{i + 1}/{len(prompts)} {bench}: ar {a.wall_time_s:.2f} s, chain {c.wall_time_s:.2f} s, "
              f"all_small {s.wall_time_s:.2f} s", flush=True)
    df = pd.DataFrame(rows).assign(cpu=cpu_line())
    atomic_write(args.out, lambda tmp: df.to_csv(tmp, index=False))
    w = bootstrap_weights(df["benchmark"].tolist(), 2000)
    ar_s, ar_d = df["ar_s"].to_numpy(), (df["ar_s"] - df["ar_prefill_s"]).to_numpy()
    print(f"CPU line: {cpu_line()}; n = {len(df)} x {args.max_new_tokens} tokens, 0 outputs differ from ar")
    for name in ("chain", "all_small"):
        total, decode = df[f"{name}_s"].to_numpy(), (df[f"{name}_s"] - df[f"{name}_prefill_s"]).to_numpy()
        print(f"{name}: end to end x ar {interval(ratio_of_sums(ar_s, total), w).format()}, "
              f"decode x ar {interval(ratio_of_sums(ar_d, decode), w).format()}")
    print(f"chain over all_small: {interval(ratio_of_sums(df['all_small_s'].to_numpy(), df['chain_s'].to_numpy()), w).format()}")
    print("chain x ar by benchmark: " + ", ".join(f"{b} {g['ar_s'].sum() / g['chain_s'].sum():.2f}"
                                                  for b, g in df.groupby("benchmark", sort=False)))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
