"""The compiled small-batch kernels (``models/csrc``): built once per machine into PyTorch's extension cache."""

from __future__ import annotations

import contextlib
import functools
import os
import platform
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from ...machine import machine_line
from ...torch_ops import mkl_packing_available

__all__ = ["KERNELS_VERSION", "AVX512_FLAGS", "KERNELS", "Kernel", "KernelBuildError", "build_kernel",
           "strict_kernels", "small_gemm", "avx512_kernels", "runtime_cache_key"]

KERNELS_VERSION = 6  # part of every cached measurement's key: bump when a runtime's kernels change
_CSRC = Path(__file__).parent.parent / "csrc"


class KernelBuildError(RuntimeError):
    """A kernel this CPU supports did not build (with ``TREEGRAFT_STRICT_KERNELS=1``: ``make setup``, tests, CI)."""


@dataclass(frozen=True)
class Kernel:
    """A C++ source of ``models/csrc`` compiled with ``torch.utils.cpp_extension``."""

    name: str  # the extension's module name
    source: str  # file in models/csrc
    cflags: tuple[str, ...]
    cpu_flags: tuple[str, ...]  # /proc/cpuinfo flags the code needs
    without: str  # what runs instead when it is missing

    def supported(self) -> bool:
        """Whether this CPU can run it (x86-64 with every flag)."""
        return platform.machine().lower() in ("x86_64", "amd64") and set(self.cpu_flags) <= _cpu_flags()


SMALL_GEMM = Kernel("treegraft_small_gemm", "small_gemm.cpp", ("-O3", "-mavx2", "-mfma"), ("avx2", "fma"),
                    "float32_packed uses MKL/oneDNN only")
AVX512_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx512_vnni")
AVX512 = Kernel("treegraft_small_gemm_avx512", "small_gemm_avx512.cpp",
                ("-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mavx512vnni",
                 "-ffp-contract=off"), AVX512_FLAGS, "bfloat16_packed uses oneDNN, int8 is unavailable")
KERNELS = (SMALL_GEMM, AVX512)


def strict_kernels() -> bool:
    """``TREEGRAFT_STRICT_KERNELS=1``: a supported kernel that does not build is an error, not a warning."""
    return os.environ.get("TREEGRAFT_STRICT_KERNELS", "") not in ("", "0")


def build_kernel(kernel: Kernel, strict: bool | None = None):
    """The compiled module of ``kernel`` (built once per machine into PyTorch's extension cache,
    ``$TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``; ``make setup`` builds it ahead of
    time), or None where the CPU cannot run it. A failed build is one warning line naming what runs
    instead, or with ``strict`` (default :func:`strict_kernels`) a :class:`KernelBuildError`."""
    if not kernel.supported():
        return None
    try:
        from torch.utils.cpp_extension import load

        with _build_lock(kernel.name):
            return load(kernel.name, sources=[str(_CSRC / kernel.source)], extra_cflags=list(kernel.cflags),
                        verbose=False)
    except Exception as err:  # no compiler, no ninja, a compile error ...
        first = (str(err).strip().splitlines() or [""])[0][:200]
        message = f"{kernel.source} did not build ({type(err).__name__}: {first}); {kernel.without}"
        if strict_kernels() if strict is None else strict:
            raise KernelBuildError(message) from err
        warnings.warn(message, stacklevel=3)
        return None


@contextlib.contextmanager
def _build_lock(name: str):
    """PyTorch's build lock is a file (``lock`` in the extension's folder) that a build killed midway
    (Ctrl-C in ``make setup``) leaves behind, and every later build of that extension then waits on it
    forever. Builds here first take an ``flock`` of their own, which the OS releases when its holder dies;
    whoever holds it knows a ``lock`` file left in the folder is stale, and removes it."""
    try:
        import fcntl
        from torch.utils.cpp_extension import _get_build_directory

        folder = Path(_get_build_directory(name, verbose=False))
    except (ImportError, AttributeError):  # no flock (Windows) or another PyTorch layout: PyTorch's lock alone
        yield
        return
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "treegraft.flock", "a") as handle:  # closing the file releases the flock
        fcntl.flock(handle, fcntl.LOCK_EX)
        stale = folder / "lock"
        if stale.exists():
            stale.unlink()
            warnings.warn(f"removed a stale build lock left by an interrupted build: {stale}", stacklevel=4)
        yield


@functools.cache
def small_gemm():
    """The compiled small-batch float32 kernel (``csrc/small_gemm.cpp``, AVX2/FMA), or None where it
    cannot run or be built (:func:`build_kernel`)."""
    return build_kernel(SMALL_GEMM)


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return set(next((line for line in f if line.startswith("flags")), "").split()[2:])
    except OSError:
        return set()


@functools.cache
def avx512_kernels():
    """The compiled AVX-512 small-batch kernels (``csrc/small_gemm_avx512.cpp``: bf16 and per-row int8
    linears), or None where the CPU lacks one of :data:`AVX512_FLAGS` or the build fails (:func:`build_kernel`)."""
    return build_kernel(AVX512)


def _mkl_packing() -> bool:
    return mkl_packing_available()


def runtime_cache_key(model_id: str, device: str | torch.device | tuple = "cpu") -> str:
    """Machine + model: the CPU line (model name, ISA, bf16, threads, torch), the GPUs the model runs on
    (model and count, where ``device`` names any: one device or a tuple of them) and the model's identity."""
    devices = tuple(device) if isinstance(device, (tuple, list)) else (device,)
    where = ",".join(str(torch.device(d)) for d in devices)
    return f"{machine_line(devices)} | kernels v{KERNELS_VERSION} | {where} | {model_id}"

