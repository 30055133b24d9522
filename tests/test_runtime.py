"""Runtimes (module swaps of nn.Linear), the int4 blocks of GGUF files, and the `auto` rule on fake curves."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from treegraft.machine import cpu_info, cpu_line, native_bf16
from treegraft.models import build_tiny_model
from treegraft.models.gguf_convert import _int4_groups
from treegraft.models.runtime.memory import _file_mapped_ranges
from treegraft.models.runtime import (
    Int4Block,
    Int4Linear,
    PackedLinear,
    RuntimeUnavailable,
    apply_runtime,
    choose_runtime,
    curve_at,
    effective_runtime,
    model_runtime,
    pick_runtime,
    quantize_int4_rtn,
    release_file_mappings,
    runtime_unavailable,
)

from .conftest import require_embedded


def _linear(k: int, n: int, bias: bool, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    lin = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        lin.weight.normal_(0, 0.05)
        if bias:
            lin.bias.normal_(0, 0.1)
    return lin


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 64), (5, 64), (2, 3, 64), (1, 1, 64)])
def test_packed_linear_equals_linear(shape, bias):
    lin = _linear(64, 48, bias)
    packed = PackedLinear.from_linear(lin)
    x = torch.randn(*shape)
    out = packed(x)
    assert out.shape == (*shape[:-1], 48) and out.dtype == torch.float32
    torch.testing.assert_close(out, lin(x), rtol=1e-5, atol=1e-5)


def test_packed_linear_keeps_input_dtype_and_noncontiguous_inputs():
    lin = _linear(32, 16, True)
    packed = PackedLinear.from_linear(lin)
    x = torch.randn(8, 4, 32).transpose(0, 1)  # non-contiguous [4, 8, 32]
    torch.testing.assert_close(packed(x), lin(x), rtol=1e-5, atol=1e-5)
    xb = torch.randn(3, 32).bfloat16()
    assert packed(xb).dtype == torch.bfloat16


@pytest.mark.skipif(not native_bf16(), reason="bfloat16_packed needs native bf16 (AVX512-BF16/AMX); emulated here")
def test_bfloat16_packed_linear_close_to_bfloat16_linear():
    lin = _linear(64, 48, True)
    packed = PackedLinear.from_linear(lin, torch.bfloat16)
    x = torch.randn(3, 64)
    torch.testing.assert_close(packed(x), lin(x), rtol=2e-2, atol=2e-2)


def test_bfloat16_packed_is_unavailable_without_native_bf16():
    reason = runtime_unavailable("bfloat16_packed")
    assert (reason is None) == native_bf16()
    if reason:
        assert "native bf16" in reason
        with pytest.raises(RuntimeUnavailable, match="native bf16"):
            apply_runtime(build_tiny_model(0), "bfloat16_packed")


def test_cpu_only_runtimes_are_refused_on_cuda_by_name():
    assert runtime_unavailable("float32", "cuda") is None
    assert "CPU-only" in runtime_unavailable("int4", "cuda")


def test_int4_rtn_round_trip_and_linear():
    lin = _linear(128, 32, True)
    block = quantize_int4_rtn(lin.weight)
    assert block.codes.dtype == torch.uint8 and int(block.codes.max()) <= 15
    assert block.scales.shape == (32, 4) and block.zeros.shape == (32, 4)
    err = (block.dequantize() - lin.weight.detach()).abs()
    assert float((err - block.scales.repeat_interleave(32, 1) / 2).max()) <= 1e-6  # within half a step
    for max_rows in (None, 2):  # int4 kernel only, and the dense copy for more than 2 rows
        module = Int4Linear(block, lin.bias, max_rows=max_rows)
        for shape in ((1, 128), (5, 128), (2, 3, 128)):
            x = torch.randn(*shape)
            ref = torch.nn.functional.linear(x, block.dequantize(), lin.bias)
            torch.testing.assert_close(module(x), ref, rtol=1e-4, atol=1e-4)


def test_int4_rejects_unsupported_shapes():
    with pytest.raises(ValueError, match="divisible"):
        quantize_int4_rtn(torch.randn(16, 40))
    block = quantize_int4_rtn(torch.randn(20, 64))
    with pytest.raises(ValueError, match="out_features % 16"):
        Int4Linear(block)


def _gguf_blocks(qtype_name: str, n_blocks: int, seed: int = 0) -> np.ndarray:
    """Random but valid raw blocks of a GGUF 4-bit type (finite float16 scales)."""
    import gguf

    rng = np.random.default_rng(seed)
    qtype = getattr(gguf.GGMLQuantizationType, qtype_name)
    _, type_size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    n_halves = {"Q4_0": 1, "Q4_1": 2, "Q4_K": 2}[qtype_name]
    halves = rng.uniform(-0.05, 0.05, size=(n_blocks, n_halves)).astype(np.float16)
    if qtype_name == "Q4_K":
        halves = np.abs(halves)
    blocks[:, : 2 * n_halves] = halves.view(np.uint8).reshape(n_blocks, 2 * n_halves)
    return blocks


@pytest.mark.parametrize("qtype_name", ["Q4_0", "Q4_1", "Q4_K"])
def test_int4_groups_reproduce_llama_cpp_dequantization(qtype_name):
    import gguf

    n, k = 32, 512
    per_row = k // gguf.GGML_QUANT_SIZES[getattr(gguf.GGMLQuantizationType, qtype_name)][0]
    raw = _gguf_blocks(qtype_name, n * per_row).reshape(n, -1)
    expected = gguf.dequantize(raw, getattr(gguf.GGMLQuantizationType, qtype_name)).reshape(n, k)
    codes, scales, zeros = _int4_groups(raw, qtype_name, (n, k))
    block = Int4Block(torch.from_numpy(codes), torch.from_numpy(scales), torch.from_numpy(zeros))
    torch.testing.assert_close(block.dequantize(), torch.from_numpy(expected).float(), rtol=1e-5, atol=1e-6)


def _logits(model, ids):
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("runtime", ["float32_packed", "int4"])
def test_runtime_swap_on_the_tiny_model(runtime):
    """The swap changes kernels, not maths: float32_packed equals the stock model, int4 equals the stock
    model whose weights are the dequantized int4 groups (lm_head stays dense), within 1e-4 relative."""
    ids = list(range(3, 40))
    stock = build_tiny_model(0)
    if runtime == "int4":
        with torch.no_grad():
            for name, module in stock.named_modules():
                if isinstance(module, nn.Linear) and not name.endswith("lm_head"):
                    module.weight.copy_(quantize_int4_rtn(module.weight).dequantize())
    ref = _logits(stock, ids)
    model = apply_runtime(build_tiny_model(0), runtime)
    assert model_runtime(model) == runtime
    assert not any(type(m) is nn.Linear for m in model.modules())  # every linear swapped, lm_head included
    out = _logits(model, ids)
    assert float((out - ref).abs().max() / ref.abs().max()) < 1e-4


@pytest.mark.embedded
def test_float32_packed_logits_equal_stock_on_smollm2():
    from treegraft.models import load_model

    require_embedded("smollm2-135m")
    ids = list(range(100, 180))
    ref = _logits(load_model("embedded:smollm2-135m"), ids)
    out = _logits(load_model("embedded:smollm2-135m", runtime="float32_packed"), ids)
    assert float((out - ref).abs().max() / ref.abs().max()) < 1e-4


@pytest.mark.embedded
@pytest.mark.slow  # packing SmolLM2 for int4 takes ~40 s; CI: every method on the tiny pair's int4 runtime
def test_int4_uses_the_gguf_blocks_and_stays_close_on_smollm2():
    from treegraft.models import load_model
    from treegraft.models.embedded import int4_blocks

    folder = require_embedded("smollm2-135m")
    blocks = int4_blocks(folder)
    assert blocks and all(k.endswith(".weight") for k in blocks)
    ids = list(range(100, 124))  # PyTorch's int4 product is slow on a CPU without its fast path: few rows
    ref = _logits(load_model("embedded:smollm2-135m"), ids)
    model = load_model("embedded:smollm2-135m", runtime="int4")
    int4 = [m for m in model.modules() if isinstance(m, Int4Linear)]
    assert len(int4) == len(blocks)
    for m in int4:  # every product through the int4 kernel (auto may route wide ones to the dense copy)
        m.max_rows = None
    out = _logits(model, ids)
    # the same weights (the float32 conversion is the dequantized GGUF): only accumulation order differs
    assert float((out - ref).abs().max() / ref.abs().max()) < 1e-4
    assert torch.equal(out.argmax(-1), ref.argmax(-1))


def test_pick_runtime_rule_on_fake_curves():
    curves = {
        "float32": {1: 0.40, 2: 0.70, 4: 0.95, 8: 1.10, 16: 1.50},
        "float32_packed": {1: 0.35, 2: 0.60, 4: 0.70, 8: 0.85, 16: 1.10},
        "int4": {1: 0.10, 2: 0.30, 4: 0.60, 8: 1.20, 16: 2.40},  # fast steps, steep trees
    }
    assert pick_runtime(curves) == "float32_packed"  # 1.20 vs 1.50 vs 1.30
    curves["int4"][8] = 1.0
    assert pick_runtime(curves) == "int4"  # 1.10
    assert pick_runtime({"a": {1: 1.0, 8: 2.0}, "b": {1: 1.5, 8: 1.5}}) == "a"  # a tie goes to the earlier
    assert curve_at({1: 1.0, 4: 2.5}, 2) == pytest.approx(1.5)  # interpolated
    assert curve_at({1: 1.0, 4: 2.5}, 8) == 2.5  # flat past the end
    with pytest.raises(ValueError):
        pick_runtime({})


def test_choose_runtime_measures_once_then_reads_the_cache(tmp_path):
    loads = []

    def load(runtime):
        loads.append(runtime)
        return apply_runtime(build_tiny_model(0), runtime)

    cache = tmp_path / "runtime.json"
    lines = []
    first = choose_runtime(load, "tiny", candidates=("float32", "float32_packed", "int4"), cache_file=cache,
                           sizes=(1, 8), context=16, log=lines.append, int4_exact=False)
    assert loads == ["float32", "float32_packed"]  # int4 skipped: re-quantizing is not the model's own numerics
    assert first.runtime in ("float32", "float32_packed") and not first.cached
    assert "int4" in first.skipped and len(lines) == 1 and first.runtime in lines[0] and cpu_line() in lines[0]
    second = choose_runtime(load, "tiny", candidates=("float32", "float32_packed"), cache_file=cache, log=lines.append)
    assert second.cached and second.runtime == first.runtime and len(loads) == 2 and len(lines) == 1
    other = choose_runtime(load, "another model", candidates=("float32",), cache_file=cache, sizes=(1, 8), context=16,
                           log=None)
    assert not other.cached and other.runtime == "float32"


def test_choose_runtime_skips_float32_only_where_bfloat16_packed_runs(tmp_path):
    loads = []

    def load(runtime):
        loads.append(runtime)
        return apply_runtime(build_tiny_model(0), runtime)

    candidates = ("float32", "float32_packed", "bfloat16_packed")
    choice = choose_runtime(load, "tiny", candidates=candidates, cache_file=None, sizes=(1, 8), context=16, log=None)
    if runtime_unavailable("bfloat16_packed") is None:  # native bf16: the float32 runtimes are not loaded at all
        assert loads == ["bfloat16_packed"] and choice.runtime == "bfloat16_packed"
        assert "bf16 is native" in choice.skipped["float32"] and "bf16 is native" in choice.skipped["float32_packed"]
    else:  # emulated bf16: float32 is all there is
        assert loads == ["float32", "float32_packed"] and "bfloat16_packed" in choice.skipped
    loads.clear()
    measured = choose_runtime(load, "tiny", candidates=candidates, cache_file=None, sizes=(1, 8), context=16, log=None,
                              float32_where_bf16=True)
    assert loads[:2] == ["float32", "float32_packed"] and "float32" in measured.curves
    # without bfloat16_packed among the candidates, float32 is never skipped
    loads.clear()
    choose_runtime(load, "tiny", candidates=("float32",), cache_file=None, sizes=(1,), context=16, log=None)
    assert loads == ["float32"]


def test_effective_runtime_keeps_dtype_working():
    assert effective_runtime("auto", None) == "auto"
    assert effective_runtime("auto", "bfloat16") == "bfloat16"
    assert effective_runtime("int4", "fp32") == "float32"
    assert effective_runtime(None, None) is None
    with pytest.raises(ValueError, match="unknown runtime"):
        effective_runtime("int16", None)
    with pytest.raises(ValueError, match="unknown dtype"):
        effective_runtime("auto", "float16")


def test_cpu_line_names_the_cpu_and_isa():
    info = cpu_info()
    assert info["cpu"] and info["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert info["cpu"] in cpu_line() and info["cpu_capability"] in cpu_line()


def test_small_gemm_kernel_equals_linear_for_every_row_count():
    from treegraft.models.runtime.kernels import SMALL_GEMM, small_gemm

    kernel = _kernel_or_skip(SMALL_GEMM, small_gemm)
    torch.manual_seed(0)
    for n, k in ((45, 40), (64, 96), (8, 8)):  # a ragged last column group, K not a multiple of 8
        w, b = torch.randn(n, k), torch.randn(n)
        packed = kernel.pack(w)
        for rows in range(1, 13):
            x = torch.randn(rows, k)
            torch.testing.assert_close(kernel.linear(x, packed, n, b), x @ w.T + b, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(kernel.linear(x, packed, n, None), x @ w.T, rtol=1e-5, atol=1e-5)


def test_small_gemm_rows_are_bit_identical_at_every_row_count():
    """Wide products (K blocks with partial sums stored and resumed, balanced row blocks, L2 chunks)
    keep each output's FMA chain: a row of an M-row product equals that row alone, bit for bit."""
    from treegraft.models.runtime.kernels import SMALL_GEMM, small_gemm

    kernel = _kernel_or_skip(SMALL_GEMM, small_gemm)
    torch.manual_seed(0)
    for n, k in ((45, 300), (2100, 40), (37, 1030)):  # K over several K blocks; many chunks of groups
        w, b = torch.randn(n, k), torch.randn(n)
        packed = kernel.pack(w)
        x = torch.randn(70, k)
        alone = torch.cat([kernel.linear(x[i:i + 1].contiguous(), packed, n, b) for i in range(len(x))])
        torch.testing.assert_close(alone, x @ w.T + b, rtol=1e-4, atol=1e-4)
        for rows in (5, 9, 13, 33, 70):
            got = kernel.linear(x[:rows].contiguous(), packed, n, b)
            assert torch.equal(got, alone[:rows]), (n, k, rows)


