"""What a model source names, and the checks that a target and its middle drafter share one vocabulary.

A model source is ``embedded:<name>`` (a model ``make models`` converted into ``<models_dir>/<name>``,
which :func:`resolve_source` turns into that folder or a :class:`ModelLoadError` naming the command to
run), a local Hugging Face folder, a hub id, or ``tiny-random:<seed>``. This module holds those names
and the dtype names (:func:`resolve_dtype`), loads a source's tokenizer (:func:`load_tokenizer`), and
checks a pair's vocabularies, by tokenizer (:func:`check_same_vocabulary`) and by the width of the
models' output heads (:func:`check_same_output_size`), raising :class:`TokenizerMismatchError`. No
model weight is read here; :mod:`.loading` loads the models.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from ..paths import default_models_dir
from .embedded import EMBEDDED_MODELS, is_converted
from .tiny import TINY_PREFIX, build_tiny_tokenizer

__all__ = ["EMBEDDED_PREFIX", "ModelLoadError", "TokenizerMismatchError", "resolve_dtype", "resolve_source",
           "load_tokenizer", "check_same_vocabulary", "check_same_output_size"]

EMBEDDED_PREFIX = "embedded:"


class ModelLoadError(RuntimeError):
    """A model or tokenizer could not be found or loaded; the message says what to do."""


class TokenizerMismatchError(ValueError):
    """Target and middle drafter do not share one vocabulary."""


_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[str(dtype)]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of float32, bfloat16, float16") from None


def resolve_source(source: str, models_dir: str | os.PathLike | None = None) -> str:
    """Turn ``embedded:<name>`` into its converted folder (or fail with the command to run)."""
    if not source.startswith(EMBEDDED_PREFIX):
        return source
    name = source[len(EMBEDDED_PREFIX):]
    if name not in EMBEDDED_MODELS:
        raise ModelLoadError(f"unknown embedded model {name!r}; expected one of {sorted(EMBEDDED_MODELS)}")
    folder = Path(models_dir or default_models_dir()) / name
    if not is_converted(folder, EMBEDDED_MODELS[name]):
        hint = "make models" if name != "gemma3-270m" else "make models MODELS=all"
        raise ModelLoadError(f"embedded model {name} not converted: run `{hint}` (looked in {folder})")
    return str(folder)


def load_tokenizer(source: str, models_dir: str | os.PathLike | None = None):
    from transformers import AutoTokenizer

    if source.startswith(TINY_PREFIX):
        return build_tiny_tokenizer()
    path = resolve_source(source, models_dir)
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"cannot load tokenizer {source!r}: {str(err).splitlines()[0]}") from err


def check_same_vocabulary(target_tokenizer, middle_tokenizer, target_name: str, middle_name: str) -> None:
    """Raise :class:`TokenizerMismatchError` unless both tokenizers map every token to the same id."""
    tv, mv = target_tokenizer.get_vocab(), middle_tokenizer.get_vocab()
    if tv != mv:
        only_t = len(set(tv) - set(mv))
        only_m = len(set(mv) - set(tv))
        moved = sum(1 for t in set(tv) & set(mv) if tv[t] != mv[t])
        raise TokenizerMismatchError(
            f"tokenizer mismatch: target {target_name} ({len(tv)} tokens) and middle {middle_name} ({len(mv)} tokens) "
            f"differ ({only_t} only in target, {only_m} only in middle, {moved} with other ids); "
            "the middle drafter must share the target's tokenizer"
        )


def _output_size(model: nn.Module) -> int:
    head = model.get_output_embeddings()
    return int(getattr(head, "out_features", None) or head.weight.shape[0])


def check_same_output_size(target: nn.Module, middle: nn.Module, target_name: str, middle_name: str | None) -> None:
    """Raise :class:`TokenizerMismatchError` unless both models' LM heads give as many logits (one per token)."""
    t_vocab, m_vocab = _output_size(target), _output_size(middle)
    if t_vocab != m_vocab:
        raise TokenizerMismatchError(
            f"tokenizer mismatch: target {target_name} has {t_vocab} output logits, middle {middle_name} has {m_vocab}"
        )
