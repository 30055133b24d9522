"""The verification-latency curve of a target and the `budget: auto` rule.

On a GPU a verification forward over a 63-node tree costs about as much as one decoding step, so
the paper's B_ver = 63 is nearly free; on a CPU the cost grows with the tree size from the first
extra token. ``auto`` measures the curve on the current machine (a forward over a tree of n tokens
on top of a real KV cache, n = 1..max_size, median of a few runs) and picks the largest tree whose
verification costs at most ``ratio`` times a one-token forward (default 2: a turn may cost two
plain decoding steps), so trees stay large where they are cheap and shrink where they are not.
"""

from __future__ import annotations

import statistics
import time

import torch
from torch import nn

from ..model_io import forward_hidden, lm_logits, new_cache, truncate_cache

__all__ = ["measure_verify_curve", "pick_budget", "DEFAULT_SIZES"]

DEFAULT_SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)


@torch.inference_mode()
def measure_verify_curve(
    model: nn.Module, context: int = 256, max_size: int = 64, sizes=None, repeats: int = 3, seed: int = 0,
    stop_ratio: float | None = None,
) -> dict[int, float]:
    """Median seconds of a verification forward (tree of n nodes, chain-shaped mask, plus the LM head
    on one row, as greedy acceptance computes it) for each n in ``sizes`` (default: up to ``max_size``).

    ``stop_ratio``: stop after the first size costing more than ``stop_ratio`` x the one-token
    forward (latency grows with n, so no larger tree can fit under that ratio either)."""
    sizes = [s for s in (sizes or DEFAULT_SIZES) if s <= max_size] or [1]
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    cache = new_cache()
    prefix = torch.randint(0, vocab, (context,), generator=gen).to(device)
    forward_hidden(model, cache, prefix, torch.arange(context, device=device), None)
    curve: dict[int, float] = {}
    for n in sizes:
        tokens = torch.randint(0, vocab, (n,), generator=gen).to(device)
        pos = torch.arange(context, context + n, device=device)
        allowed = torch.ones(n, context + n, dtype=torch.bool)
        allowed[:, context:] = torch.tril(allowed[:, context:])
        times = []
        for i in range(repeats + 1):
            start = time.perf_counter()
            hidden = forward_hidden(model, cache, tokens, pos, allowed)
            lm_logits(model, hidden[0])
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if i:  # the first run is a warm-up
                times.append(time.perf_counter() - start)
            truncate_cache(cache, context)
        curve[n] = statistics.median(times)
        if stop_ratio is not None and curve[n] > stop_ratio * curve[min(curve)]:
            break
    return curve


def pick_budget(curve: dict[int, float], ratio: float = 2.0) -> int:
    """The largest measured tree size n with latency(n) <= ratio * latency(1), minus the root (>= 1)."""
    base = curve[min(curve)]
    fitting = [n for n, t in curve.items() if t <= ratio * base]
    return max(1, max(fitting, default=1) - 1)