def test_float32_packed_keeps_one_copy_of_the_weights_with_the_kernel():
    import treegraft.models.runtime as rt
    from treegraft.models.runtime.kernels import SMALL_GEMM, small_gemm

    _kernel_or_skip(SMALL_GEMM, small_gemm)
    lin = _linear(64, 48, True)
    packed = rt.PackedLinear.from_linear(lin)
    assert packed.small is not None and packed.packed is None and packed.weight is None
    x = torch.randn(rt.linears.WIDE_ROWS + 5, 64)  # a prefill-sized product: a transient dense copy
    torch.testing.assert_close(packed(x), lin(x), rtol=1e-5, atol=1e-5)
    x = x[: rt.linears.WIDE_ROWS]
    torch.testing.assert_close(packed(x), lin(x), rtol=1e-5, atol=1e-5)
    assert torch.equal(packed(x)[3:4], packed(x[3:4]))  # up to WIDE_ROWS rows: bit-identical rows


def test_packed_linear_without_the_kernel_uses_mkl_and_onednn(monkeypatch):
    import treegraft.models.runtime as rt
    import treegraft.models.runtime.kernels as kernels

    monkeypatch.setattr(kernels, "small_gemm", lambda: None)
    lin = _linear(64, 48, True)
    packed = rt.PackedLinear.from_linear(lin)
    assert packed.small is None
    for rows in (1, 3):
        x = torch.randn(rows, 64)
        torch.testing.assert_close(packed(x), lin(x), rtol=1e-5, atol=1e-5)


