"""This engine's cost curve: seconds of one ``llama_decode`` over n tree rows on a real KV cache.

The same shape as the PyTorch engine's curve (a chain of n rows after a 256-token context, median of
repeats after a warm-up, every row's logits requested as a verification does), measured on this
machine and cached per CPU line, GGUF file, thread count and mode (exact or stock): the budget planner,
the tree shape and the scheduler's cost context read it.
"""

from __future__ import annotations

import hashlib
import statistics
from pathlib import Path
from typing import Callable

from ...devices import now
from ...machine import cpu_line
from ..curves import cached_curve
from .model import GGUFModel

__all__ = ["engine_curve", "timed_decode", "cached_engine_curve", "model_key"]


def model_key(model: GGUFModel) -> str:
    """Machine + file + threads + mode: what a measured cost depends on."""
    path = Path(model.path)
    digest = hashlib.sha256(f"{path.name}|{path.stat().st_size}".encode()).hexdigest()[:12]
    mode = "exact" if model.exact else "stock"
    from .build import installed_build

    build = (installed_build() or {}).get("patch_id", "stock build")  # the kernels the costs were measured with
    return f"{cpu_line()} | llama.cpp {mode} ({build}) | {model.threads} threads | {digest} ({path.name})"


def timed_decode(model: GGUFModel, tokens: list[int], context: int, repeats: int = 3,
                 read: Callable[[int], object] | None = None) -> float:
    """Median seconds of a decode of ``tokens`` (seq 0, every row's logits requested) after ``context`` cached
    cells, plus ``read(n)`` of its rows when given; the first run is a warm-up, and each run's cells are freed."""
    n, times = len(tokens), []
    for i in range(repeats + 1):
        elapsed = model.decode(tokens, list(range(context, context + n)), [[0]] * n, [True] * n)
        if read is not None:
            start = now()
            read(n)
            elapsed += now() - start
        if i:
            times.append(elapsed)
        model.seq_rm(0, context, -1)
        model.used -= n  # freed for reuse: timing only, so the cells' order does not matter here
    return statistics.median(times)


def engine_curve(model: GGUFModel, sizes=(1, 2, 4, 8, 16), context: int = 256, repeats: int = 3,
                 seed: int = 0) -> dict[int, float]:
    """Median seconds of a decode of ``n`` chained tokens (seq 0) after ``context`` tokens, for each n."""
    import random

    rng = random.Random(seed)
    context = max(0, min(context, model.n_ctx - max(sizes)))  # a small cache: a shorter context
    model.clear()
    prefix = [rng.randrange(model.n_vocab) for _ in range(context)]
    for start in range(0, context, model.n_batch):
        chunk = prefix[start:start + model.n_batch]
        model.decode(chunk, list(range(start, start + len(chunk))), [[0]] * len(chunk), [False] * len(chunk))
    curve = {n: timed_decode(model, [rng.randrange(model.n_vocab) for _ in range(n)], context, repeats)
             for n in sizes}
    model.clear()
    return curve


def cached_engine_curve(model: GGUFModel, cache_dir: str | Path | None, max_size: int = 64,
                        context: int = 256) -> dict[int, float]:
    """:func:`engine_curve` up to ``max_size + 1`` rows, cached (:func:`~treegraft.engines.curves.cached_curve`)."""
    return cached_curve(model_key(model), lambda sizes: engine_curve(model, sizes=sizes, context=context), cache_dir,
                        max_size, context)
