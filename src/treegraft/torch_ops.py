"""The private PyTorch CPU operators the runtimes use, behind one small tested wrapper.

oneDNN's prepacked linear, MKL's packed GEMV and the int4 weight-only kernel are reachable only as
``torch.ops.mkldnn._*``, ``torch.ops.mkl._*`` and ``torch.ops.aten._*``: underscored operators with
no stability promise. Every use in the project goes through the functions here, so a PyTorch that
renames or drops one breaks in one place, says which operator is missing, and is caught by
``tests/test_torch_ops.py`` (each wrapper against ``torch.nn.functional.linear``).
"""

from __future__ import annotations

import torch

__all__ = ["onednn_bf16_supported", "onednn_pack", "onednn_linear", "mkl_packing_available", "mkl_pack", "mkl_linear",
           "int4_available", "int4_pack", "int4_mm"]


def _op(namespace: str, name: str):
    op = getattr(getattr(torch.ops, namespace), name, None)
    if op is None:
        raise RuntimeError(f"this PyTorch ({torch.__version__}) has no torch.ops.{namespace}.{name}")
    return op


def onednn_bf16_supported() -> bool:
    """Whether oneDNN runs bfloat16 matrix products natively (AVX512-BF16 / AMX), not emulated."""
    try:
        return bool(_op("mkldnn", "_is_mkldnn_bf16_supported")())
    except (AttributeError, RuntimeError):
        return False


def onednn_pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [out, in] (float32 or bfloat16) reordered once into oneDNN's blocked layout."""
    return _op("mkldnn", "_reorder_linear_weight")(weight, None)


def onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x`` [rows, in] times a :func:`onednn_pack`-ed weight, plus ``bias``: [rows, out] in ``x``'s dtype."""
    return _op("mkldnn", "_linear_pointwise")(x, packed, bias, "none", [], "")


def mkl_packing_available() -> bool:
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight")


def mkl_pack(weight: torch.Tensor, batch: int = 1) -> torch.Tensor:
    """float32 ``weight`` [out, in] packed by MKL for products of ``batch`` rows."""
    return _op("mkl", "_mkl_reorder_linear_weight")(weight, batch)


def mkl_linear(x: torch.Tensor, packed: torch.Tensor, shape_of: torch.Tensor, bias: torch.Tensor | None,
               batch: int = 1) -> torch.Tensor:
    """``x`` [batch, in] times an :func:`mkl_pack`-ed weight. MKL reads only the shape of ``shape_of``
    (the dense weight, or a zero-stride view of that shape) when the rows equal the packing's batch."""
    return _op("mkl", "_mkl_linear")(x, packed, shape_of, bias, batch)


def int4_available() -> bool:
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")


def int4_pack(codes: torch.Tensor, inner_k_tiles: int = 1) -> torch.Tensor:
    """int32 codes [out, in] in 0..15 packed for :func:`int4_mm`."""
    return _op("aten", "_convert_weight_to_int4pack_for_cpu")(codes.to(torch.int32).contiguous(), inner_k_tiles)


def int4_mm(x: torch.Tensor, packed: torch.Tensor, group: int, scales_zeros: torch.Tensor) -> torch.Tensor:
    """float32 ``x`` [rows, in] times the int4 weight ``(code - 8) * scale + zero`` per group of ``group``
    inputs; ``scales_zeros`` [in / group, out, 2]."""
    return _op("aten", "_weight_int4pack_mm_for_cpu")(x, packed, group, scales_zeros)
