"""The one cache of measured verification curves: seconds of a target forward by rows, per machine.

Each engine measures its own curve (a chain of n rows after a 256-token context, median of repeats after a
warm-up) and names what the figure depends on (CPU line or GPUs, model, runtime or build, threads); this
module keeps the sizes and the cache file, ``<cache_dir>/verify_curves.json``, shared by every engine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from ..atomic import atomic_write_json, read_json

__all__ = ["DEFAULT_SIZES", "curve_sizes", "cached_curve"]

# every size up to 6: on a CPU the cost of a row is not linear there (llama.cpp's exact kernels take up to 5
# columns in one pass over the weights and 6 or more in another kernel: t(5) = 2.3 t(1), t(6) = 3.6 t(1) on
# Zen 5), and interpolating t(5) from t(4) and t(8) priced the 5-row chains the n-gram tree verifies 20% high
DEFAULT_SIZES = (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48, 64)


def curve_sizes(max_size: int) -> list[int]:
    """The measured sizes up to ``max_size + 1`` rows (a budget of B verifies B + 1: the root too)."""
    return [s for s in DEFAULT_SIZES if s <= max_size + 1] or [1]


def cached_curve(key: str, measure: Callable[[list[int]], dict[int, float]], cache_dir: str | Path | None,
                 max_size: int = 64, context: int = 256) -> dict[int, float]:
    """``measure(sizes)`` for :func:`curve_sizes` ``(max_size)``, cached under ``key`` + context + sizes
    (``cache_dir`` None: measured every time)."""
    sizes = curve_sizes(max_size)
    key = f"{key} | ctx {context} | {sizes}"
    path = Path(cache_dir) / "verify_curves.json" if cache_dir else None
    cache = read_json(path, {}) if path else {}
    if key in cache:
        return {int(n): float(s) for n, s in cache[key].items()}
    curve = measure(sizes)
    if path:
        cache = read_json(path, {})  # read again: another process may have added its curve meanwhile
        cache[key] = curve
        atomic_write_json(cache, path)
    return curve
