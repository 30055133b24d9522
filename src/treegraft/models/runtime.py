"""Runtimes: the dtype and matrix kernels a loaded model runs with, chosen by measuring this machine.

A speculative decoder on a CPU lives or dies by two forwards: the one-token step (``ar`` and the
middle drafter) and the small-tree verification (8-32 rows). PyTorch's default ``nn.Linear``
(MKL, unpacked weight) is tuned for neither: on an AVX2-only EPYC an 8-row product costs 3.4x a
one-row one, against 1.6x for oneDNN with a weight prepacked once. So a runtime is a *module
swap* of every ``nn.Linear`` (``lm_head`` included) on the stock transformers model, no patched
modeling code:

===================  ======================================================================
``float32``          stock model, float32 (the reference numerics of the equality tests)
``bfloat16``         stock model cast to bfloat16
``float32_packed``   float32 weights prepacked once: our small-batch kernel (``csrc/small_gemm.cpp``,
                     AVX2/FMA, compiled on first use) for products of up to 8 rows, oneDNN's
                     for wider ones (two packed copies, 2x the float32 weight bytes; without the
                     kernel MKL's packed GEMV does one-row products)
``bfloat16_packed``  bfloat16 weights prepacked once (needs native bf16: AVX512-BF16/AMX): our
                     AVX-512 kernel (``csrc/small_gemm_avx512.cpp``: vdpbf16ps, every row computed
                     in the same order whatever the row count) where it builds, oneDNN's otherwise;
                     activations stay float32 outside the linears. Where oneDNN's packed product is
                     faster for wide products (AMX tiles: on a Xeon with AMX-BF16 32 rows cost it
                     1.1x one row, against 9x for vdpbf16ps), products wider than the measured
                     crossover (:func:`bf16_crossover`) go to a second, oneDNN-packed copy; those
                     rows come back rounded to bf16, so row invariance then holds only up to the
                     crossover
``int8``             a drafter's runtime: weights int8 per output channel, each row of activations
                     quantized to int8 with its own scale (vpdpbusd, AVX512-VNNI; same kernel file).
                     Half the bytes of bfloat16 and twice the products per instruction; it changes
                     the model's numerics (top-1 agreement with float32 ~97% on Qwen2.5-0.5B), which
                     a drafter may do (only acceptance depends on it), so ``auto`` never picks it
                     for a target
``int4``             weight-only int4, groups of 32 (``_weight_int4pack_mm_for_cpu``, gpt-fast's
                     kernel): the GGUF's own 4-bit blocks where the model came from a GGUF file,
                     round-to-nearest groups otherwise; products wider than ``max_rows`` go to a
                     packed float32 copy of the *same* (dequantized) weights
===================  ======================================================================

``auto`` (:func:`choose_runtime`) measures a short forward curve of each available candidate on
the target and keeps the one with the lowest ``t(1) + t(8)`` (:func:`pick_runtime`): a one-token
step plus an 8-node verification, the two forwards a CPU speculative decoder spends its time in.
The choice is cached per machine and model (:func:`runtime_cache_key`).
"""

from __future__ import annotations

import functools
import gc
import platform
import statistics
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping

import torch
from torch import nn

from ..atomic import atomic_write_json, read_json
from ..machine import cpu_info, cpu_line, native_bf16

__all__ = [
    "RUNTIMES",
    "RuntimeUnavailable",
    "PackedLinear",
    "RowInt8Linear",
    "avx512_kernels",
    "Int4Linear",
    "Int4Block",
    "runtime_load_dtype",
    "runtime_unavailable",
    "apply_runtime",
    "release_file_mappings",
    "model_runtime",
    "quantize_int4_rtn",
    "bf16_crossover",
    "forward_curve",
    "pick_runtime",
    "RuntimeChoice",
    "choose_runtime",
    "float32_redundant",
    "runtime_cache_key",
    "curve_at",
    "effective_runtime",
]

RUNTIMES = ("float32", "bfloat16", "float32_packed", "bfloat16_packed", "int4", "int8")
KERNELS_VERSION = 5  # part of every cached measurement's key: bump when a runtime's kernels change
INT4_GROUP = 32


class RuntimeUnavailable(RuntimeError):
    """The runtime cannot run on this device or CPU; the message says why."""


