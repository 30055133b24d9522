"""Host reads per turn of every tree method on the tiny pair (a CPU stand-in for host-device syncs).

Run:
    python scripts/host_reads.py [--max-new-tokens 64] [--sites]

Each method decodes one prompt greedily (after a warm-up generation) under
:func:`treegraft.hostreads.count_host_reads`: every ``.item()``, ``.tolist()``, ``.cpu()``, ``.numpy()`` and
Python conversion of a tensor is counted, per turn. ``treegraft`` runs with a distilled scheduler of
random weights (it calls at some steps, not others). ``--sites`` lists where the reads happen.
"""

from __future__ import annotations

import argparse


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--sites", action="store_true")
    args = ap.parse_args()

    from treegraft.front import decoder_for
    from treegraft.hostreads import count_host_reads
    from treegraft.models import PairSpec, load_pair
    from treegraft.scheduling.learned import LearnedScheduler, MarginPredictor
    from treegraft.scheduling.signals import REFERENCE_SIGNALS

    pair = load_pair(PairSpec(name="tiny-random", target="tiny-random:0", middle="tiny-random:1"))
    prompt = list(range(5, 45)) + list(range(5, 25))
    print(f"{'method':<12} {'turns':>5} {'reads':>6} {'per turn':>9}")
    for method in ("all_small", "all_mid", "fixed", "csd", "treegraft"):
        scheduler = None
        if method == "treegraft":
            scheduler = LearnedScheduler(MarginPredictor.untrained(5, list(REFERENCE_SIGNALS)))
        dec = decoder_for(method, pair, {}, scheduler=scheduler)
        dec.generate(prompt, 8)
        with count_host_reads() as reads:
            out = dec.generate(prompt, args.max_new_tokens)
        turns = len(out.turns)
        print(f"{method:<12} {turns:>5} {reads.total:>6} {reads.total / turns:>9.1f}")
        if args.sites:
            for site, n in reads.by_site.most_common(8):
                print(f"    {site:<40} {n}")


if __name__ == "__main__":
    main()