def _avx512():
    from treegraft.models.runtime.kernels import AVX512, avx512_kernels

    return _kernel_or_skip(AVX512, avx512_kernels)


def _kernel_or_skip(kernel, get):
    """The compiled ``kernel``; skip only where this CPU cannot run it: a CPU that can and a kernel that
    did not build is a failure (the build is loud, and so are its tests)."""
    module = get()
    if module is None:
        if kernel.supported():
            pytest.fail(f"{kernel.source} did not build on a CPU that supports it (run scripts/build_kernels.py)")
        pytest.skip(f"this CPU lacks {', '.join(kernel.cpu_flags)}: {kernel.without}")
    return module


def test_avx512_bf16_kernel_is_a_bf16_linear_and_row_invariant():
    """bf16 products with float32 accumulation for every row count (ragged column groups, odd K), and a
    row's result is bit-identical whatever the other rows are: a tree verification row equals the
    one-token forward of the same prefix."""
    kernel = _avx512()
    torch.manual_seed(0)
    for n, k in ((45, 41), (64, 96), (16, 8), (300, 130)):
        w, b = torch.randn(n, k), torch.randn(n)
        packed = kernel.pack_bf16(w)
        for rows in (*range(1, 18), 33):
            x = torch.randn(rows, k)
            ref = x.bfloat16().float() @ w.bfloat16().float().T
            torch.testing.assert_close(kernel.linear_bf16(x, packed, n, b), ref + b, rtol=1e-5, atol=1e-4)
            alone = torch.cat([kernel.linear_bf16(x[i : i + 1].clone(), packed, n, None) for i in range(rows)])
            assert torch.equal(kernel.linear_bf16(x, packed, n, None), alone)


