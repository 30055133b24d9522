"""The compiled small-batch kernels (``models/csrc``): built once per machine into PyTorch's extension cache."""

from __future__ import annotations

import functools
import platform
import warnings
from pathlib import Path

import torch

from ...machine import cpu_line
from ...torch_ops import mkl_packing_available

__all__ = ["KERNELS_VERSION", "SMALL_GEMM_MAX_ROWS", "AVX512_FLAGS", "small_gemm", "avx512_kernels", "runtime_cache_key"]

KERNELS_VERSION = 5  # part of every cached measurement's key: bump when a runtime's kernels change
SMALL_GEMM_MAX_ROWS = 8
_CSRC = Path(__file__).parent.parent / "csrc"


@functools.cache
def small_gemm():
    """The compiled small-batch float32 kernel (``csrc/small_gemm.cpp``), or None where it cannot run
    or be built (not x86 with AVX2, no C++ compiler). Built once per machine into PyTorch's extension
    cache (``$TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``)."""
    if platform.machine().lower() not in ("x86_64", "amd64") or not _has_avx2_fma():
        return None
    try:
        from torch.utils.cpp_extension import load

        return load("treegraft_small_gemm", sources=[str(_CSRC / "small_gemm.cpp")],
                    extra_cflags=["-O3", "-mavx2", "-mfma"], verbose=False)
    except Exception as err:  # no compiler, no ninja, ...: the stock kernels still work
        warnings.warn(f"small-batch kernel not built ({type(err).__name__}: {str(err).splitlines()[0][:200]}); "
                      "float32_packed uses MKL/oneDNN only", stacklevel=2)
        return None


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return set(next((line for line in f if line.startswith("flags")), "").split()[2:])
    except OSError:
        return set()


def _has_avx2_fma() -> bool:
    flags = _cpu_flags()
    if flags:
        return "avx2" in flags and "fma" in flags
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


AVX512_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx512_vnni")


@functools.cache
def avx512_kernels():
    """The compiled AVX-512 small-batch kernels (``csrc/small_gemm_avx512.cpp``: bf16 and per-row int8
    linears), or None where the CPU lacks one of :data:`AVX512_FLAGS` or the build fails."""
    if platform.machine().lower() not in ("x86_64", "amd64") or not set(AVX512_FLAGS) <= _cpu_flags():
        return None
    try:
        from torch.utils.cpp_extension import load

        return load("treegraft_small_gemm_avx512", sources=[str(_CSRC / "small_gemm_avx512.cpp")],
                    extra_cflags=["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16",
                                  "-mavx512vnni", "-ffp-contract=off"], verbose=False)
    except Exception as err:
        warnings.warn(f"AVX-512 kernel not built ({type(err).__name__}: {str(err).splitlines()[0][:200]}); "
                      "bfloat16_packed uses oneDNN, int8 is unavailable", stacklevel=2)
        return None


def _mkl_packing() -> bool:
    return mkl_packing_available()



def runtime_cache_key(model_id: str, device: str | torch.device = "cpu") -> str:
    """Machine + model: the CPU line (model name, ISA, bf16, threads, torch) and the model's identity."""
    return f"{cpu_line()} | kernels v{KERNELS_VERSION} | {torch.device(device)} | {model_id}"

