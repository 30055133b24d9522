"""What repeating K/V for grouped-query attention costs a tree verification, and what folding saves.

Run:
    python scripts/bench_gqa.py [--target embedded:qwen-coder-1.5b] [--runtime auto] [--device cpu]
        [--contexts 256 1024 2048] [--rows 16] [--repeats 12]

A verification-shaped forward (``rows`` tree rows under a mask on a cache of ``context`` tokens, the LM head
on one row) with transformers' sdpa, which copies every K/V head G times under a mask ("repeat"), and with
``treegraft.model_io.tree_sdpa``, which folds the G query heads of a K/V head into its rows ("fold"), the
two interleaved repeat by repeat; the median of each and fold / repeat with a bootstrap 95% CI over repeats.
Also checks that both give the same hidden states (max abs difference).
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np
import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="embedded:qwen-coder-1.5b")
    ap.add_argument("--runtime", default="auto")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--contexts", nargs="+", type=int, default=[256, 1024, 2048])
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=12)
    args = ap.parse_args()

    from treegraft import model_io
    from treegraft.devices import Clock, device_tensor, input_device
    from treegraft.machine import machine_line
    from treegraft.models.loading import load_model, resolve_runtime
    from treegraft.stats import bootstrap_weights, interval, ratio_of_sums

    runtime = resolve_runtime(args.target, args.runtime, args.device, log=lambda *a: None)
    model = load_model(args.target, device=args.device, runtime=runtime)
    groups = model.config.num_attention_heads // model.config.num_key_value_heads
    clock, dev = Clock.of(model), input_device(model)
    print(f"{args.target} ({runtime}), {model.config.num_attention_heads} query / {model.config.num_key_value_heads} "
          f"K/V heads (G = {groups}), {args.rows} rows; {machine_line([args.device])}")
    print(f"{'context':>8} {'repeat ms':>10} {'fold ms':>9} {'fold / repeat [95% CI]':>26} {'max |diff|':>11}")
    gen = torch.Generator().manual_seed(0)
    for context in args.contexts:
        cache = model_io.new_cache()
        prefix = device_tensor(torch.randint(0, model.config.vocab_size, (context,), generator=gen), dev)
        with torch.inference_mode():
            model_io.forward_hidden(model, cache, prefix, torch.arange(context, device=dev), None)
            tokens = device_tensor(torch.randint(0, model.config.vocab_size, (args.rows,), generator=gen), dev)
            pos = torch.arange(context, context + args.rows, device=dev)
            allowed = torch.ones(args.rows, context + args.rows, dtype=torch.bool, device=dev)
            allowed[:, context:] = torch.tril(allowed[:, context:])
            times = {"repeat": [], "fold": []}
            hidden = {}
            for i in range(args.repeats + 1):
                for mode in (("repeat", "fold") if i % 2 else ("fold", "repeat")):
                    model_io.GQA_UNDER_MASK = mode
                    t0 = clock.now()
                    h = model_io.forward_hidden(model, cache, tokens, pos, allowed)
                    model_io.lm_logits(model, h[:1])
                    if i:
                        times[mode].append(clock.now() - t0)
                    hidden[mode] = h.float()
                    model_io.truncate_cache(cache, context)
        model_io.GQA_UNDER_MASK = "fold"
        fold, rep = np.array(times["fold"]), np.array(times["repeat"])
        ci = interval(ratio_of_sums(fold, rep), bootstrap_weights([0] * len(fold)))
        diff = float((hidden["fold"] - hidden["repeat"]).abs().max())
        print(f"{context:>8} {1000 * statistics.median(rep):>10.1f} {1000 * statistics.median(fold):>9.1f} "
              f"{ci.value:>12.3f} [{ci.low:.3f}, {ci.high:.3f}] {diff:>11.2e}")


if __name__ == "__main__":
    main()