def test_avx512_int8_kernel_quantizes_each_row_alone():
    """int8 weights per column and int8 rows per row: within ~2% of the float product (random weights,
    the quantization error) and, the accumulation being exact, bit-identical per row whatever the batch."""
    kernel = _avx512()
    torch.manual_seed(0)
    for n, k in ((45, 41), (64, 96), (300, 130)):
        w, b = torch.randn(n, k), torch.randn(n)
        packed, scales, colsum = kernel.pack_int8(w)
        for rows in (1, 2, 7, 8, 9, 16, 33):
            x = torch.randn(rows, k)
            y = kernel.linear_int8(x, packed, scales, colsum, n, b)
            ref = x @ w.T
            assert float((y - b - ref).norm() / ref.norm()) < 0.02
            alone = torch.cat([kernel.linear_int8(x[i : i + 1].clone(), packed, scales, colsum, n, b) for i in range(rows)])
            assert torch.equal(y, alone)
            x[0] *= 100  # an outlier row changes only its own scale
            assert torch.equal(kernel.linear_int8(x, packed, scales, colsum, n, b)[1:], y[1:])


def test_int8_runtime_swaps_every_linear_and_stays_close():
    _avx512()
    from treegraft.models.runtime import RowInt8Linear

    ids = list(range(3, 40))
    ref = _logits(build_tiny_model(0), ids)
    model = apply_runtime(build_tiny_model(0), "int8")
    assert model_runtime(model) == "int8"
    assert not any(type(m) is nn.Linear for m in model.modules())
    assert isinstance(model.get_output_embeddings(), RowInt8Linear)
    assert model.get_output_embeddings().weight is not None  # drafters read rows of the head
    out = _logits(model, ids)
    # random weights have no outliers to lose and no margin to keep: errors compound to ~10% over the
    # tiny model's layers; the embedded test below checks what a drafter needs on a real model
    assert float((out - ref).norm() / ref.norm()) < 0.2


