"""Where a model's tensors live, how host data gets there, and the one clock every timed region reads.

A model may sit on one device, be split over several GPUs (``device_map``), or have layers offloaded
to the CPU or disk by accelerate's hooks. The decoder therefore never asks "the device of the model":

* :func:`input_device`: where token ids and position ids must go (the input embeddings' execution device);
* :func:`output_device`: where the LM head's logits come out (the sampling generator lives there);
* :func:`model_devices`: every device the model computes on (what a clock read must wait for).

Host data (token lists, positions, masks built on the host) goes to a device through
:func:`device_tensor`, which on CUDA stages it in pinned memory and copies without blocking: a plain
``torch.tensor(data, device="cuda")`` waits for the whole stream to drain first.

:class:`Clock` is the one timing helper: :meth:`Clock.now` synchronizes every CUDA device of its models
before reading ``time.perf_counter``, so a duration covers the GPU work launched inside it, not just
its launch. Every timed region that feeds a record, a feature, a cost curve or a planner reads it.
"""

from __future__ import annotations

import functools
import time
from typing import Iterable, Sequence

import torch
from torch import nn

__all__ = ["input_device", "output_device", "model_devices", "devices_of", "device_tensor", "synchronize", "Clock", "now",
           "device_line", "device_info", "cuda_devices", "reset_peak_memory", "peak_memory"]


def _module_device(module: nn.Module) -> torch.device:
    """Where ``module`` computes: accelerate's execution device when a hook moves its weights in (CPU or
    disk offload), else the device of its first parameter or buffer."""
    hook = getattr(module, "_hf_hook", None)
    hooks = [hook, *getattr(hook, "hooks", ())]  # accelerate's SequentialHook holds several
    execution = next((h.execution_device for h in hooks if getattr(h, "execution_device", None) is not None), None)
    if execution is not None:
        return torch.device(execution) if not isinstance(execution, int) else torch.device("cuda", execution)
    for tensor in module.parameters():
        if tensor.device.type != "meta":
            return tensor.device
    for tensor in module.buffers():
        if tensor.device.type != "meta":
            return tensor.device
    return torch.device("cpu")


def input_device(model: nn.Module) -> torch.device:
    """The device token and position ids must be on: the input embeddings'."""
    embeddings = model.get_input_embeddings()
    return _module_device(embeddings if embeddings is not None else model)


def output_device(model: nn.Module) -> torch.device:
    """The device the LM head's logits come out on."""
    head = model.get_output_embeddings()
    return _module_device(head if head is not None else model)


def model_devices(model: nn.Module) -> tuple[torch.device, ...]:
    """Every device ``model`` computes on (from ``hf_device_map`` where the model was split)."""
    devices = {input_device(model), output_device(model)}
    for place in (getattr(model, "hf_device_map", None) or {}).values():
        if isinstance(place, int):
            devices.add(torch.device("cuda", place))
        elif place not in ("disk", "meta"):
            devices.add(torch.device(place))
    return tuple(sorted(devices, key=str))


def devices_of(*models) -> tuple[torch.device, ...]:
    """Every device the given PyTorch models compute on (other engines' models, and None, contribute none)."""
    return tuple(dict.fromkeys(d for m in models if isinstance(m, nn.Module) for d in model_devices(m)))


def cuda_devices(devices: Iterable[torch.device]) -> tuple[torch.device, ...]:
    return tuple(d for d in dict.fromkeys(devices) if d.type == "cuda")


def device_tensor(data: Sequence, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """``data`` (a list, nested lists, or a host tensor) as a tensor on ``device``, without a host wait: on
    CUDA through pinned memory and a non-blocking copy (the pinned block is held by PyTorch's host
    allocator until the copy is done), elsewhere created there directly."""
    if device.type != "cuda":
        if isinstance(data, torch.Tensor):
            return data.to(device=device, dtype=dtype)
        return torch.tensor(data, dtype=dtype, device=device)
    host = data.to(dtype=dtype) if isinstance(data, torch.Tensor) else torch.tensor(data, dtype=dtype)
    return host.pin_memory().to(device, non_blocking=True)


def _sync_one(device: torch.device) -> None:
    # an idle stream needs no wait (a query does not block); a busy one is waited for, as the next host read
    # would anyway
    if not torch.cuda.current_stream(device).query():
        torch.cuda.synchronize(device)


def synchronize(devices: Iterable[torch.device]) -> None:
    """Wait for every queued kernel on the CUDA devices among ``devices`` (no-op for CPU devices)."""
    for device in cuda_devices(devices):
        _sync_one(device)


class Clock:
    """``now()``: seconds (``time.perf_counter``) after the CUDA devices of ``devices`` have finished
    what was queued on them. The one clock of every timed region (a CPU-only clock does no waiting)."""

    __slots__ = ("devices",)

    def __init__(self, devices: Iterable[torch.device] = ()):
        self.devices = cuda_devices(devices)

    @classmethod
    def of(cls, *models: nn.Module | None) -> "Clock":
        """A clock over every device the given models compute on."""
        return cls(d for model in models if model is not None for d in model_devices(model))

    def now(self) -> float:
        for device in self.devices:
            _sync_one(device)
        return time.perf_counter()


def reset_peak_memory(devices: Iterable[torch.device]) -> None:
    """Start counting the peak allocated memory afresh on the CUDA devices among ``devices``."""
    for device in cuda_devices(devices):
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(devices: Iterable[torch.device]) -> dict[str, int]:
    """Peak bytes allocated by PyTorch on each CUDA device among ``devices`` since the last reset ({} on a CPU)."""
    return {str(device): int(torch.cuda.max_memory_allocated(device)) for device in cuda_devices(devices)}


_HOST_CLOCK = Clock()


def now() -> float:
    """Seconds on the host clock, for what runs on the host alone (stage wall time, progress)."""
    return _HOST_CLOCK.now()


@functools.cache
def _cuda_names() -> tuple[str, ...]:
    return tuple(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))


def device_info(devices: Iterable[torch.device | str] = ()) -> dict:
    """The accelerator facts a measurement depends on: the GPU model(s) and how many of them the
    given devices use (empty for CPU-only work)."""
    cuda = [torch.device(d) for d in devices if torch.device(d).type == "cuda"]
    if not cuda or not torch.cuda.is_available():
        return {}
    names = _cuda_names()
    used = sorted({d.index if d.index is not None else torch.cuda.current_device() for d in cuda})
    models = sorted({names[i] for i in used if i < len(names)})
    return {"gpu": " + ".join(models), "gpu_count": len(used), "cuda": torch.version.cuda}


def device_line(devices: Iterable[torch.device | str] = ()) -> str:
    """``""`` on a CPU, else e.g. ``NVIDIA H100 80GB HBM3 x2 | CUDA 12.8``: what a cache key or a table
    row names besides the CPU line."""
    info = device_info(devices)
    if not info:
        return ""
    return f"{info['gpu']} x{info['gpu_count']} | CUDA {info['cuda']}"
