"""What machine a figure was measured on: the CPU line every record, table and cache key carries.

CPUs of the same family differ in what their matrix kernels can do (AVX2 only, AVX-512, native
bfloat16, AMX), so a timing means nothing without the CPU it came from.
"""

from __future__ import annotations

import functools
import platform
import subprocess

import torch

from .devices import device_info, device_line
from .torch_ops import onednn_bf16_supported

__all__ = ["cpu_model_name", "cpu_capability", "native_bf16", "cpu_info", "cpu_line", "machine_info", "machine_line"]


@functools.cache
def cpu_model_name() -> str:
    """``lscpu``'s "Model name" (falls back to /proc/cpuinfo, then to platform.processor())."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def cpu_capability() -> str:
    """The vector ISA PyTorch dispatches its CPU kernels to (e.g. ``AVX2``, ``AVX512``)."""
    return torch.backends.cpu.get_cpu_capability()


@functools.cache
def native_bf16() -> bool:
    """Whether oneDNN runs bfloat16 matrix products natively here (AVX512-BF16 / AMX), not emulated."""
    return onednn_bf16_supported()


def cpu_info() -> dict:
    """The machine facts a measurement depends on (JSON-ready)."""
    return {
        "cpu": cpu_model_name(),
        "cpu_capability": cpu_capability(),
        "native_bf16": native_bf16(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__.split("+")[0],
    }


def cpu_line() -> str:
    """One line for tables and logs, e.g. ``AMD EPYC | AVX2 | bf16 emulated | 1 thread | torch 2.13.0``."""
    info = cpu_info()
    bf16 = "bf16 native" if info["native_bf16"] else "bf16 emulated"
    threads = f"{info['threads']} thread" + ("s" if info["threads"] != 1 else "")
    return f"{info['cpu']} | {info['cpu_capability']} | {bf16} | {threads} | torch {info['torch']}"


def machine_info(devices=()) -> dict:
    """:func:`cpu_info` plus, where ``devices`` include GPUs, their model, count and CUDA version."""
    return {**cpu_info(), **device_info(devices)}


def machine_line(devices=()) -> str:
    """:func:`cpu_line`, then the GPUs among ``devices`` (``... | NVIDIA H100 80GB HBM3 x2 | CUDA 12.8``)."""
    gpus = device_line(devices)
    return cpu_line() + (f" | {gpus}" if gpus else "")
