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
from pathlib import Path
from typing import Any

import numpy as np
import torch
from ..devices import now

__all__ = ["read_gguf_metadata", "convert_gguf_to_hf", "extract_int4_blocks", "CONVERTER_VERSION"]

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


def _hf_context(reader):
    """(metadata, arch, config, processor, gguf->HF tensor name map, meta-device model) of a GGUF file."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

    metadata = read_gguf_metadata(reader)
    tensor_names = {t.name for t in reader.tensors}
    arch = metadata["general.architecture"]
    config_dict = _config_dict(metadata, tensor_names)
    model_type = config_dict.pop("model_type")
    config = AutoConfig.for_model(model_type, **config_dict)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=config.to_dict())
    name_map = get_gguf_hf_weights_map(model, processor)
    return metadata, arch, model_type, config, processor, name_map, model


def convert_gguf_to_hf(
    gguf_path: str | os.PathLike, out_dir: str | os.PathLike, progress: bool = True, extra_meta: dict | None = None
) -> Path:
    """Convert ``gguf_path`` into a Hugging Face folder at ``out_dir`` (written atomically).

    The folder is first built under ``<out_dir>.tmp`` and renamed into place when complete, so an
    interrupted conversion never leaves a folder that looks finished.
    """
    import gguf
    from tqdm.auto import tqdm
    from transformers import GenerationConfig

    out_dir = Path(out_dir)
    tmp_dir = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp_dir, ignore_errors=True)
    tmp_dir.mkdir(parents=True)

    started = now()
    reader = gguf.GGUFReader(str(gguf_path))
    metadata, arch, model_type, config, processor, name_map, model = _hf_context(reader)

    tokenizer = _build_tokenizer(metadata)
    tokenizer.save_pretrained(tmp_dir)

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
        "seconds": round(now() - started, 1),
        **(extra_meta or {}),
    }
    (tmp_dir / "treegraft_conversion.json").write_text(json.dumps(meta, indent=2))
    del model, state_dict, reader

    shutil.rmtree(out_dir, ignore_errors=True)
    tmp_dir.rename(out_dir)
    return out_dir


# GGUF 4-bit block types whose weights are exactly int4 groups of 32 with a scale and a zero point
_INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")


def _int4_groups(data: np.ndarray, qtype_name: str, shape: tuple[int, int]):
    """codes uint8 [N, K] (0..15), scales and zeros float32 [N, K / 32] with
    ``w = (codes - 8) * scale + zero`` equal to llama.cpp's dequantization of the blocks."""
    import gguf

    n, k = shape
    qtype = getattr(gguf.GGMLQuantizationType, qtype_name)
    _, type_size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = np.ascontiguousarray(data).reshape(-1, type_size)
    nb = blocks.shape[0]

    def nibbles(qs: np.ndarray, width: int) -> np.ndarray:  # low nibbles of `width` bytes, then the high ones
        qs = qs.reshape(nb, -1, 1, width) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
        return (qs & np.uint8(0x0F)).reshape(nb, -1)

    if qtype_name == "Q4_0":  # w = d * (q - 8)
        d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
        codes, scale, zero = nibbles(blocks[:, 2:], 16), d, np.zeros_like(d)
    elif qtype_name == "Q4_1":  # w = d * q + m
        d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
        m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
        codes, scale, zero = nibbles(blocks[:, 4:], 16), d, m + 8 * d
    else:  # Q4_K: 256-weight super-blocks of 8 groups; w = d * sc * q - dmin * m
        d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
        dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
        sc, mn = gguf.quants.Q4_K.get_scale_min(blocks[:, 4:16].copy())
        a = d * sc.astype(np.float32)
        b = dmin * mn.astype(np.float32)
        codes, scale, zero = nibbles(blocks[:, 16:], 32), a, 8 * a - b
    return (codes.reshape(n, k).astype(np.uint8), scale.reshape(n, k // 32).astype(np.float32),
            zero.reshape(n, k // 32).astype(np.float32))


def extract_int4_blocks(gguf_path: str | os.PathLike) -> dict[str, dict[str, torch.Tensor]]:
    """The 4-bit tensors of a GGUF file as int4 groups, keyed by HF weight name:
    ``{name: {"codes": uint8 [N, K], "scales": float32 [N, K/32], "zeros": float32 [N, K/32]}}``.

    Only Q4_0 / Q4_1 / Q4_K tensors are returned (a Q4_K_M file keeps some tensors in Q6_K or Q8_0:
    those stay dense). Row permutations of the HF mapping (llama's q/k) are applied to every array.
    """
    import gguf

    reader = gguf.GGUFReader(str(gguf_path))
    *_, processor, name_map, _model = _hf_context(reader)
    out: dict[str, dict[str, torch.Tensor]] = {}
    for tensor in reader.tensors:
        qname = tensor.tensor_type.name
        if qname not in _INT4_TYPES or len(tensor.shape) != 2:
            continue
        k, n = (int(x) for x in tensor.shape)  # GGUF lists dims innermost first
        codes, scales, zeros = _int4_groups(tensor.data, qname, (n, k))
        arrays = {}
        for key, arr in (("codes", codes), ("scales", scales), ("zeros", zeros)):
            result = processor.process(weights=arr, name=tensor.name)
            arrays[key] = torch.from_numpy(np.ascontiguousarray(result.weights))
        if result.name in name_map:
            out[name_map[result.name]] = arrays
    return out
