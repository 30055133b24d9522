"""The linears a runtime swaps in: prepacked float32 / bfloat16, per-row int8, weight-only int4."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from ...torch_ops import int4_mm, int4_pack, mkl_linear, mkl_pack, onednn_linear, onednn_pack
from . import kernels as _kernels
from .kernels import _mkl_packing, avx512_kernels
from .names import RuntimeUnavailable, runtime_unavailable

__all__ = ["INT4_GROUP", "PackedLinear", "RowInt8Linear", "Int4Block", "quantize_int4_rtn", "int4_supported_shape",
           "Int4Linear"]

INT4_GROUP = 32


def _flatten(x: torch.Tensor, features: int) -> torch.Tensor:
    x2 = x.reshape(-1, features)
    return x2 if x2.is_contiguous() else x2.contiguous()


# float32_packed with the AVX2 kernel: products of more rows than this (prompt prefill) run MKL's GEMM on
# a dense copy of the weight rebuilt for the call (a 512-token prefill of the 1.5B on a Zen 1 EPYC:
# 55-65 s this way, 62-73 s through the kernel's row blocks, alternating in one process); up to it,
# every row count takes the kernel, so a verification row equals the one-token forward bit for bit.
WIDE_ROWS = 64


class PackedLinear(nn.Module):
    """``nn.Linear`` with its weight prepacked once (same maths, other kernels).

    Inputs of any shape ``[..., in_features]`` and dtype; the product runs in ``dtype`` (float32 or
    bfloat16) and the output comes back in the input's dtype, shape ``[..., out_features]``.
    float32 products of up to :data:`WIDE_ROWS` rows use :func:`~.kernels.small_gemm` where it builds
    (AVX2 + FMA: one packed copy of the weights, each row computed in the same order whatever the row
    count), wider ones MKL's GEMM on a dense copy rebuilt for the call; without the kernel oneDNN's
    prepacked GEMM (and MKL's packed GEMV for one row); bfloat16 uses
    :func:`avx512_kernels` (it matches or beats oneDNN from 1 to 512 rows on a Zen 5 EPYC), oneDNN where
    that kernel is missing. ``onednn_above``
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
                self.packed = onednn_pack(weight)
                self.bias_bf16 = None if bias is None else bias.detach().to(torch.bfloat16).clone()
            return
        self.small = _kernels.small_gemm() if dtype == torch.float32 else None
        self.small_packed = self.small.pack(weight) if self.small is not None else None
        if self.small is None:  # (with the kernel, no second copy: it doubled a float32 model's memory)
            try:
                self.packed = onednn_pack(weight)
            except RuntimeError as err:
                raise RuntimeUnavailable(f"oneDNN cannot pack a {dtype} weight on this CPU: {str(err).splitlines()[0]}") from err
        self.mkl_packed = None
        if dtype == torch.float32 and self.small is None and _mkl_packing():
            self.mkl_packed = mkl_pack(weight, 1)
            # _mkl_linear reads only the shape of its dense-weight argument when the row count matches
            # the packing's batch size (1 here), so a zero-stride view stands in for it (no memory)
            self._shape_only = torch.zeros(1, 1).expand(self.out_features, self.in_features)

    def dense_weight(self) -> torch.Tensor:
        """The [out, in] float32 weight rebuilt from the kernel's packing (a transient copy)."""
        return self.small_packed.permute(0, 2, 1).reshape(-1, self.in_features)[: self.out_features]

    @classmethod
    def from_linear(cls, linear: nn.Linear, dtype: torch.dtype = torch.float32, keep_weight: bool = False,
                    onednn_above: int | None = None) -> "PackedLinear":
        return cls(linear.weight, linear.bias, dtype, keep_weight, onednn_above)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = _flatten(x, self.in_features)
        if self.wide is not None:
            if self.onednn_above is not None and x2.shape[0] > self.onednn_above:  # bf16 in, bf16 out
                y = onednn_linear(x2.to(torch.bfloat16), self.packed, self.bias_bf16)
            else:  # float32 in (rounded to bf16 pairs inside), float32 out
                y = self.wide.linear_bf16(x2.float().contiguous(), self.packed_bf16, self.out_features, self.bias)
            return y.to(x.dtype).reshape(*lead, self.out_features)
        if x2.dtype != self.dtype:
            x2 = x2.to(self.dtype)
        if self.small is not None and x2.shape[0] > WIDE_ROWS:  # prefill-sized: MKL's GEMM on a transient dense copy
            weight = self.weight if self.weight is not None else self.dense_weight()
            y = F.linear(x2, weight, self.bias)
        elif self.small is not None:
            y = self.small.linear(x2, self.small_packed, self.out_features, self.bias)
        elif self.mkl_packed is not None and x2.shape[0] == 1:
            y = mkl_linear(x2, self.mkl_packed, self._shape_only, self.bias, 1)
        else:
            y = onednn_linear(x2, self.packed, self.bias)
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
        self.packed = int4_pack(block.codes, 1)
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
        y = int4_mm(x2.float(), self.packed, self.group, self.scales_zeros)
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype).reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, group={self.group}, max_rows={self.max_rows}"

