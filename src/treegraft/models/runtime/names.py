"""Runtime names, what each needs to run here, and the dtype a model loads in before its runtime is applied."""

from __future__ import annotations

import torch
from torch import nn

from ...machine import native_bf16
from ...torch_ops import int4_available
from .kernels import avx512_kernels

__all__ = ["RUNTIMES", "RuntimeUnavailable", "runtime_load_dtype", "check_runtime_name", "runtime_unavailable",
           "model_runtime", "effective_runtime"]

RUNTIMES = ("float32", "bfloat16", "float32_packed", "bfloat16_packed", "int4", "int8")


class RuntimeUnavailable(RuntimeError):
    """The runtime cannot run on this device or CPU; the message says why."""


def runtime_load_dtype(runtime: str) -> torch.dtype:
    """The dtype to load the model in before :func:`apply_runtime` (only stock ``bfloat16`` loads in bf16)."""
    check_runtime_name(runtime, also=())
    return torch.bfloat16 if runtime == "bfloat16" else torch.float32


def check_runtime_name(runtime: str, option: str = "runtime", also: tuple[str, ...] = ("auto",)) -> None:
    """The one check of a runtime name: a ValueError naming ``option``'s bad value and every good one."""
    if runtime not in RUNTIMES and runtime not in also:
        raise ValueError(f"unknown {option} {runtime!r}; expected {', '.join(also)} or one of {', '.join(RUNTIMES)}"
                         if also else f"unknown {option} {runtime!r}; expected one of {', '.join(RUNTIMES)}")


def runtime_unavailable(runtime: str, device: str | torch.device = "cpu") -> str | None:
    """Why ``runtime`` cannot run on ``device`` here, or None when it can."""
    check_runtime_name(runtime, also=())
    device = torch.device(device)
    if runtime in ("float32", "bfloat16"):
        return None
    if device.type != "cpu":
        return f"{runtime} uses CPU-only kernels (oneDNN/MKL packing, int4 CPU matmul); use float32 or bfloat16 on {device.type}"
    if runtime == "float32_packed" and not torch.backends.mkldnn.is_available():
        return "float32_packed needs PyTorch built with oneDNN (mkldnn)"
    if runtime == "bfloat16_packed" and not native_bf16():
        return "bfloat16_packed needs native bf16 matrix products (AVX512-BF16 or AMX); this CPU emulates them"
    if runtime == "int4" and not int4_available():
        return "int4 needs torch.ops.aten._weight_int4pack_mm_for_cpu (PyTorch >= 2.6)"
    if runtime == "int8" and avx512_kernels() is None:
        return ("int8 needs the AVX-512 kernel (x86 with AVX512F/BW/VL/DQ, AVX512_BF16 and AVX512_VNNI, "
                "and a C++ compiler); this CPU or build has none")
    return None

def model_runtime(model: nn.Module) -> str:
    """The runtime :func:`apply_runtime` put on ``model`` (a stock model: its dtype's name)."""
    rt = getattr(model, "treegraft_runtime", None)
    if rt is not None:
        return rt
    return "bfloat16" if next(model.parameters()).dtype == torch.bfloat16 else "float32"



def effective_runtime(runtime: str | None, dtype: str | None) -> str | None:
    """The runtime to load with: ``dtype`` (the older option) wins when given and names the stock
    runtime of that dtype (``float32`` or ``bfloat16``); otherwise ``runtime`` (``auto``, a name, or
    None for a stock float32 model)."""
    if dtype:
        name = {"fp32": "float32", "bf16": "bfloat16"}.get(str(dtype), str(dtype))
        if name not in ("float32", "bfloat16"):
            raise ValueError(f"unknown dtype {dtype!r}; expected float32 or bfloat16 (or use runtime=)")
        return name
    if runtime is not None and runtime != "auto":
        check_runtime_name(runtime)
    return runtime