def runtime_load_dtype(runtime: str) -> torch.dtype:
    """The dtype to load the model in before :func:`apply_runtime` (only stock ``bfloat16`` loads in bf16)."""
    _check_name(runtime)
    return torch.bfloat16 if runtime == "bfloat16" else torch.float32


def _check_name(runtime: str) -> None:
    if runtime not in RUNTIMES:
        raise ValueError(f"unknown runtime {runtime!r}; expected auto or one of {', '.join(RUNTIMES)}")


def runtime_unavailable(runtime: str, device: str | torch.device = "cpu") -> str | None:
    """Why ``runtime`` cannot run on ``device`` here, or None when it can."""
    _check_name(runtime)
    device = torch.device(device)
    if runtime in ("float32", "bfloat16"):
        return None
    if device.type != "cpu":
        return f"{runtime} uses CPU-only kernels (oneDNN/MKL packing, int4 CPU matmul); use float32 or bfloat16 on {device.type}"
    if runtime == "float32_packed" and not torch.backends.mkldnn.is_available():
        return "float32_packed needs PyTorch built with oneDNN (mkldnn)"
    if runtime == "bfloat16_packed" and not native_bf16():
        return "bfloat16_packed needs native bf16 matrix products (AVX512-BF16 or AMX); this CPU emulates them"
    if runtime == "int4" and not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        return "int4 needs torch.ops.aten._weight_int4pack_mm_for_cpu (PyTorch >= 2.6)"
    if runtime == "int8" and avx512_kernels() is None:
        return ("int8 needs the AVX-512 kernel (x86 with AVX512F/BW/VL/DQ, AVX512_BF16 and AVX512_VNNI, "
                "and a C++ compiler); this CPU or build has none")
    return None


SMALL_GEMM_MAX_ROWS = 8
_CSRC = Path(__file__).parent / "csrc"


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
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight")


def _flatten(x: torch.Tensor, features: int) -> torch.Tensor:
    x2 = x.reshape(-1, features)
    return x2 if x2.is_contiguous() else x2.contiguous()


