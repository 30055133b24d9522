"""A CPU stand-in for CUDA's device checks: where would a host tensor meet a model tensor?

On a GPU, a tensor made without a device lives on the host, and meeting a GPU tensor in an index, a
product or a ``cat`` stops the program ("indices should be either on cpu or on the same device"). On a
CPU every tensor is a host tensor, so such defects stay invisible. :class:`DeviceProvenance` tags, inside
its ``with`` block, every tensor born on the host (a factory such as ``torch.tensor`` / ``zeros`` /
``arange`` called without ``device=``, ``.cpu()``, and whatever is computed from host tensors alone)
and records every operation where a host tensor of one or more dimensions meets a tensor that is not
host-born (a model weight, an activation, a tensor made with ``device=``): on CUDA each is a crash or a
blocking copy. Explicit moves (``.to``, ``copy_``, writes into a device tensor) are allowed.
"""

from __future__ import annotations

import traceback
import weakref
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

FACTORIES = {torch.tensor, torch.as_tensor, torch.zeros, torch.ones, torch.full, torch.empty, torch.arange,
             torch.rand, torch.randn, torch.randint, torch.randperm, torch.eye, torch.linspace}
MOVES = {torch.Tensor.to, torch.Tensor.copy_, torch.Tensor.__setitem__, torch.Tensor.pin_memory,
         torch.Tensor.cuda, torch.Tensor.__len__, torch.Tensor.dim, torch.Tensor.size, torch.Tensor.numel,
         torch.Tensor.__repr__, torch.Tensor.__format__}


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)


class DeviceProvenance(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.host: set[int] = set()  # ids of live host-born tensors (a tensor's == is elementwise: no sets of tensors)
        self.violations: list[str] = []

    def _mark(self, value) -> None:
        for t in _tensors(value):
            if id(t) not in self.host:
                self.host.add(id(t))
                weakref.finalize(t, self.host.discard, id(t))

    def _is_host(self, t: torch.Tensor) -> bool:
        return id(t) in self.host

    def _where(self) -> str:
        for frame in reversed(traceback.extract_stack()[:-2]):
            if "/src/treegraft/" in frame.filename:
                return f"{frame.filename.split('/src/treegraft/')[1]}:{frame.lineno} ({frame.line})"
        return "<outside treegraft>"

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = [*_tensors(args), *_tensors(kwargs)]
        if func in FACTORIES:
            if kwargs.get("device") is None and all(self._is_host(t) for t in inputs):
                self._mark(out)
            return out
        if func is torch.Tensor.cpu:
            self._mark(out)
            return out
        if func is torch.Tensor.to and any(isinstance(a, (torch.device, str)) for a in [*args[1:], kwargs.get("device")]):
            # a move to a device makes a device tensor, even where the host is that device (then .to returns
            # its input: hand back an alias, so the input keeps its own provenance)
            return out.view(out.shape) if any(out is t for t in inputs) else out
        if func in MOVES or not inputs:
            return out
        host = [t for t in inputs if self._is_host(t)]
        if host and len(host) < len(inputs):
            if any(t.dim() > 0 for t in host):
                name = getattr(func, "__qualname__", getattr(func, "__name__", str(func)))
                self.violations.append(f"{name} at {self._where()}")
            return out
        if host:  # computed from host tensors alone: still on the host
            self._mark(out)
        return out
