"""Where a pair's weights go, and whether they fit before any weight is read.

A target larger than one GPU (Llama-3.3-70B in bfloat16 is 141 GB) is split over several with
transformers' ``device_map`` (accelerate fills the GPUs in order, layer by layer; ``max_memory`` caps
each device; a ``cpu`` or ``disk`` entry allows offloading there). The middle drafter has a placement of
its own: on the target's first device (``same``), on a device of its own (``cuda:1``), or spread by
accelerate (``auto``). :class:`Placement` carries those choices; :func:`check_fits` refuses a pair whose
weights and KV caches at the experiment's length do not fit the memory given, in one line, from the
model configs alone (a meta-device instance counts the parameters: no weight is read).

The configs come from the model source (``config.json`` of a local folder or the hub); for the paper's
hub models a copy of their published shapes (:data:`HUB_SHAPES`) stands in when no hub is reachable,
so the check runs offline too.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping

import torch

__all__ = ["Placement", "PairDoesNotFitError", "HUB_SHAPES", "model_config", "parameter_count", "model_bytes",
           "kv_cache_bytes", "MemoryEstimate", "estimate_pair_memory", "available_bytes", "check_fits", "parse_bytes"]


class PairDoesNotFitError(RuntimeError):
    """The pair's weights and KV caches exceed the memory its placement may use."""


@dataclass(frozen=True)
class Placement:
    """Where a pair goes.

    ``device_map``: the target's ``None`` (whole on ``device``), ``"auto"`` / ``"balanced"`` /
    ``"sequential"`` (accelerate over every visible GPU, then what ``max_memory`` allows), or an explicit
    ``{module: device}`` dict. ``max_memory``: ``{device: bytes or "80GiB"}`` per device (keys ``0``,
    ``"cuda:1"``, ``"cpu"``, ``"disk"``), None = what is free on the GPUs (no offload).
    ``middle``: the middle drafter's: ``"same"`` (on the target's input device), a device (``"cuda:1"``),
    or ``"auto"`` (accelerate, after the target). ``offload_folder``: where ``disk`` offload writes.
    """

    device_map: str | dict | None = None
    max_memory: Mapping | None = None
    middle: str = "same"
    offload_folder: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.device_map, str) and self.device_map not in ("auto", "balanced", "balanced_low_0", "sequential"):
            raise ValueError(f"device_map must be auto, balanced, balanced_low_0, sequential, a dict or null, "
                             f"got {self.device_map!r}")
        if not isinstance(self.middle, str) or not self.middle:
            raise ValueError(f"middle placement must be same, auto or a device such as cuda:1, got {self.middle!r}")
        if self.middle not in ("same", "auto"):
            try:
                torch.device(self.middle)
            except RuntimeError:
                raise ValueError(f"middle placement must be same, auto or a device such as cuda:1, "
                                 f"got {self.middle!r}") from None

    @property
    def split(self) -> bool:
        return self.device_map is not None

    def accelerate_memory(self) -> dict | None:
        """``max_memory`` in accelerate's form (GPU keys as ints)."""
        if self.max_memory is None:
            return None
        out = {}
        for key, value in self.max_memory.items():
            k = str(key)
            if k.startswith("cuda:"):
                k = k.split(":", 1)[1]
            out[int(k) if k.isdigit() else k] = value
        return out


# Published shapes of the paper's hub models (their config.json), used only when the config cannot be read
# (no hub): enough to count parameters on the meta device and size the KV cache.
_QWEN3 = dict(model_type="qwen3", vocab_size=151936, head_dim=128, num_key_value_heads=8, max_position_embeddings=40960)
_LLAMA3 = dict(model_type="llama", vocab_size=128256, num_key_value_heads=8, max_position_embeddings=131072)
HUB_SHAPES: dict[str, dict[str, Any]] = {
    "Qwen/Qwen3-32B": {**_QWEN3, "hidden_size": 5120, "intermediate_size": 25600, "num_hidden_layers": 64,
                       "num_attention_heads": 64, "tie_word_embeddings": False},
    "Qwen/Qwen3-8B": {**_QWEN3, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
                      "num_attention_heads": 32, "tie_word_embeddings": False},
    "Qwen/Qwen3-4B": {**_QWEN3, "hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 36,
                      "num_attention_heads": 32, "tie_word_embeddings": True},
    "Qwen/Qwen3-1.7B": {**_QWEN3, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 28,
                        "num_attention_heads": 16, "tie_word_embeddings": True},
    "Qwen/Qwen3-0.6B": {**_QWEN3, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
                        "num_attention_heads": 16, "tie_word_embeddings": True},
    "meta-llama/Llama-3.3-70B-Instruct": {**_LLAMA3, "hidden_size": 8192, "intermediate_size": 28672,
                                          "num_hidden_layers": 80, "num_attention_heads": 64, "tie_word_embeddings": False},
    "meta-llama/Llama-3.1-8B-Instruct": {**_LLAMA3, "hidden_size": 4096, "intermediate_size": 14336,
                                         "num_hidden_layers": 32, "num_attention_heads": 32, "tie_word_embeddings": False},
    "meta-llama/Llama-3.2-3B-Instruct": {**_LLAMA3, "hidden_size": 3072, "intermediate_size": 8192, "head_dim": 128,
                                         "num_hidden_layers": 28, "num_attention_heads": 24, "tie_word_embeddings": True},
    "meta-llama/Llama-3.2-1B-Instruct": {**_LLAMA3, "hidden_size": 2048, "intermediate_size": 8192, "head_dim": 64,
                                         "num_hidden_layers": 16, "num_attention_heads": 32, "tie_word_embeddings": True},
}


