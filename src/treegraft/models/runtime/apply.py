"""Switching a loaded model to a runtime, in place."""

from __future__ import annotations

from typing import Mapping

import torch
from torch import nn

from .kernels import avx512_kernels
from .linears import Int4Block, Int4Linear, PackedLinear, RowInt8Linear, int4_supported_shape, quantize_int4_rtn
from .memory import FilePages, release_file_mappings, return_freed_memory
from .names import RuntimeUnavailable, runtime_unavailable
from .timing import bf16_crossover, int4_crossover

__all__ = ["apply_runtime"]


def _linears(model: nn.Module):
    """(parent module, attribute name, full name) of every nn.Linear, parents before children.

    Only names are collected up front: holding the Linear modules themselves would keep every
    original weight alive until the whole swap is done (twice the memory at the peak).
    """
    names = [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    for full in names:
        parent_name, _, name = full.rpartition(".")
        yield model.get_submodule(parent_name) if parent_name else model, name, full



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
    pages = FilePages()

    def swap(parent: nn.Module, name: str, linear: nn.Linear, new: nn.Module) -> None:
        setattr(parent, name, new)
        if linear is not head:  # the original weight is gone for good: its checkpoint pages need not wait
            pages.drop(linear.weight)  # for the whole mapping to close (see FilePages)

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
            swap(parent, name, linear, PackedLinear.from_linear(linear, dtype, keep_weight=linear is head, onednn_above=above))
    elif runtime == "int8":
        for parent, name, _ in _linears(model):
            linear = getattr(parent, name)
            swap(parent, name, linear, RowInt8Linear.from_linear(linear, keep_weight=linear is head))
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
                swap(parent, name, linear, PackedLinear.from_linear(linear, keep_weight=linear is head))
            else:
                module = Int4Linear(block, linear.bias, max_rows=None)
                swap(parent, name, linear, module)
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
    return_freed_memory()  # the float32 originals' heap pages, where they were not mapped
    return model

