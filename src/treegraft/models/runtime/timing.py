"""Timing on this machine: kernel crossovers and a model's forward-cost curve."""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING, Callable, Mapping

import torch
from torch import nn

from ...devices import Clock, device_tensor, input_device, now
from ...torch_ops import int4_mm, onednn_linear, onednn_pack
from .kernels import avx512_kernels

if TYPE_CHECKING:
    from .linears import Int4Linear

__all__ = ["int4_crossover", "bf16_crossover", "forward_curve", "curve_at"]


def _timed(fn: Callable[[], object], min_s: float = 0.05, repeats: int = 3) -> float:
    fn()
    times = []
    for _ in range(repeats):
        n, start = 0, now()  # host kernels: the host clock
        while True:
            fn()
            n += 1
            if now() - start >= min_s / repeats:
                break
        times.append((now() - start) / n)
    return statistics.median(times)


def _rows_until_slower(narrow: Callable[[torch.Tensor], object], wide: Callable[[torch.Tensor], object],
                       in_features: int, rows: tuple[int, ...]) -> int | None:
    """The largest row count of ``rows`` up to which ``narrow(x)`` is at least as fast as ``wide(x)``
    (0: slower from the first), or None when it is never slower over ``rows``."""
    best = 0
    with torch.inference_mode():
        for r in rows:
            x = torch.randn(r, in_features)
            if _timed(lambda: narrow(x)) > _timed(lambda: wide(x)):
                return best
            best = r
    return None


def int4_crossover(linear: Int4Linear, rows: tuple[int, ...] = (1, 2, 4, 8, 16, 32)) -> int:
    """The largest row count up to which the int4 kernel is at least as fast as the dense packed copy
    on this linear (0: never; the dense copy then does every product)."""
    best = _rows_until_slower(
        lambda x: int4_mm(x, linear.packed, linear.group, linear.scales_zeros),
        linear.dense, linear.in_features, rows)
    return rows[-1] if best is None else best


def bf16_crossover(weight: torch.Tensor, rows: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)) -> int | None:
    """The largest row count up to which the AVX-512 bf16 kernel is at least as fast as oneDNN's packed
    bf16 product on ``weight`` ([out, in]); None when it is never slower over ``rows`` (or either
    kernel is missing), so no second copy is worth its memory."""
    kernels = avx512_kernels()
    if kernels is None:
        return None
    weight = weight.detach().to(torch.bfloat16).contiguous()
    try:
        onednn = onednn_pack(weight)
    except RuntimeError:
        return None
    ours = kernels.pack_bf16(weight)
    return _rows_until_slower(
        lambda x: kernels.linear_bf16(x, ours, weight.shape[0], None),
        lambda x: onednn_linear(x.bfloat16(), onednn, None),
        weight.shape[1], rows)


@torch.inference_mode()
def forward_curve(model: nn.Module, sizes=(1, 2, 4, 8, 16), context: int = 256, repeats: int = 3,
                  seed: int = 0) -> dict[int, float]:
    """Median seconds of a forward over ``n`` new tokens (chain mask) on a ``context``-token cache plus
    the LM head on one row, for each n in ``sizes`` (the shape of a tree verification)."""
    from ...model_io import forward_hidden, lm_logits, new_cache, truncate_cache

    device = input_device(model)
    clock = Clock.of(model)
    gen = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    cache = new_cache()
    prefix = device_tensor(torch.randint(0, vocab, (context,), generator=gen), device)
    forward_hidden(model, cache, prefix, torch.arange(context, device=device), None)
    curve: dict[int, float] = {}
    for n in sizes:
        tokens = device_tensor(torch.randint(0, vocab, (n,), generator=gen), device)
        pos = torch.arange(context, context + n, device=device)
        allowed = torch.ones(n, context + n, dtype=torch.bool, device=device)
        allowed[:, context:] = torch.tril(allowed[:, context:])
        times = []
        for i in range(repeats + 1):
            start = clock.now()
            hidden = forward_hidden(model, cache, tokens, pos, allowed)
            lm_logits(model, hidden[:1])
            if i:  # the first run is a warm-up
                times.append(clock.now() - start)
            truncate_cache(cache, context)
        curve[n] = statistics.median(times)
    return curve


def curve_at(curve: Mapping[int, float], n: int) -> float:
    """Latency at ``n`` rows: measured, else linearly interpolated (extrapolated flat past the end)."""
    if n in curve:
        return curve[n]
    xs = sorted(curve)
    if n <= xs[0]:
        return curve[xs[0]]
    if n >= xs[-1]:
        return curve[xs[-1]]
    hi = next(x for x in xs if x > n)
    lo = max(x for x in xs if x < n)
    return curve[lo] + (curve[hi] - curve[lo]) * (n - lo) / (hi - lo)