@pytest.mark.embedded
def test_int8_keeps_the_top1_of_smollm2():
    _avx512()
    require_embedded("smollm2-135m")
    from treegraft.models import load_model, load_tokenizer

    tok = load_tokenizer("embedded:smollm2-135m")
    ids = tok("def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n"
              "The quick brown fox jumps over the lazy dog. " * 3).input_ids
    ref = _logits(load_model("embedded:smollm2-135m", runtime="float32"), ids)
    out = _logits(load_model("embedded:smollm2-135m", runtime="int8"), ids)
    assert float((out.argmax(-1) == ref.argmax(-1)).float().mean()) >= 0.9


def test_bfloat16_packed_uses_the_avx512_kernel_where_it_runs():
    _avx512()
    lin = _linear(96, 40, True)
    packed = PackedLinear.from_linear(lin, torch.bfloat16)
    assert packed.wide is not None and packed.packed is None  # no second (oneDNN) copy of the weights
    x = torch.randn(5, 96)
    ref = x.bfloat16().float() @ lin.weight.detach().bfloat16().float().T + lin.bias.detach().bfloat16().float()
    torch.testing.assert_close(packed(x), ref, rtol=1e-4, atol=1e-3)


def test_bfloat16_packed_routes_wide_products_to_onednn_above_the_crossover():
    """With ``onednn_above=k`` products of up to k rows stay on the row-invariant AVX-512 kernel and wider
    ones use the oneDNN-packed copy (bf16 out): both are bf16 linears of the same weight."""
    _avx512()
    lin = _linear(96, 40, True)
    one_kernel = PackedLinear.from_linear(lin, torch.bfloat16)
    hybrid = PackedLinear(lin.weight, lin.bias, torch.bfloat16, onednn_above=4)
    assert hybrid.packed is not None and one_kernel.onednn_above is None
    ref_w, ref_b = lin.weight.detach().bfloat16().float(), lin.bias.detach().bfloat16().float()
    for rows in (1, 4, 5, 16):
        x = torch.randn(rows, 96)
        out = hybrid(x)
        torch.testing.assert_close(out, x.bfloat16().float() @ ref_w.T + ref_b, rtol=2e-2, atol=2e-2)
        if rows <= 4:  # the narrow path is the same kernel, bit for bit
            assert torch.equal(out, one_kernel(x))
        else:  # the wide path rounds its output to bf16
            assert torch.equal(out, out.bfloat16().float())


