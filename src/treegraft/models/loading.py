"""Loading target/middle model pairs.

One entry point, :func:`load_model`, takes any of

* ``embedded:<name>``: a model converted by ``make models`` into ``<models_dir>/<name>``;
* a local folder holding a Hugging Face model;
* a hub id such as ``Qwen/Qwen3-32B`` (the same ``from_pretrained`` call a GPU user makes);
* ``tiny-random:<seed>``: a tiny randomly initialised Llama built from a config (unit tests).

A pair (:class:`PairSpec`) is a target plus a middle drafter that is either another model or a
*self-draft*: the target's first ``k`` decoder layers with the target's own embeddings, final norm
and LM head, sharing the target's weights (no copy).

Where the weights go is a :class:`~treegraft.models.placement.Placement`: a target split over several
GPUs (``device_map``, ``max_memory``, CPU or disk offload through accelerate's hooks) and the middle
drafter on the target's device, a device of its own, or spread by accelerate. On CUDA a pair is checked
against the memory it may use before any weight is read (:func:`~treegraft.models.placement.check_fits`).

This module loads: one model (:func:`load_model`), its runtime (:func:`resolve_runtime`,
:func:`resolve_middle_runtime`) and a pair (:func:`load_pair`, :func:`load_pair_from_settings`). What a
source names, tokenizers and the vocabulary checks are in :mod:`.sources`; the self-draft in :mod:`.self_draft`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..paths import default_cache_dir
from ..devices import input_device
from .embedded import int4_blocks
from .placement import Placement, check_fits
from .runtime import (RuntimeChoice, apply_runtime, check_runtime_name, choose_runtime, effective_runtime,
                      runtime_load_dtype, runtime_unavailable)
from .self_draft import make_self_draft
from .sources import (EMBEDDED_PREFIX, ModelLoadError, check_same_output_size, check_same_vocabulary, load_tokenizer,
                      resolve_dtype, resolve_source)
from .tiny import TINY_PREFIX, tiny_model_of

__all__ = ["load_pair_from_settings", "PairSpec", "LoadedPair", "resolve_runtime", "runtime_choice",
           "resolve_middle_runtime", "placement_from", "load_model", "load_pair"]


@dataclass
class PairSpec:
    """A target model and its middle drafter.

    ``middle`` is a model source (same forms as :func:`load_model`), or ``None`` for a self-draft
    pair, in which case ``self_draft_layers`` says how many of the target's layers the drafter runs.
    """

    name: str
    target: str
    middle: str | None = None
    self_draft_layers: int | None = None
    description: str = ""
    tags: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if (self.middle is None) == (self.self_draft_layers is None):
            raise ValueError(
                f"pair {self.name!r}: give exactly one of middle (a model) or self_draft_layers (an int), "
                f"got middle={self.middle!r}, self_draft_layers={self.self_draft_layers!r}"
            )
        if self.self_draft_layers is not None and int(self.self_draft_layers) < 1:
            raise ValueError(f"pair {self.name!r}: self_draft_layers must be >= 1, got {self.self_draft_layers}")


@dataclass
class LoadedPair:
    spec: PairSpec
    target: nn.Module
    middle: nn.Module
    tokenizer: Any
    runtime: str = "float32"
    middle_runtime: str = "float32"
    engine: dict | None = None  # set by treegraft.front.load_engine_pair (engine=auto's choice)


def load_model(
    source: str,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    models_dir: str | os.PathLike | None = None,
    runtime: str | None = None,
    device_map: str | dict | None = None,
    max_memory: dict | None = None,
    offload_folder: str | None = None,
) -> nn.Module:
    """A causal LM in eval mode on ``device``: stock in ``dtype``, or switched to ``runtime``
    (one of :data:`~treegraft.models.runtime.RUNTIMES`; it sets the dtype itself).

    With ``device_map`` (``auto``, ``balanced``, ``sequential`` or a ``{module: device}`` dict) the model
    is placed by accelerate instead, over the GPUs and, where ``max_memory`` allows (``cpu`` / ``disk``
    entries, ``offload_folder``), offloaded; ``device`` is then ignored and the runtime must be a stock
    dtype (the packed CPU kernels need the whole model in host memory)."""
    from transformers import AutoModelForCausalLM

    if device_map is not None and runtime not in (None, "float32", "bfloat16"):
        raise ValueError(f"runtime {runtime} packs weights for CPU kernels and cannot be split with device_map; "
                         "use runtime=float32 or bfloat16 (or dtype=) with a device_map")
    torch_dtype = _weights_dtype(dtype, runtime)
    if source.startswith(TINY_PREFIX):
        model = tiny_model_of(source).to(torch_dtype)
        if device_map is not None:
            return _dispatch(model, device_map, max_memory, offload_folder).eval()
    else:
        path = resolve_source(source, models_dir)
        placed = {} if device_map is None else {"device_map": device_map, "max_memory": max_memory,
                                                "offload_folder": offload_folder}
        try:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, **placed)
        except (OSError, ValueError) as err:
            raise ModelLoadError(
                f"cannot load model {source!r}: {str(err).splitlines()[0]} "
                "(expected an embedded:<name>, a local Hugging Face folder or a hub id reachable from here)"
            ) from err
        if device_map is not None:
            return model.eval()
    model = model.to(device).eval()
    if runtime:
        blocks = _int4_blocks_of(source, models_dir) if runtime == "int4" else None
        apply_runtime(model, runtime, int4_blocks=blocks)
    return model


def _weights_dtype(dtype: str | torch.dtype, runtime: str | None) -> torch.dtype:
    """The dtype a model's weights are read in: ``runtime``'s (a runtime sets its own), else ``dtype``."""
    return runtime_load_dtype(runtime) if runtime else resolve_dtype(dtype)


def _dispatch(model: nn.Module, device_map, max_memory, offload_folder) -> nn.Module:
    """accelerate's placement of a model built in memory (what ``from_pretrained(device_map=...)`` does
    for a checkpoint): infer the map for a named strategy, then dispatch with its hooks."""
    from accelerate import dispatch_model, infer_auto_device_map

    if isinstance(device_map, str):
        device_map = infer_auto_device_map(model, max_memory=max_memory,
                                           no_split_module_classes=getattr(model, "_no_split_modules", None) or [])
    model = dispatch_model(model, device_map=device_map, offload_dir=offload_folder)
    model.hf_device_map = dict(device_map)
    return model


def _int4_blocks_of(source: str, models_dir) -> dict | None:
    """The GGUF's own int4 groups for an embedded model; None for other sources (quantized at load)."""
    if not source.startswith(EMBEDDED_PREFIX):
        return None
    return int4_blocks(resolve_source(source, models_dir))


