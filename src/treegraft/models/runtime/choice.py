"""``runtime=auto``: the runtime measured fastest for a model on this machine, cached."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping

import torch
from torch import nn

from ...atomic import atomic_write_json, read_json
from ...machine import cpu_info, cpu_line
from .kernels import runtime_cache_key
from .linears import Int4Linear, int4_supported_shape, quantize_int4_rtn
from .memory import return_freed_memory
from .names import RUNTIMES, runtime_unavailable
from .timing import curve_at, forward_curve, int4_crossover

__all__ = ["pick_runtime", "RuntimeChoice", "DEFAULT_CANDIDATES", "float32_redundant", "choose_runtime"]


def pick_runtime(curves: Mapping[str, Mapping[int, float]], verify_rows: int = 8) -> str:
    """The runtime with the lowest ``t(1) + t(verify_rows)``; ties go to the earlier entry of ``curves``.

    ``t(1)`` is what a plain decoding step and a chain drafter pay per token, ``t(verify_rows)`` what a
    small-tree verification costs; weighting them equally favours runtimes good at both, so neither
    ``ar`` nor the tree methods are measured on a runtime tuned against them.
    """
    if not curves:
        raise ValueError("no runtime curves to pick from")
    return min(curves, key=lambda r: (curve_at(curves[r], 1) + curve_at(curves[r], verify_rows), list(curves).index(r)))


@dataclass
class RuntimeChoice:
    runtime: str
    curves: dict[str, dict[int, float]] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)  # candidate -> why it was not measured
    cached: bool = False
    cpu: dict = field(default_factory=cpu_info)

    def summary(self) -> str:
        parts = []
        for name, curve in self.curves.items():
            parts.append(f"{name}: t(1)={1000 * curve_at(curve, 1):.0f} ms, t(8)={1000 * curve_at(curve, 8):.0f} ms")
        skipped = "; ".join(f"{k} skipped ({v})" for k, v in self.skipped.items())
        src = "cached" if self.cached else "measured"
        return f"runtime auto -> {self.runtime} ({src} on {cpu_line()}): " + "; ".join(parts) + (f"; {skipped}" if skipped else "")


DEFAULT_CANDIDATES = ("float32", "float32_packed", "bfloat16_packed", "int4")
FLOAT32_REDUNDANT = ("bf16 is native here: a float32 step moves twice the bytes (1.9-2.6x slower on Zen 4, Zen 5 "
                     "and a Xeon with AMX) and float32 weights take twice bfloat16's memory")


def float32_redundant(runtime: str, candidates: tuple[str, ...], device: str | torch.device = "cpu") -> bool:
    """Whether ``runtime`` is a float32 candidate that ``bfloat16_packed`` (also a candidate, and runnable)
    makes not worth measuring. Decoding a 1.5B model is bound by the bytes of weight it streams: on every
    bf16-native CPU we measured, ``bfloat16_packed`` beat both float32 runtimes at every row count, and
    measuring ``float32_packed`` (then float32 weights plus two packed copies) set ``make all``'s memory
    peak (20 GB of 24)."""
    return (runtime in ("float32", "float32_packed") and "bfloat16_packed" in candidates
            and runtime_unavailable("bfloat16_packed", device) is None)


INT4_SLOWER = "the int4 kernel is slower than the dense one at every row count on this CPU"


def largest_linear_shape(model: nn.Module) -> tuple[int, int] | None:
    """``(out, in)`` of the largest linear but the LM head, whatever runtime swapped it."""
    head = model.get_output_embeddings()
    shapes = [(m.out_features, m.in_features) for m in model.modules()
              if m is not head and hasattr(m, "out_features") and hasattr(m, "in_features")]
    return max(shapes, key=lambda s: s[0] * s[1]) if shapes else None


def int4_crossover_of_shape(out_features: int, in_features: int) -> int:
    """:func:`int4_crossover` on a random weight of this shape: the int4 kernel's speed depends on the
    shape, not the values, so this tells whether a model's int4 runtime can win before loading it (the
    int4 candidate holds a float32 model, its int4 blocks and a dense packed fallback at once: on a
    1.5B model that candidate set the memory peak of ``runtime=auto``, 19.4 GB, while its kernel lost
    at every row count)."""
    if not int4_supported_shape(out_features, in_features):
        return 1  # cannot tell here: measure the real model
    weight = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(0)) * 0.02
    return int4_crossover(Int4Linear(quantize_int4_rtn(weight)))


def choose_runtime(
    load: Callable[[str], nn.Module],
    model_id: str,
    device: str | torch.device = "cpu",
    candidates: tuple[str, ...] = DEFAULT_CANDIDATES,
    cache_file: str | Path | None = None,
    sizes=(1, 2, 4, 8, 16),
    context: int = 256,
    log: Callable[[str], None] | None = print,
    int4_exact: bool = True,
    float32_where_bf16: bool = False,
) -> RuntimeChoice:
    """Measure each available candidate on a freshly loaded model (``load(runtime)`` returns the model
    already switched to that runtime) and pick one with :func:`pick_runtime`.

    The choice is printed through ``log`` when measured, not when read from the cache. One model is
    alive at a time (switching a 1.5B model to ``float32_packed`` peaks at ~15 GB). On CUDA the choice
    is ``bfloat16`` without measuring. ``int4`` is a candidate only when ``int4_exact`` (the model's
    int4 weights are its own GGUF blocks, not a lossy re-quantization) and its kernel beats the dense
    one on at least one-row products (otherwise it would run dense everywhere). Where ``bfloat16_packed``
    runs (native bf16) the float32 candidates are not measured unless ``float32_where_bf16``
    (:func:`float32_redundant`): they set the process's memory peak and never won.
    """
    device = torch.device(device)
    if device.type != "cpu":
        choice = RuntimeChoice("bfloat16", skipped={"measure": f"{device.type}: bfloat16 without measuring"})
        if log:
            log(choice.summary())
        return choice
    key = runtime_cache_key(model_id, device)
    cache = read_json(cache_file, {}) if cache_file else {}
    if key in cache and cache[key].get("runtime") in RUNTIMES:
        entry = cache[key]
        return RuntimeChoice(entry["runtime"], {r: {int(n): s for n, s in c.items()} for r, c in entry["curves"].items()},
                             entry.get("skipped", {}), cached=True, cpu=entry.get("cpu", cpu_info()))
    curves: dict[str, dict[int, float]] = {}
    skipped: dict[str, str] = {}
    largest = None  # (out, in) of the largest body linear, once a candidate was loaded
    for runtime in candidates:
        reason = runtime_unavailable(runtime, device)
        if runtime == "int4" and not reason and not int4_exact:
            reason = "the model has no int4 blocks of its own (re-quantizing would change its numerics)"
        if not reason and not float32_where_bf16 and float32_redundant(runtime, candidates, device):
            reason = FLOAT32_REDUNDANT
        if not reason and runtime == "int4" and largest is not None and int4_crossover_of_shape(*largest) < 1:
            reason = INT4_SLOWER  # probed on a stand-in of the model's largest linear: the model is never loaded
        if reason:
            skipped[runtime] = reason
            continue
        model = load(runtime)
        largest = largest or largest_linear_shape(model)
        if runtime == "int4":
            rows = [m.max_rows for m in model.modules() if isinstance(m, Int4Linear)]
            if not rows or max(rows) < 1:
                skipped[runtime] = INT4_SLOWER
                del model
                return_freed_memory()
                continue
        curves[runtime] = forward_curve(model, sizes=sizes, context=context, repeats=2)
        del model
        return_freed_memory()
    choice = RuntimeChoice(pick_runtime(curves), curves, skipped)
    if cache_file:
        cache = read_json(cache_file, {})
        cache[key] = {"runtime": choice.runtime, "curves": choice.curves, "skipped": skipped, "cpu": choice.cpu}
        atomic_write_json(cache, cache_file)
    if log:
        log(choice.summary())
    return choice