def test_bf16_max_rows_sets_the_crossover_of_every_linear():
    _avx512()
    fixed = apply_runtime(build_tiny_model(0), "bfloat16_packed", bf16_max_rows=8)
    invariant = apply_runtime(build_tiny_model(0), "bfloat16_packed", bf16_max_rows=None)
    for model, above in ((fixed, 8), (invariant, None)):
        assert model.treegraft_bf16_max_rows == above
        assert {m.onednn_above for m in model.modules() if isinstance(m, PackedLinear)} == {above}


def test_bf16_max_rows_auto_measures_the_largest_body_linear(monkeypatch):
    _avx512()
    import treegraft.models.runtime.apply as runtime

    measured = []

    def fake_crossover(weight):
        measured.append(tuple(weight.shape))
        return 16

    monkeypatch.setattr(runtime, "bf16_crossover", fake_crossover)
    model = build_tiny_model(0)
    head = model.get_output_embeddings()
    body = [m.weight for m in model.modules() if isinstance(m, nn.Linear) and m is not head]
    largest = tuple(max(body, key=lambda w: w.numel()).shape)
    model = apply_runtime(model, "bfloat16_packed")
    assert measured == [largest] and model.treegraft_bf16_max_rows == 16
    assert {m.onednn_above for m in model.modules() if isinstance(m, PackedLinear)} == {16}


def test_rows_until_slower_finds_the_crossover():
    import time

    from treegraft.models.runtime.timing import _rows_until_slower

    def narrow(x):  # 2 ms a row
        time.sleep(0.002 * x.shape[0])

    def wide(x):  # 11 ms whatever the rows
        time.sleep(0.011)

    assert _rows_until_slower(narrow, wide, 4, (1, 2, 4, 8, 16)) == 4  # 8 ms < 11 ms < 16 ms
    assert _rows_until_slower(narrow, wide, 4, (1, 2)) is None  # never slower over these rows
    assert _rows_until_slower(wide, narrow, 4, (1, 2)) == 0  # slower from the first row count


def test_middle_runtime_rule():
    from treegraft.models.loading import resolve_middle_runtime

    assert resolve_middle_runtime("same", "bfloat16_packed") == "bfloat16_packed"
    assert resolve_middle_runtime(None, None) is None
    assert resolve_middle_runtime("float32", "bfloat16_packed") == "float32"
    assert resolve_middle_runtime("auto", None) is None  # stock models stay stock
    expected = "int8" if runtime_unavailable("int8") is None else "float32_packed"
    assert resolve_middle_runtime("auto", "float32_packed") == expected
    assert resolve_middle_runtime("auto", "float32_packed", "cuda") == "float32_packed"
    with pytest.raises(ValueError, match="unknown middle_runtime 'int3'"):
        resolve_middle_runtime("int3", "float32")


def _file_backed(model: nn.Module) -> list[str]:
    """Names of the tensors reachable from ``model`` (parameters, buffers, plain attributes) whose memory
    lies in a file mapping of this process."""
    ranges = _file_mapped_ranges()
    found = []
    for mod_name, module in model.named_modules():
        tensors = {**module._parameters, **module._buffers,
                   **{k: v for k, v in vars(module).items() if type(v) is torch.Tensor}}
        for name, t in tensors.items():
            if t is not None and t.layout == torch.strided and not t.is_mkldnn and t.numel():
                ptr = t.untyped_storage().data_ptr()
                if any(start <= ptr < end for start, end in ranges):
                    found.append(f"{mod_name}.{name}")
    return found