def model_config(source: str, models_dir=None):
    """The transformers config of a model source (its ``config.json`` only; for a tiny random model, its
    built config), or the published shape of a paper hub model when the config cannot be read."""
    from transformers import AutoConfig

    from .sources import resolve_source
    from .tiny import TINY_PREFIX, tiny_model_of

    if source.startswith(TINY_PREFIX):
        with torch.device("meta"):
            return tiny_model_of(source).config
    try:
        return AutoConfig.from_pretrained(resolve_source(source, models_dir))
    except (OSError, ValueError) as err:
        if source in HUB_SHAPES:
            shape = dict(HUB_SHAPES[source])
            return AutoConfig.for_model(shape.pop("model_type"), **shape)
        raise ValueError(f"cannot read the config of {source!r} to size it: {str(err).splitlines()[0]}") from err


def parameter_count(config) -> int:
    """Parameters of a causal LM of this config, counted on the meta device (tied weights once)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def model_bytes(config, dtype: torch.dtype) -> int:
    return parameter_count(config) * torch.empty((), dtype=dtype, device="meta").element_size()


def kv_cache_bytes(config, tokens: int, dtype: torch.dtype) -> int:
    """Keys and values of ``tokens`` positions over every layer."""
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    element = torch.empty((), dtype=dtype, device="meta").element_size()
    return 2 * config.num_hidden_layers * heads * head_dim * int(tokens) * element


@dataclass(frozen=True)
class MemoryEstimate:
    target_weights: int
    middle_weights: int  # 0 for a self-draft (it shares the target's)
    kv_cache: int  # both models' KV caches at ``tokens`` positions
    tokens: int

    @property
    def total(self) -> int:
        return self.target_weights + self.middle_weights + self.kv_cache


def estimate_pair_memory(spec, dtype: torch.dtype, tokens: int, models_dir=None) -> MemoryEstimate:
    """Weights of both models in ``dtype`` and their KV caches at ``tokens`` positions (prompt, new
    tokens and a verified tree), from the configs alone."""
    target = model_config(spec.target, models_dir)
    kv = kv_cache_bytes(target, tokens, dtype)
    middle_weights = 0
    if spec.middle is not None:
        middle = model_config(spec.middle, models_dir)
        middle_weights = model_bytes(middle, dtype)
        kv += kv_cache_bytes(middle, tokens, dtype)
    else:  # a self-draft caches its own first layers
        layers = int(spec.self_draft_layers)
        kv += kv_cache_bytes(target, tokens, dtype) * layers // target.num_hidden_layers
    return MemoryEstimate(model_bytes(target, dtype), middle_weights, kv, int(tokens))


_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30,
          "tib": 2**40}


def parse_bytes(value) -> int:
    """``80000000000``, ``"80GB"`` or ``"74.5GiB"`` as bytes."""
    if isinstance(value, (int, float)):
        return int(value)
    text = str(value).strip().lower().replace(" ", "")
    for unit in sorted(_UNITS, key=len, reverse=True):
        if text.endswith(unit):
            try:
                return int(float(text[: -len(unit)]) * _UNITS[unit])
            except ValueError:
                break
    raise ValueError(f"bad memory size {value!r}; expected bytes or a size such as 80GiB or 40GB")


def _host_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def available_bytes(placement: Placement, device: str | torch.device) -> tuple[int, str]:
    """Bytes the placement may fill, and where: the sum of ``max_memory`` where given (its ``disk`` entry
    included); else the free memory of every visible GPU for a split target, of ``device`` otherwise (a
    CPU device: the host's available memory)."""
    if placement.max_memory is not None:
        where = ", ".join(f"{k}: {parse_bytes(v) / 1e9:.1f} GB" for k, v in placement.max_memory.items())
        return sum(parse_bytes(v) for v in placement.max_memory.values()), f"max_memory ({where})"
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise PairDoesNotFitError(f"device {device} asked for, but CUDA is not available here "
                                      "(torch.cuda.is_available() is False)")
        ids = range(torch.cuda.device_count()) if placement.split else \
            sorted({device.index or 0, *([torch.device(placement.middle).index or 0]
                                         if placement.middle not in ("same", "auto") else [])})
        free = {i: torch.cuda.mem_get_info(i)[0] for i in ids}
        return sum(free.values()), f"{len(free)} GPU(s) free ({', '.join(f'cuda:{i} {b / 1e9:.1f} GB' for i, b in free.items())})"
    return _host_available(), "host memory available"


def check_fits(spec, dtype: torch.dtype, device, placement: Placement, tokens: int, models_dir=None,
               margin: float = 1.1) -> MemoryEstimate:
    """Raise :class:`PairDoesNotFitError` (one line: bytes needed, bytes available, what to do) unless the
    pair's weights and KV caches, times ``margin`` for activations and the allocator, fit the memory its
    placement may use; nothing is loaded."""
    estimate = estimate_pair_memory(spec, dtype, tokens, models_dir)
    have, where = available_bytes(placement, device)
    need = int(estimate.total * margin)
    if need > have:
        dtype_name = str(dtype).removeprefix("torch.")
        raise PairDoesNotFitError(
            f"pair {spec.name} needs {need / 1e9:.1f} GB ({estimate.target_weights / 1e9:.1f} GB target + "
            f"{estimate.middle_weights / 1e9:.1f} GB middle weights in {dtype_name}, {estimate.kv_cache / 1e9:.1f} GB "
            f"KV cache at {tokens} tokens, x{margin:g}) but {have / 1e9:.1f} GB is available in {where}; split it "
            "over more GPUs (device_map=auto), allow offload (max_memory with a cpu entry) or use a smaller pair")
    return estimate
