"""Convert a GGUF file into a Hugging Face model folder (safetensors + config + tokenizer).

Why not ``from_pretrained(..., gguf_file=...)``: transformers re-parses the metadata arrays
(vocabulary, merges) element by element for the tokenizer and again for the model, which costs
minutes to tens of minutes per model on a CPU, and it refuses ``save_pretrained`` on the result.
Here the file is read once with the ``gguf`` package's memory-mapped reader, tensors are
dequantized with ``gguf.dequantize``, and transformers' own mapping tables do the rest:

* config keys: ``GGUF_CONFIG_MAPPING`` (the table ``load_gguf_checkpoint`` uses);
* tensor names: ``get_gguf_hf_weights_map`` on a model built on the meta device;
* tensor fix-ups (llama's rotary permutation of q/k, Gemma's ``norm - 1``): ``TENSOR_PROCESSORS``;
* tokenizer: ``convert_gguf_tokenizer`` fed with the vocabulary and merges parsed here.

The result equals transformers' GGUF load token for token and logit for logit
(``tests/test_gguf_convert.py``). Weights are stored in float32: the dequantized values of the
k-quants need more mantissa than bfloat16/float16 has, and the dtype is chosen at load time.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = ["read_gguf_metadata", "convert_gguf_to_hf", "CONVERTER_VERSION"]

# Bump when the output of the converter changes, so cached folders are rebuilt.
CONVERTER_VERSION = 1

# GGUF architecture name -> transformers model_type, where they differ.
_MODEL_TYPE = {"gemma3": "gemma3_text"}


def read_gguf_metadata(reader) -> dict[str, Any]:
    """All metadata of a ``gguf.GGUFReader`` as plain Python values (strings decoded, arrays as lists)."""
    return {key: field.contents() for key, field in reader.fields.items()}


def _config_dict(metadata: dict[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    """The transformers config dict for this file, following ``load_gguf_checkpoint``."""
    from transformers.integrations import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_CONFIG_MAPPING

    arch = metadata["general.architecture"]
    if arch not in GGUF_CONFIG_MAPPING:
        raise ValueError(f"GGUF architecture {arch!r} is not supported; expected one of {sorted(GGUF_CONFIG_MAPPING)}")
    config: dict[str, Any] = dict(GGUF_CONFIG_DEFAULTS_MAPPING.get(arch, {}))
    # llama.cpp writes output.weight only when the head is not tied to the embedding
    config["tie_word_embeddings"] = "output.weight" not in tensor_names
    for key, value in metadata.items():
        prefix, _, rest = key.partition(".")
        renames = GGUF_CONFIG_MAPPING.get(prefix, {})
        target = renames.get(rest)
        if target is None or target == -1:
            continue
        config[target] = value
    config["model_type"] = _MODEL_TYPE.get(arch, arch)
    config.pop("_model_name_or_path", None)
    if "vocab_size" not in config:
        config["vocab_size"] = len(metadata["tokenizer.ggml.tokens"])
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        gguf_key = {"pad_token_id": "tokenizer.ggml.padding_token_id"}.get(name, f"tokenizer.ggml.{name}")
        if gguf_key in metadata:
            config[name] = int(metadata[gguf_key])
    return config


def _build_tokenizer(metadata: dict[str, Any]):
    """A fast tokenizer built from the parsed vocabulary with transformers' GGUF builders."""
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        GGUF_TOKENIZER_MAPPING,
        _SPECIAL_TOKENS,
        convert_gguf_tokenizer,
    )

    groups = {
        group: {name: metadata[f"tokenizer.{key}"] for key, name in renames.items() if f"tokenizer.{key}" in metadata}
        for group, renames in GGUF_TOKENIZER_MAPPING.items()
    }
    tokenizer_dict, tokenizer_config = groups["tokenizer"], groups["tokenizer_config"]
    if tokenizer_dict.get("tokenizer_type") == "llama":
        tokenizer_config.setdefault("add_bos_token", True)  # as transformers' get_gguf_tokenizer does
    for name, key in _SPECIAL_TOKENS.items():
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        tokenizer_config[name] = tokenizer_dict["tokens"][int(token_id)] if token_id is not None else None
    backend, extra = convert_gguf_tokenizer(metadata["general.architecture"], tokenizer_dict)
    tokenizer_config.update(extra)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **tokenizer_config)


def convert_gguf_to_hf(
    gguf_path: str | os.PathLike, out_dir: str | os.PathLike, progress: bool = True, extra_meta: dict | None = None
) -> Path:
    """Convert ``gguf_path`` into a Hugging Face folder at ``out_dir`` (written atomically).

    The folder is first built under ``<out_dir>.tmp`` and renamed into place when complete, so an
    interrupted conversion never leaves a folder that looks finished.
    """
    import gguf
    from tqdm.auto import tqdm
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

    out_dir = Path(out_dir)
    tmp_dir = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp_dir, ignore_errors=True)
    tmp_dir.mkdir(parents=True)

    started = time.perf_counter()
    reader = gguf.GGUFReader(str(gguf_path))
    metadata = read_gguf_metadata(reader)
    tensor_names = {t.name for t in reader.tensors}
    arch = metadata["general.architecture"]

    tokenizer = _build_tokenizer(metadata)
    tokenizer.save_pretrained(tmp_dir)

    config_dict = _config_dict(metadata, tensor_names)
    model_type = config_dict.pop("model_type")
    config = AutoConfig.for_model(model_type, **config_dict)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=config.to_dict())
    name_map = get_gguf_hf_weights_map(model, processor)

    state_dict: dict[str, torch.Tensor] = {}
    for tensor in tqdm(reader.tensors, desc=f"dequantize {out_dir.name}", disable=not progress, unit="tensor"):
        weights = gguf.dequantize(tensor.data, tensor.tensor_type)
        result = processor.process(weights=weights, name=tensor.name)
        if result.name not in name_map:
            continue
        state_dict[name_map[result.name]] = torch.from_numpy(np.array(result.weights, dtype=np.float32))  # a writable copy

    expected = set(model.state_dict())
    if config.tie_word_embeddings:
        expected.discard("lm_head.weight")
    missing = sorted(expected - set(state_dict))
    if missing:
        raise ValueError(f"GGUF file {gguf_path} lacks tensors for {missing[:5]} (and {max(0, len(missing) - 5)} more)")
    model.load_state_dict(state_dict, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.tie_weights()
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    )
    model.save_pretrained(tmp_dir, max_shard_size="2GB")
    meta = {
        "converter_version": CONVERTER_VERSION,
        "source": str(gguf_path),
        "architecture": arch,
        "model_type": model_type,
        "gguf_name": metadata.get("general.name"),
        "seconds": round(time.perf_counter() - started, 1),
        **(extra_meta or {}),
    }
    (tmp_dir / "treegraft_conversion.json").write_text(json.dumps(meta, indent=2))
    del model, state_dict, reader

    shutil.rmtree(out_dir, ignore_errors=True)
    tmp_dir.rename(out_dir)
    return out_dir
