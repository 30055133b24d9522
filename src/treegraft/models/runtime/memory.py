"""Memory: closing a checkpoint's file mapping once its weights are packed away, and handing freed heap
back to the system."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import mmap
from pathlib import Path

import torch
from torch import nn

__all__ = ["FilePages", "release_file_mappings", "return_freed_memory"]


def _file_mapped_ranges() -> list[tuple[int, int]]:
    """Address ranges of this process's file-backed memory mappings (Linux: /proc/self/maps; else none)."""
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return []
    ranges = []
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith("/"):
            start, end = (int(x, 16) for x in fields[0].split("-"))
            ranges.append((start, end))
    return ranges


def release_file_mappings(model: nn.Module) -> int:
    """Copy the tensors of ``model`` that still live in memory-mapped files into ordinary memory; returns
    the bytes copied.

    transformers maps safetensors checkpoints and hands out views of the mapped pages. Once a runtime
    has packed the linears, the tensors left (norms, embeddings, a kept head weight) keep each file's
    mapping open, and with it the pages of every weight already packed away: a loaded Qwen 1.5B + 0.5B
    pair in ``bfloat16_packed`` held 16.1 GiB resident, 7.6 GiB of it checkpoint pages; after this,
    10.4 GiB. Tensors that shared memory still share it (tied embeddings and heads). Where there is no
    /proc/self/maps (not Linux) nothing is copied.
    """
    ranges = _file_mapped_ranges()
    if not ranges:
        return 0

    def mapped(t: torch.Tensor) -> bool:
        if t.layout != torch.strided or t.is_mkldnn or t.device.type != "cpu" or t.numel() == 0:
            return False
        ptr = t.untyped_storage().data_ptr()
        return any(start <= ptr < end for start, end in ranges)

    copies: dict[tuple, torch.Tensor] = {}  # one copy per view of a mapped storage, so sharing survives

    def copy_of(t: torch.Tensor) -> torch.Tensor:
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
        if key not in copies:
            copies[key] = t.detach().clone()
        return copies[key]

    with torch.no_grad():
        for param in model.parameters():  # tied parameters are one object, listed once
            if mapped(param.data):
                param.data = copy_of(param.data)
        for module in model.modules():
            for name, buf in list(module._buffers.items()):
                if buf is not None and mapped(buf):
                    module._buffers[name] = copy_of(buf)
            for name, value in list(vars(module).items()):
                if type(value) is torch.Tensor and mapped(value):  # a plain attribute, e.g. a kept head weight
                    setattr(module, name, copy_of(value))
    return sum(t.untyped_storage().nbytes() for t in copies.values())


MADV_DONTNEED = 4  # Linux


class FilePages:
    """Drops the resident checkpoint pages under tensors that a runtime has just packed away.

    While ``apply_runtime`` packs a float32 model linear by linear, the file pages each original weight
    was read from stay resident until the whole mapping closes at the end: packing Qwen 1.5B to
    ``bfloat16_packed`` peaked at 16.65 GB for 8.2 GB kept. ``drop(weight)`` hands the whole pages inside
    ``weight``'s bytes back at once (``madvise(MADV_DONTNEED)``), so the peak is the packed copies plus
    one linear. Only tensors lying wholly inside one file-backed mapping are touched: such pages are
    clean copies of the file and would be read from it again if anything touched them (an anonymous
    page would be zeroed instead, so those are never dropped). No /proc/self/maps or no libc: a no-op."""

    def __init__(self):
        self.ranges = _file_mapped_ranges()
        self.dropped = 0  # bytes
        self._madvise = _libc_madvise()
        if self._madvise is None:
            self.ranges = []

    def drop(self, t: torch.Tensor | None) -> int:
        """Release the whole pages inside ``t``'s bytes if they are file-mapped; returns the bytes released."""
        if (t is None or not self.ranges or t.layout != torch.strided or t.device.type != "cpu" or t.is_mkldnn
                or not t.is_contiguous()):
            return 0
        start, size = t.data_ptr(), t.numel() * t.element_size()  # the tensor's own bytes, not its storage's
        if not any(lo <= start and start + size <= hi for lo, hi in self.ranges):
            return 0
        page = mmap.PAGESIZE
        first, last = -(-start // page) * page, (start + size) // page * page
        if last <= first or self._madvise(first, last - first, MADV_DONTNEED) != 0:
            return 0
        self.dropped += last - first
        return last - first


@functools.cache
def _libc():
    """The C library, or None where it cannot be loaded."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


@functools.cache
def _libc_madvise():
    madvise = getattr(_libc(), "madvise", None)
    if madvise is not None:
        madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return madvise


def _libc_malloc_trim():
    return getattr(_libc(), "malloc_trim", None)  # not glibc: nothing to trim


def return_freed_memory() -> None:
    """Collect garbage and give the heap's free pages back to the system (glibc ``malloc_trim``).

    glibc keeps the pages of freed tensors in its arenas: after ``runtime=auto`` measured and dropped a
    1.5B candidate the process still held 7.1 GB it no longer used (0.5 GB after a trim), and the pair
    loaded next stacked its own peak on top of it."""
    gc.collect()
    trim = _libc_malloc_trim()
    if trim is not None:
        trim(0)
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():  # the caching allocator's freed blocks too
        torch.cuda.empty_cache()
