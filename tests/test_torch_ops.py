"""The one wrapper around PyTorch's private CPU operators: each against torch.nn.functional.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from treegraft import torch_ops


def _weights(out_features=48, in_features=64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(out_features, in_features, generator=gen) * 0.05, torch.randn(out_features, generator=gen)


@pytest.mark.parametrize("rows", [1, 3, 17])
def test_onednn_linear_equals_linear(rows):
    w, b = _weights()
    x = torch.randn(rows, 64)
    torch.testing.assert_close(torch_ops.onednn_linear(x, torch_ops.onednn_pack(w), b), F.linear(x, w, b),
                               rtol=1e-5, atol=1e-5)
    if torch_ops.onednn_bf16_supported():
        wb, xb = w.bfloat16(), x.bfloat16()
        got = torch_ops.onednn_linear(xb, torch_ops.onednn_pack(wb), None).float()
        torch.testing.assert_close(got, F.linear(xb.float(), wb.float()), rtol=2e-2, atol=2e-2)


def test_mkl_packed_gemv_equals_linear():
    if not torch_ops.mkl_packing_available():
        pytest.skip("this PyTorch has no MKL packing")
    w, b = _weights()
    x = torch.randn(1, 64)
    shape_only = torch.zeros(1, 1).expand(*w.shape)  # MKL reads only the shape
    got = torch_ops.mkl_linear(x, torch_ops.mkl_pack(w, 1), shape_only, b, 1)
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_int4_mm_equals_the_dequantized_product():
    assert torch_ops.int4_available()  # PyTorch 2.13 has it: a missing one would silently drop a runtime
    gen = torch.Generator().manual_seed(1)
    n, k, group = 32, 64, 32
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    scales = torch.rand(n, k // group, generator=gen) * 0.1 + 0.01
    zeros = torch.randn(n, k // group, generator=gen) * 0.1
    dense = (codes.float() - 8) * scales.repeat_interleave(group, 1) + zeros.repeat_interleave(group, 1)
    scales_zeros = torch.stack([scales.t(), zeros.t()], dim=-1).contiguous()
    x = torch.randn(5, k)
    got = torch_ops.int4_mm(x, torch_ops.int4_pack(codes), group, scales_zeros)
    torch.testing.assert_close(got, x @ dense.T, rtol=1e-3, atol=1e-3)


def test_a_missing_operator_says_which():
    with pytest.raises(RuntimeError, match=r"no torch.ops.mkldnn._no_such_operator"):
        torch_ops._op("mkldnn", "_no_such_operator")