def resolve_runtime(
    source: str,
    runtime: str,
    device: str | torch.device = "cpu",
    models_dir: str | os.PathLike | None = None,
    cache_dir: str | os.PathLike | None = None,
    log=print,
) -> str:
    """``runtime`` itself, or for ``auto`` the runtime measured fastest for ``source`` on this machine
    (:func:`~treegraft.models.runtime.choose_runtime`, cached in ``<cache_dir>/runtime.json``)."""
    if runtime != "auto":
        check_runtime_name(runtime)
        return runtime
    return runtime_choice(source, device, models_dir, cache_dir, log).runtime


def runtime_choice(
    source: str,
    device: str | torch.device = "cpu",
    models_dir: str | os.PathLike | None = None,
    cache_dir: str | os.PathLike | None = None,
    log=print,
) -> RuntimeChoice:
    """``runtime=auto``'s choice for ``source`` on this machine, with the verification curve of every
    runtime it measured (:func:`~treegraft.models.runtime.choose_runtime`, cached in
    ``<cache_dir>/runtime.json``)."""
    exact = source.startswith(EMBEDDED_PREFIX)  # only GGUF-born models have int4 blocks of their own
    cache_file = Path(cache_dir or default_cache_dir()) / "runtime.json"
    model_id = f"{source} ({resolve_source(source, models_dir)})" if exact else source
    return choose_runtime(lambda rt: load_model(source, device=device, models_dir=models_dir, runtime=rt),
                          model_id, device, cache_file=cache_file, log=log, int4_exact=exact)


