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
``float32_packed``   float32 weights prepacked once: our kernel (``csrc/small_gemm.cpp``, AVX2/FMA,
                     compiled on first use) for every row count (one packed copy, the float32 weight
                     bytes; every row computed in the same order whatever the row count); without
                     the kernel oneDNN's prepacked GEMM (and MKL's packed GEMV for one row)
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

The parts: :mod:`.names` (runtime names and what each needs), :mod:`.kernels` (the compiled
kernels), :mod:`.linears` (packing and quantisation), :mod:`.timing` (crossovers, cost curves),
:mod:`.apply` (the swap), :mod:`.memory` (the checkpoint mapping), :mod:`.choice` (``auto``).
"""

from __future__ import annotations

from .apply import apply_runtime
from .choice import DEFAULT_CANDIDATES, RuntimeChoice, choose_runtime, float32_redundant, pick_runtime
from .kernels import AVX512_FLAGS, KERNELS_VERSION, avx512_kernels, runtime_cache_key, small_gemm
from .linears import (INT4_GROUP, Int4Block, Int4Linear, PackedLinear, RowInt8Linear, int4_supported_shape,
                      quantize_int4_rtn)
from .memory import release_file_mappings
from .names import (RUNTIMES, RuntimeUnavailable, check_runtime_name, effective_runtime, model_runtime,
                    runtime_load_dtype, runtime_unavailable)
from .timing import bf16_crossover, curve_at, forward_curve, int4_crossover

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
    "DEFAULT_CANDIDATES",
    "AVX512_FLAGS",
    "KERNELS_VERSION",
    "small_gemm",
    "INT4_GROUP",
    "int4_supported_shape",
    "check_runtime_name",
    "int4_crossover",
]