class PackedLinear(nn.Module):
    """``nn.Linear`` with its weight prepacked once (same maths, other kernels).

    Inputs of any shape ``[..., in_features]`` and dtype; the product runs in ``dtype`` (float32 or
    bfloat16) and the output comes back in the input's dtype, shape ``[..., out_features]``.
    float32 products of up to 8 rows use :func:`small_gemm` (or, without it, MKL's packed GEMV for
    one row), wider ones oneDNN's; bfloat16 uses :func:`avx512_kernels` (it matches or beats oneDNN
    from 1 to 512 rows on a Zen 5 EPYC), oneDNN where that kernel is missing. ``onednn_above``
    (bfloat16 with the AVX-512 kernel only): products of more rows than this go to a second,
    oneDNN-packed copy of the weight (AMX where the CPU has it); None keeps one kernel for every row.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, dtype: torch.dtype = torch.float32,
                 keep_weight: bool = False, onednn_above: int | None = None):
        super().__init__()
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"PackedLinear computes in float32 or bfloat16, got {dtype}")
        weight = weight.detach().to(dtype).contiguous()
        self.out_features, self.in_features = weight.shape
        self.dtype = dtype
        # the dense weight stays reachable only where rows of it are read directly (the LM head:
        # restricted draft vocabularies); a tied head shares it with the embedding, so it costs nothing
        self.weight = weight if keep_weight else None
        self.wide = avx512_kernels() if dtype == torch.bfloat16 else None
        bias_dtype = torch.float32 if self.wide is not None else dtype  # the AVX-512 kernel adds a float32 bias
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(bias_dtype).clone(), requires_grad=False)
        self.packed = None
        self.onednn_above = None
        if self.wide is not None:
            self.packed_bf16 = self.wide.pack_bf16(weight)
            if onednn_above is not None:
                self.onednn_above = int(onednn_above)
                self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
                self.bias_bf16 = None if bias is None else bias.detach().to(torch.bfloat16).clone()
            return
        try:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        except RuntimeError as err:
            raise RuntimeUnavailable(f"oneDNN cannot pack a {dtype} weight on this CPU: {str(err).splitlines()[0]}") from err
        self.small = small_gemm() if dtype == torch.float32 else None
        self.small_packed = self.small.pack(weight) if self.small is not None else None
        self.mkl_packed = None
        if dtype == torch.float32 and self.small is None and _mkl_packing():
            self.mkl_packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, 1)
            # _mkl_linear reads only the shape of its dense-weight argument when the row count matches
            # the packing's batch size (1 here), so a zero-stride view stands in for it (no memory)
            self._shape_only = torch.zeros(1, 1).expand(self.out_features, self.in_features)

    @classmethod
    def from_linear(cls, linear: nn.Linear, dtype: torch.dtype = torch.float32, keep_weight: bool = False,
                    onednn_above: int | None = None) -> "PackedLinear":
        return cls(linear.weight, linear.bias, dtype, keep_weight, onednn_above)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = _flatten(x, self.in_features)
        if self.wide is not None:
            if self.onednn_above is not None and x2.shape[0] > self.onednn_above:  # bf16 in, bf16 out
                y = torch.ops.mkldnn._linear_pointwise(x2.to(torch.bfloat16), self.packed, self.bias_bf16, "none", [], "")
            else:  # float32 in (rounded to bf16 pairs inside), float32 out
                y = self.wide.linear_bf16(x2.float().contiguous(), self.packed_bf16, self.out_features, self.bias)
            return y.to(x.dtype).reshape(*lead, self.out_features)
        if x2.dtype != self.dtype:
            x2 = x2.to(self.dtype)
        if self.small is not None and x2.shape[0] <= SMALL_GEMM_MAX_ROWS:
            y = self.small.linear(x2, self.small_packed, self.out_features, self.bias)
        elif self.mkl_packed is not None and x2.shape[0] == 1:
            y = torch.ops.mkl._mkl_linear(x2, self.mkl_packed, self._shape_only, self.bias, 1)
        else:
            y = torch.ops.mkldnn._linear_pointwise(x2, self.packed, self.bias, "none", [], "")
        return y.to(x.dtype).reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        wide = "" if self.onednn_above is None else f", onednn_above={self.onednn_above}"
        return f"in_features={self.in_features}, out_features={self.out_features}, dtype={self.dtype}{wide}"


class RowInt8Linear(nn.Module):
    """A drafter's linear: int8 weights per output column, every input row quantized to int8 with its
    own scale (:func:`avx512_kernels`' ``linear_int8``; exact int32 accumulation, so a row's output
    does not depend on the other rows). Input ``[..., in_features]`` (any float dtype), output in the
    input's dtype. The dense weight stays reachable with ``keep_weight`` (the LM head: restricted draft
    vocabularies read rows of it)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, keep_weight: bool = False):
        super().__init__()
        kernels = avx512_kernels()
        if kernels is None:
            raise RuntimeUnavailable(runtime_unavailable("int8"))
        self.kernels = kernels
        self.out_features, self.in_features = weight.shape
        self.weight = weight.detach() if keep_weight else None
        self.packed, self.scales, self.colsum = kernels.pack_int8(weight.detach())
        self.bias = None if bias is None else nn.Parameter(bias.detach().float().clone(), requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear, keep_weight: bool = False) -> "RowInt8Linear":
        return cls(linear.weight, linear.bias, keep_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = _flatten(x, self.in_features).float().contiguous()
        y = self.kernels.linear_int8(x2, self.packed, self.scales, self.colsum, self.out_features, self.bias)
        return y.to(x.dtype).reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per row"


@dataclass
class Int4Block:
    """A weight as int4 groups: ``w[n, k] = (codes[n, k] - 8) * scales[n, g] + zeros[n, g]``, ``g = k // 32``.

    codes: uint8 [N, K] in 0..15; scales, zeros: float32 [N, K / 32].
    """

    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K]."""
        g = self.codes.shape[1] // self.scales.shape[1]
        s = self.scales.repeat_interleave(g, dim=1)
        z = self.zeros.repeat_interleave(g, dim=1)
        return (self.codes.float() - 8) * s + z


def quantize_int4_rtn(weight: torch.Tensor, group: int = INT4_GROUP) -> Int4Block:
    """Asymmetric round-to-nearest int4 groups of ``group`` along the input dimension (for models
    that did not come from a GGUF file)."""
    w = weight.detach().float()
    n, k = w.shape
    if k % group:
        raise ValueError(f"int4 needs in_features divisible by {group}, got {k}")
    wg = w.reshape(n, k // group, group)
    lo, hi = wg.amin(-1), wg.amax(-1)
    scale = ((hi - lo) / 15).clamp_min(1e-12)
    codes = torch.round((wg - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.uint8).reshape(n, k)
    return Int4Block(codes=codes, scales=scale, zeros=lo + 8 * scale)


def int4_supported_shape(out_features: int, in_features: int) -> bool:
    """The CPU int4 kernel needs out_features % 16 == 0 and in_features % 32 == 0."""
    return out_features % 16 == 0 and in_features % INT4_GROUP == 0


class Int4Linear(nn.Module):
    """Weight-only int4 linear: ``_weight_int4pack_mm_for_cpu`` for up to ``max_rows`` rows, and a
    :class:`PackedLinear` over the same dequantized weight for wider products (None: int4 always).

    Input ``[..., in_features]`` (any float dtype; computed in float32), output in the input's dtype.
    """

    def __init__(self, block: Int4Block, bias: torch.Tensor | None = None, max_rows: int | None = None,
                 dense: bool = True):
        super().__init__()
        n, k = block.codes.shape
        if not int4_supported_shape(n, k):
            raise ValueError(f"int4 kernel needs out_features % 16 == 0 and in_features % 32 == 0, got {n}x{k}")
        self.out_features, self.in_features = n, k
        self.group = k // block.scales.shape[1]
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(block.codes.to(torch.int32).contiguous(), 1)
        self.scales_zeros = torch.stack([block.scales.float().t(), block.zeros.float().t()], dim=-1).contiguous()
        self.bias = None if bias is None else nn.Parameter(bias.detach().float().clone(), requires_grad=False)
        self.max_rows = max_rows
        self.dense = PackedLinear(block.dequantize(), self.bias) if dense else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = _flatten(x, self.in_features)
        rows = x2.shape[0]
        if self.dense is not None and self.max_rows is not None and rows > self.max_rows:
            return self.dense(x)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2.float(), self.packed, self.group, self.scales_zeros)
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype).reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, group={self.group}, max_rows={self.max_rows}"


def _linears(model: nn.Module):
    """(parent module, attribute name, full name) of every nn.Linear, parents before children.

    Only names are collected up front: holding the Linear modules themselves would keep every
    original weight alive until the whole swap is done (twice the memory at the peak).
    """
    names = [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    for full in names:
        parent_name, _, name = full.rpartition(".")
        yield model.get_submodule(parent_name) if parent_name else model, name, full


def _timed(fn: Callable[[], object], min_s: float = 0.05, repeats: int = 3) -> float:
    fn()
    times = []
    for _ in range(repeats):
        n, start = 0, time.perf_counter()
        while True:
            fn()
            n += 1
            if time.perf_counter() - start >= min_s / repeats:
                break
        times.append((time.perf_counter() - start) / n)
    return statistics.median(times)


def _rows_until_slower(narrow: Callable[[torch.Tensor], object], wide: Callable[[torch.Tensor], object],
                       in_features: int, rows: tuple[int, ...]) -> int | None:
    """The largest row count of ``rows`` up to which ``narrow(x)`` is at least as fast as ``wide(x)``
    (0: slower from the first), or None when it is never slower over ``rows``."""
    best = 0
    with torch.inference_mode():
        for r in rows:
            x = torch.randn(r, in_features)
            if _timed(lambda: narrow(x)) > _timed(lambda: wide(x)):
                return best
            best = r
    return None


def int4_crossover(linear: Int4Linear, rows: tuple[int, ...] = (1, 2, 4, 8, 16, 32)) -> int:
    """The largest row count up to which the int4 kernel is at least as fast as the dense packed copy
    on this linear (0: never; the dense copy then does every product)."""
    best = _rows_until_slower(
        lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, linear.packed, linear.group, linear.scales_zeros),
        linear.dense, linear.in_features, rows)
    return rows[-1] if best is None else best


def bf16_crossover(weight: torch.Tensor, rows: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)) -> int | None:
    """The largest row count up to which the AVX-512 bf16 kernel is at least as fast as oneDNN's packed
    bf16 product on ``weight`` ([out, in]); None when it is never slower over ``rows`` (or either
    kernel is missing), so no second copy is worth its memory."""
    kernels = avx512_kernels()
    if kernels is None:
        return None
    weight = weight.detach().to(torch.bfloat16).contiguous()
    try:
        onednn = torch.ops.mkldnn._reorder_linear_weight(weight, None)
    except RuntimeError:
        return None
    ours = kernels.pack_bf16(weight)
    return _rows_until_slower(
        lambda x: kernels.linear_bf16(x, ours, weight.shape[0], None),
        lambda x: torch.ops.mkldnn._linear_pointwise(x.bfloat16(), onednn, None, "none", [], ""),
        weight.shape[1], rows)


def apply_runtime(
    model: nn.Module,
    runtime: str,
    int4_blocks: Mapping[str, Int4Block] | None = None,
    int4_max_rows: int | str = "auto",
    bf16_max_rows: int | str | None = "auto",
) -> nn.Module:
    """Switch ``model`` (loaded in :func:`runtime_load_dtype`) to ``runtime`` in place; returns it.

    ``int4_blocks`` maps a linear's weight name (``model.layers.0.mlp.up_proj.weight``) to its
    GGUF int4 block; when given, only those linears become int4 (the rest stay packed float32, as the
    GGUF's 6- and 8-bit tensors), otherwise every linear but ``lm_head`` is quantized round-to-nearest.
    ``int4_max_rows``: products of up to this many rows use the int4 kernel, wider ones the dense copy;
    ``auto`` measures the crossover on the largest int4 linear.
    ``bf16_max_rows`` (``bfloat16_packed``): products of up to this many rows use the AVX-512 kernel,
    wider ones a oneDNN-packed copy; ``auto`` measures the crossover on the largest linear but the LM
    head (:func:`bf16_crossover`), None keeps the AVX-512 kernel for every row count (row invariance).
    The value used is ``model.treegraft_bf16_max_rows`` (None: one kernel).
    """
    reason = runtime_unavailable(runtime, next(model.parameters()).device)
    if reason:
        raise RuntimeUnavailable(reason)
    head = model.get_output_embeddings()
    if runtime == "float32":
        model.float()
    elif runtime == "bfloat16":
        model.to(torch.bfloat16)
    elif runtime in ("float32_packed", "bfloat16_packed"):
        dtype = torch.float32 if runtime == "float32_packed" else torch.bfloat16
        above = None
        if runtime == "bfloat16_packed" and avx512_kernels() is not None:
            if bf16_max_rows == "auto":
                body = [getattr(p, n).weight for p, n, _ in _linears(model) if getattr(p, n) is not head]
                above = bf16_crossover(max(body, key=lambda w: w.numel())) if body else None
            else:
                above = None if bf16_max_rows is None else int(bf16_max_rows)
        model.treegraft_bf16_max_rows = above
        for parent, name, _ in _linears(model):
            linear = getattr(parent, name)
            setattr(parent, name, PackedLinear.from_linear(linear, dtype, keep_weight=linear is head, onednn_above=above))
    elif runtime == "int8":
        for parent, name, _ in _linears(model):
            linear = getattr(parent, name)
            setattr(parent, name, RowInt8Linear.from_linear(linear, keep_weight=linear is head))
    else:  # int4
        swapped: list[Int4Linear] = []
        for parent, name, full in _linears(model):
            linear = getattr(parent, name)
            key = f"{full}.weight"
            if int4_blocks is not None:
                block = int4_blocks.get(key)
            elif full.split(".")[-1] != "lm_head" and int4_supported_shape(*linear.weight.shape):
                block = quantize_int4_rtn(linear.weight)
            else:
                block = None
            if block is None:
                setattr(parent, name, PackedLinear.from_linear(linear, keep_weight=linear is head))
            else:
                module = Int4Linear(block, linear.bias, max_rows=None)
                setattr(parent, name, module)
                swapped.append(module)
        if swapped:
            if int4_max_rows == "auto":
                largest = max(swapped, key=lambda m: m.in_features * m.out_features)
                int4_max_rows = int4_crossover(largest)
            for module in swapped:
                module.max_rows = int(int4_max_rows)
    model.treegraft_runtime = runtime
    if runtime != "float32":  # float32 reads every mapped page itself; the others packed most of them away
        release_file_mappings(model)
    gc.collect()
    return model


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


def model_runtime(model: nn.Module) -> str:
    """The runtime :func:`apply_runtime` put on ``model`` (a stock model: its dtype's name)."""
    rt = getattr(model, "treegraft_runtime", None)
    if rt is not None:
        return rt
    return "bfloat16" if next(model.parameters()).dtype == torch.bfloat16 else "float32"


@torch.inference_mode()
def forward_curve(model: nn.Module, sizes=(1, 2, 4, 8, 16), context: int = 256, repeats: int = 3,
                  seed: int = 0) -> dict[int, float]:
    """Median seconds of a forward over ``n`` new tokens (chain mask) on a ``context``-token cache plus
    the LM head on one row, for each n in ``sizes`` (the shape of a tree verification)."""
    from ..model_io import forward_hidden, lm_logits, new_cache, truncate_cache

    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    cache = new_cache()
    prefix = torch.randint(0, vocab, (context,), generator=gen).to(device)
    forward_hidden(model, cache, prefix, torch.arange(context, device=device), None)
    curve: dict[int, float] = {}
    for n in sizes:
        tokens = torch.randint(0, vocab, (n,), generator=gen).to(device)
        pos = torch.arange(context, context + n, device=device)
        allowed = torch.ones(n, context + n, dtype=torch.bool)
        allowed[:, context:] = torch.tril(allowed[:, context:])
        times = []
        for i in range(repeats + 1):
            start = time.perf_counter()
            hidden = forward_hidden(model, cache, tokens, pos, allowed)
            lm_logits(model, hidden[:1])
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if i:  # the first run is a warm-up
                times.append(time.perf_counter() - start)
            truncate_cache(cache, context)
        curve[n] = statistics.median(times)
    return curve


def curve_at(curve: Mapping[int, float], n: int) -> float:
    """Latency at ``n`` rows: measured, else linearly interpolated (extrapolated flat past the end)."""
    if n in curve:
        return curve[n]
    xs = sorted(curve)
    if n <= xs[0]:
        return curve[xs[0]]
    if n >= xs[-1]:
        return curve[xs[-1]]
    hi = next(x for x in xs if x > n)
    lo = max(x for x in xs if x < n)
    return curve[lo] + (curve[hi] - curve[lo]) * (n - lo) / (hi - lo)


def pick_runtime(curves: Mapping[str, Mapping[int, float]], verify_rows: int = 8) -> str:
    """The runtime with the lowest ``t(1) + t(verify_rows)``; ties go to the earlier entry of ``curves``.

    ``t(1)`` is what a plain decoding step and a chain drafter pay per token, ``t(verify_rows)`` what a
    small-tree verification costs; weighting them equally favours runtimes good at both, so neither
    ``ar`` nor the tree methods are measured on a runtime tuned against them.
    """
    if not curves:
        raise ValueError("no runtime curves to pick from")
    return min(curves, key=lambda r: (curve_at(curves[r], 1) + curve_at(curves[r], verify_rows), list(curves).index(r)))


@dataclass
class RuntimeChoice:
    runtime: str
    curves: dict[str, dict[int, float]] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)  # candidate -> why it was not measured
    cached: bool = False
    cpu: dict = field(default_factory=cpu_info)

    def summary(self) -> str:
        parts = []
        for name, curve in self.curves.items():
            parts.append(f"{name}: t(1)={1000 * curve_at(curve, 1):.0f} ms, t(8)={1000 * curve_at(curve, 8):.0f} ms")
        skipped = "; ".join(f"{k} skipped ({v})" for k, v in self.skipped.items())
        src = "cached" if self.cached else "measured"
        return f"runtime auto -> {self.runtime} ({src} on {cpu_line()}): " + "; ".join(parts) + (f"; {skipped}" if skipped else "")


def runtime_cache_key(model_id: str, device: str | torch.device = "cpu") -> str:
    """Machine + model: the CPU line (model name, ISA, bf16, threads, torch) and the model's identity."""
    return f"{cpu_line()} | kernels v{KERNELS_VERSION} | {torch.device(device)} | {model_id}"


DEFAULT_CANDIDATES = ("float32", "float32_packed", "bfloat16_packed", "int4")
FLOAT32_REDUNDANT = ("bf16 is native here: a float32 step moves twice the bytes (1.9-2.6x slower on Zen 4, Zen 5 "
                     "and a Xeon with AMX) and float32_packed's copies take ~3x the model's memory")


def float32_redundant(runtime: str, candidates: tuple[str, ...], device: str | torch.device = "cpu") -> bool:
    """Whether ``runtime`` is a float32 candidate that ``bfloat16_packed`` (also a candidate, and runnable)
    makes not worth measuring. Decoding a 1.5B model is bound by the bytes of weight it streams: on every
    bf16-native CPU we measured, ``bfloat16_packed`` beat both float32 runtimes at every row count, and
    measuring ``float32_packed`` (float32 weights plus two packed copies) set ``make all``'s memory peak
    (20 GB of 24)."""
    return (runtime in ("float32", "float32_packed") and "bfloat16_packed" in candidates
            and runtime_unavailable("bfloat16_packed", device) is None)


def choose_runtime(
    load: Callable[[str], nn.Module],
    model_id: str,
    device: str | torch.device = "cpu",
    candidates: tuple[str, ...] = DEFAULT_CANDIDATES,
    cache_file: str | Path | None = None,
    sizes=(1, 2, 4, 8, 16),
    context: int = 256,
    log: Callable[[str], None] | None = print,
    int4_exact: bool = True,
    float32_where_bf16: bool = False,
) -> RuntimeChoice:
    """Measure each available candidate on a freshly loaded model (``load(runtime)`` returns the model
    already switched to that runtime) and pick one with :func:`pick_runtime`.

    The choice is printed through ``log`` when measured, not when read from the cache. One model is
    alive at a time (a packed float32 copy of a 1.5B model is ~14 GB). On CUDA the choice
    is ``bfloat16`` without measuring. ``int4`` is a candidate only when ``int4_exact`` (the model's
    int4 weights are its own GGUF blocks, not a lossy re-quantization) and its kernel beats the dense
    one on at least one-row products (otherwise it would run dense everywhere). Where ``bfloat16_packed``
    runs (native bf16) the float32 candidates are not measured unless ``float32_where_bf16``
    (:func:`float32_redundant`): they set the process's memory peak and never won.
    """
    device = torch.device(device)
    if device.type != "cpu":
        choice = RuntimeChoice("bfloat16", skipped={"measure": f"{device.type}: bfloat16 without measuring"})
        if log:
            log(choice.summary())
        return choice
    key = runtime_cache_key(model_id, device)
    cache = read_json(cache_file, {}) if cache_file else {}
    if key in cache and cache[key].get("runtime") in RUNTIMES:
        entry = cache[key]
        return RuntimeChoice(entry["runtime"], {r: {int(n): s for n, s in c.items()} for r, c in entry["curves"].items()},
                             entry.get("skipped", {}), cached=True, cpu=entry.get("cpu", cpu_info()))
    curves: dict[str, dict[int, float]] = {}
    skipped: dict[str, str] = {}
    for runtime in candidates:
        reason = runtime_unavailable(runtime, device)
        if runtime == "int4" and not reason and not int4_exact:
            reason = "the model has no int4 blocks of its own (re-quantizing would change its numerics)"
        if not reason and not float32_where_bf16 and float32_redundant(runtime, candidates, device):
            reason = FLOAT32_REDUNDANT
        if reason:
            skipped[runtime] = reason
            continue
        model = load(runtime)
        if runtime == "int4":
            rows = [m.max_rows for m in model.modules() if isinstance(m, Int4Linear)]
            if not rows or max(rows) < 1:
                skipped[runtime] = "the int4 kernel is slower than the dense one at every row count on this CPU"
                del model
                gc.collect()
                continue
        curves[runtime] = forward_curve(model, sizes=sizes, context=context, repeats=2)
        del model
        gc.collect()
    choice = RuntimeChoice(pick_runtime(curves), curves, skipped)
    if cache_file:
        cache = read_json(cache_file, {})
        cache[key] = {"runtime": choice.runtime, "curves": choice.curves, "skipped": skipped, "cpu": choice.cpu}
        atomic_write_json(cache, cache_file)
    if log:
        log(choice.summary())
    return choice


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
        _check_name(runtime)
    return runtime