def load_pair(
    spec: PairSpec,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    models_dir: str | os.PathLike | None = None,
    runtime: str | None = None,
    cache_dir: str | os.PathLike | None = None,
    log=print,
    middle_runtime: str | None = "same",
    placement: Placement | None = None,
    kv_tokens: int = 4096,
) -> LoadedPair:
    """Load target, middle drafter and the shared tokenizer, checking the vocabularies match.

    ``runtime`` (``auto`` or a name of :data:`~treegraft.models.runtime.RUNTIMES`) is applied to the
    target (``auto`` is measured on it); None loads stock models in ``dtype``. ``middle_runtime``: the
    middle drafter's, ``same`` (the target's), a runtime name, or ``auto`` (:func:`resolve_middle_runtime`:
    ``int8`` where its kernel runs, else the target's). A drafter's numerics only move acceptance,
    never the output, so it may run a lossier, faster runtime than the target. A self-draft shares the
    target's modules and so its runtime.

    ``placement`` (:class:`~treegraft.models.placement.Placement`): a split target and where the middle
    drafter goes. Its ``device_map`` applies on ``cuda`` (every visible GPU), and on a CPU or one indexed GPU
    where ``max_memory`` is given (offload) or the map is explicit; a plain CPU run keeps the whole pair in
    host memory with its runtime kernels. On
    CUDA, or with ``max_memory``, the pair is first checked against the memory it may use at ``kv_tokens``
    positions (:func:`~treegraft.models.placement.check_fits`), before any weight is read.
    """
    placement = placement or Placement()
    device = torch.device(device)
    split = placement.device_map is not None and ((device.type == "cuda" and device.index is None)
                                                  or placement.max_memory is not None
                                                  or isinstance(placement.device_map, dict))
    estimate = None
    if device.type == "cuda" or placement.max_memory is not None:
        stock = _weights_dtype(dtype, None if runtime == "auto" else runtime)  # auto's choice: not yet measured
        estimate = check_fits(spec, stock, device, placement if split else Placement(None, placement.max_memory, "same"),
                              kv_tokens, models_dir)
    tokenizer = load_tokenizer(spec.target, models_dir)
    if spec.middle is not None:
        check_same_vocabulary(tokenizer, load_tokenizer(spec.middle, models_dir), spec.target, spec.middle)
    if runtime is not None:
        runtime = resolve_runtime(spec.target, runtime, device, models_dir, cache_dir, log)
    mid_runtime = runtime
    middle = None
    gpus_split = split and device.type == "cuda"
    if spec.middle is not None:
        mid_runtime = resolve_middle_runtime(middle_runtime, runtime, device)
        if gpus_split and placement.middle not in ("same", "auto"):
            middle = load_model(spec.middle, dtype, torch.device(placement.middle), models_dir, mid_runtime)
        elif gpus_split and placement.middle == "same":  # first, on the first GPU, which the target's map then counts
            middle = load_model(spec.middle, dtype, torch.device("cuda", 0), models_dir, mid_runtime)
    memory = placement.accelerate_memory()
    if gpus_split and memory is None and estimate is not None:
        # accelerate fills each GPU with weights alone: leave each its share of the KV caches and a tenth for
        # activations and the allocator
        count = torch.cuda.device_count()
        memory = {i: max(0, int(0.9 * torch.cuda.mem_get_info(i)[0]) - estimate.kv_cache // count) for i in range(count)}
    if split:
        target = load_model(spec.target, dtype, device, models_dir, runtime, placement.device_map, memory,
                            placement.offload_folder)
    else:
        target = load_model(spec.target, dtype, device, models_dir, runtime)
    if spec.self_draft_layers is not None:
        middle = make_self_draft(target, int(spec.self_draft_layers))
    elif middle is None:
        if placement.middle == "auto" and split:
            left = _memory_left(memory)  # what the target did not take of the caps
            middle = load_model(spec.middle, dtype, device, models_dir, mid_runtime, "auto", left,
                                placement.offload_folder)
        else:
            home = input_device(target) if placement.middle in ("same", "auto") else torch.device(placement.middle)
            middle = load_model(spec.middle, dtype, home, models_dir, mid_runtime)
    check_same_output_size(target, middle, spec.target, spec.middle)
    stock = "bfloat16" if resolve_dtype(dtype) == torch.bfloat16 else "float32"
    return LoadedPair(spec=spec, target=target, middle=middle, tokenizer=tokenizer, runtime=runtime or stock,
                      middle_runtime=mid_runtime or stock)


def _memory_left(memory: dict | None) -> dict | None:
    """``max_memory`` caps less what the models loaded so far hold on each GPU (None: accelerate measures
    what is free itself)."""
    if memory is None:
        return None
    from .placement import parse_bytes

    return {k: (max(0, parse_bytes(v) - torch.cuda.memory_allocated(k)) if isinstance(k, int) else v)
            for k, v in memory.items()}


def load_pair_from_settings(spec: PairSpec, settings, device: str | torch.device | None = None, dtype=None,
                            log=print) -> LoadedPair:
    """The one way an entry point loads its pair: :func:`load_pair` with the entry point's settings
    (any object with ``runtime``, ``middle_runtime`` and ``paths.models_dir`` / ``paths.cache_dir``, e.g. a
    Hydra config); ``device`` / ``dtype`` default to ``settings.device`` / ``settings.dtype``. The older
    ``dtype`` option wins over ``runtime`` where both are set (:func:`~treegraft.models.runtime.effective_runtime`)."""
    device = settings.device if device is None else device
    dtype = getattr(settings, "dtype", None) if dtype is None else dtype
    group = getattr(settings, "placement", None)
    return load_pair(spec, device=device, models_dir=settings.paths.models_dir,
                     runtime=effective_runtime(settings.runtime, dtype), cache_dir=settings.paths.cache_dir, log=log,
                     middle_runtime=settings.middle_runtime, placement=placement_from(group),
                     kv_tokens=int(getattr(group, "kv_tokens", None) or 4096))


def placement_from(settings) -> Placement:
    """A :class:`Placement` from a config group (``device_map``, ``max_memory``, ``middle``,
    ``offload_folder``; any may be missing) or None (the defaults)."""
    if settings is None:
        return Placement()
    get = settings.get if hasattr(settings, "get") else lambda k, d=None: getattr(settings, k, d)
    device_map = get("device_map", None)
    max_memory = get("max_memory", None)
    if device_map is not None and not isinstance(device_map, str):
        device_map = dict(device_map)
    return Placement(device_map=device_map, max_memory=dict(max_memory) if max_memory is not None else None,
                     middle=str(get("middle", "same") or "same"), offload_folder=get("offload_folder", None))


def resolve_middle_runtime(middle_runtime: str | None, target_runtime: str | None,
                           device: str | torch.device = "cpu") -> str | None:
    """The middle drafter's runtime: ``same`` / None -> the target's; ``auto`` -> ``int8`` where its
    AVX-512 VNNI kernel runs on ``device`` and the target has a runtime (not a stock dtype), else the
    target's; a name -> that runtime (checked)."""
    if middle_runtime in (None, "same"):
        return target_runtime
    if middle_runtime == "auto":
        if target_runtime is not None and runtime_unavailable("int8", device) is None:
            return "int8"
        return target_runtime
    check_runtime_name(middle_runtime, "middle_runtime", also=("auto", "same"))
    return middle_runtime