needs_proc_maps = pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/self/maps (Linux)")


@needs_proc_maps
def test_release_file_mappings_copies_checkpoint_views_and_keeps_sharing(tmp_path):
    """A checkpoint loaded by transformers is views of the mapped file; afterwards nothing is, every
    tensor that shared memory still shares it, and the logits are bit for bit the same."""
    from transformers import AutoModelForCausalLM

    build_tiny_model(0).save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert "lm_head.weight" in _file_backed(model)  # the premise: the loader maps the safetensors file
    model.lm_head.kept = model.lm_head.weight.detach()  # a plain attribute on a parameter's memory
    ids = list(range(3, 40))
    ref = _logits(model, ids)
    assert release_file_mappings(model) >= model.lm_head.weight.numel() * 4
    assert _file_backed(model) == []
    assert model.lm_head.kept.data_ptr() == model.lm_head.weight.data_ptr()
    assert torch.equal(_logits(model, ids), ref)
    assert release_file_mappings(model) == 0  # nothing left to copy


@needs_proc_maps
def test_a_packed_runtime_leaves_no_tensor_in_the_checkpoint_file(tmp_path):
    """The packed linears' source pages would stay resident while any leftover tensor (norms, the
    embedding, the kept head weight) kept the file mapped."""
    from treegraft.models import load_model

    build_tiny_model(0).save_pretrained(tmp_path)
    ids = list(range(3, 40))
    model = load_model(str(tmp_path), runtime="float32_packed")
    assert _file_backed(model) == []
    torch.testing.assert_close(_logits(model, ids), _logits(build_tiny_model(0), ids), rtol=1e-4, atol=1e-4)


def test_a_kernel_that_does_not_build_is_loud_when_strict(monkeypatch):
    from dataclasses import replace

    from treegraft.models.runtime.kernels import SMALL_GEMM, KernelBuildError, build_kernel

    broken = replace(SMALL_GEMM, name="treegraft_no_such_kernel", source="no_such_kernel.cpp", cpu_flags=())
    with pytest.raises(KernelBuildError, match=r"no_such_kernel.cpp did not build .*MKL/oneDNN"):
        build_kernel(broken, strict=True)
    monkeypatch.setenv("TREEGRAFT_STRICT_KERNELS", "0")
    with pytest.warns(UserWarning, match="did not build"):
        assert build_kernel(broken) is None  # lenient: a user's run falls back with one warning line


def test_a_build_killed_midway_does_not_hang_the_next_one(tmp_path, monkeypatch):
    """A build killed midway leaves PyTorch's lock file behind (on which every later build would wait
    forever): the next build, holding treegraft's flock, removes it with one warning."""
    import threading

    from torch.utils.cpp_extension import _get_build_directory

    from treegraft.models.runtime.kernels import _build_lock

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    folder = Path(_get_build_directory("treegraft_lock_probe", verbose=False))
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "lock").touch()
    with pytest.warns(UserWarning, match="stale build lock"):
        with _build_lock("treegraft_lock_probe"):
            assert not (folder / "lock").exists()
            # a second builder waits while the first holds the flock, and then finds no stale lock
            entered = threading.Event()
            second = threading.Thread(target=lambda: _enter(_build_lock, "treegraft_lock_probe", entered))
            second.start()
            assert not entered.wait(0.5)
    second.join(10)
    assert entered.is_set()


def _enter(lock, name, entered):
    with lock(name):
        entered.set()


@pytest.mark.parametrize("probe, loaded", [(0, False), (4, True)])
def test_choose_runtime_probes_int4_before_loading_it(tmp_path, monkeypatch, probe, loaded):
    import treegraft.models.runtime.choice as choice

    shapes = []
    monkeypatch.setattr(choice, "int4_crossover_of_shape", lambda out, inp: shapes.append((out, inp)) or probe)
    loads = []

    def load(runtime):
        loads.append(runtime)
        return apply_runtime(build_tiny_model(0), runtime)

    model = build_tiny_model(0)
    result = choose_runtime(load, "tiny", candidates=("float32", "int4"), cache_file=None, sizes=(1,), context=16,
                            log=None, int4_exact=True)
    assert shapes == [choice.largest_linear_shape(model)]  # the largest body linear of the first candidate
    assert ("int4" in loads) == loaded
    if not loaded:
        assert result.skipped["int4"] == choice.INT4_SLOWER and "int4" not in result.curves


def test_int4_crossover_of_shape_measures_a_stand_in(monkeypatch):
    import treegraft.models.runtime.choice as choice

    assert choice.int4_crossover_of_shape(48, 33) == 1  # an unsupported shape: the real model decides
    measured = []
    monkeypatch.setattr(choice, "int4_crossover", lambda linear: measured.append(linear) or 7)
    assert choice.int4_crossover_of_shape(64, 96) == 7
    (linear,) = measured
    assert isinstance(linear, Int4Linear) and (linear.out_features, linear.in_features) == (64, 96)


def test_runtime_auto_hands_each_candidates_memory_back(monkeypatch):
    import treegraft.models.runtime.choice as choice
    import treegraft.models.runtime.memory as memory

    trims = []
    monkeypatch.setattr(memory, "_libc_malloc_trim", lambda: (lambda pad: trims.append(pad)))
    memory.return_freed_memory()
    assert trims == [0]  # glibc's malloc_trim(0): every free page of the heap
    calls = []
    monkeypatch.setattr(choice, "return_freed_memory", lambda: calls.append(1))
    choose_runtime(lambda rt: apply_runtime(build_tiny_model(0), rt), "tiny", candidates=("float32", "float32_packed"),
                   cache_file=None, sizes=(1,), context=16, log=None)
    assert len(calls) == 2  # after each measured candidate, before the next one loads


def _resident_kb(path: Path) -> int:
    """kB of ``path``'s mappings resident in this process (/proc/self/smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and len(fields) >= 5 and all(c in "0123456789abcdef-" for c in fields[0]):
            inside = len(fields) == 6 and fields[5] == str(path)
        elif inside and fields[0] == "Rss:":
            total += int(fields[1])
    return total


@needs_proc_maps
def test_file_pages_drops_a_packed_weights_checkpoint_pages_and_never_touches_ordinary_memory(tmp_path):
    """The pages under a file-mapped tensor leave the resident set and its values read back the same
    from the file; a tensor in ordinary memory is left alone (dropping it would zero it)."""
    import numpy as np

    from treegraft.models.runtime.memory import FilePages

    path = tmp_path / "weights.bin"
    values = np.arange(4 << 20, dtype=np.float32)  # 16 MiB
    values.tofile(path)
    mapped = torch.from_numpy(np.memmap(path, dtype=np.float32, mode="c"))
    weight = mapped[1000:(3 << 20)]  # a view inside the mapping, as a checkpoint's weights are
    assert float(weight.sum()) > 0 and _resident_kb(path) >= 12 << 10  # read: resident
    ordinary = torch.arange(1 << 20, dtype=torch.float32)
    pages = FilePages()
    assert pages.drop(ordinary) == 0 and torch.equal(ordinary, torch.arange(1 << 20, dtype=torch.float32))
    before = _resident_kb(path)
    released = pages.drop(weight)
    assert released >= weight.numel() * 4 - 2 * 4096 and pages.dropped == released
    assert _resident_kb(path) <= before - released // 1024 + 8
    assert torch.equal(weight, torch.from_numpy(values[1000:(3 << 20)]))  # read again from the file
    assert pages.drop(weight[::2]) == 0  # not contiguous: its bytes are not its own


@needs_proc_maps
def test_packing_hands_back_each_original_weights_file_pages_as_it_goes(tmp_path, monkeypatch):
    """apply_runtime drops the checkpoint pages of every linear it packed away, all but the kept head's
    (loading Qwen 1.5B to bfloat16_packed peaked at 16.65 GB without this, 9.9 GB with it)."""
    import treegraft.models.runtime.apply as apply_mod
    from treegraft.models import load_model
    from treegraft.models.runtime.memory import FilePages

    handed: list[bool] = []

    class Recording(FilePages):
        def drop(self, t):
            ranges = _file_mapped_ranges()
            handed.append(any(lo <= t.data_ptr() < hi for lo, hi in ranges))
            return super().drop(t)

    monkeypatch.setattr(apply_mod, "FilePages", Recording)
    build_tiny_model(0).save_pretrained(tmp_path)
    model = load_model(str(tmp_path), runtime="float32_packed")
    linears = sum(isinstance(m, PackedLinear) for m in model.modules())
    assert len(handed) == linears - 1 and all(handed)  # every packed linear but the head, each from the file
