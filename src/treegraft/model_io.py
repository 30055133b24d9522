"""Running a stock transformers causal LM over draft-tree inputs with its own KV cache.

The model is called through its own classes (``model.base_model`` then ``model.lm_head``), never
patched: a custom 4D additive attention mask carries the tree structure and ``position_ids`` carry
the depth positions. Logits are computed only for the rows that need them, because on a CPU the LM
head over a large vocabulary costs as much as several decoder layers per row.
"""

from __future__ import annotations

import contextlib
import os

import torch
from torch import nn

from .devices import device_tensor

__all__ = [
    "new_cache",
    "cache_length",
    "lm_logits",
    "head_weight",
    "logit_softcap",
    "attention_mask_for",
    "forward_hidden",
    "keep_cache_positions",
    "truncate_cache",
    "check_attention",
]


def new_cache():
    """An empty KV cache whose every layer keeps all positions (sliding windows are applied by the mask)."""
    from transformers import DynamicCache

    return DynamicCache()


def cache_length(cache) -> int:
    return cache.get_seq_length()


def lm_logits(model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """float32 logits for hidden rows ``[..., H] -> [..., V]``, exactly as the model's forward computes them."""
    logits = model.lm_head(hidden)
    cap = getattr(model.config, "final_logit_softcapping", None)
    if cap is not None:
        logits = torch.tanh(logits / cap) * cap
    return logits.float()


def head_weight(model: nn.Module) -> torch.Tensor:
    """The LM head's dense weight ``[V, H]`` (kept by every runtime for the head: drafters read rows of it).
    A head offloaded by accelerate (its weight on the meta device) is read from its hook's weights map."""
    head = model.get_output_embeddings()
    weight = getattr(head, "weight", None)
    if weight is None:
        raise ValueError(f"{type(model).__name__}'s LM head keeps no dense weight")
    if weight.device.type == "meta":
        hook = getattr(head, "_hf_hook", None)
        weights_map = next((h.weights_map for h in [hook, *getattr(hook, "hooks", ())]
                            if getattr(h, "weights_map", None) is not None), None)
        if weights_map is None:
            raise ValueError(f"{type(model).__name__}'s LM head is on the meta device and no offload hook holds its weight")
        weight = weights_map["weight"]
    return weight


def logit_softcap(model: nn.Module) -> float | None:
    """Gemma's final logit soft-capping (None for models without it)."""
    return getattr(model.config, "final_logit_softcapping", None)


def _sliding_window(model: nn.Module) -> int | None:
    config = model.config
    types = getattr(config, "layer_types", None) or []
    if "sliding_attention" in types and getattr(config, "sliding_window", None):
        return int(config.sliding_window)
    return None


def attention_mask_for(
    model: nn.Module, allowed: torch.Tensor, query_pos: torch.Tensor, key_pos: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor | dict:
    """The 4D additive mask [1, 1, q, kv] from a boolean "may attend" matrix [q, kv].

    For models with sliding-window layers (Gemma 3) a dict ``{layer_type: mask}`` is returned, the
    sliding mask additionally blocking keys ``window`` or more positions behind the query, so the
    result matches the model's own masking.
    """
    neg = torch.finfo(dtype).min
    full = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, neg)[None, None]
    window = _sliding_window(model)
    if window is None:
        return full
    in_window = (query_pos[:, None] - key_pos[None, :]) < window
    sliding = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    sliding.masked_fill_(~(allowed & in_window), neg)
    return {"full_attention": full, "sliding_attention": sliding[None, None]}


def forward_hidden(
    model: nn.Module,
    cache,
    tokens: torch.Tensor,
    position_ids: torch.Tensor,
    allowed: torch.Tensor | None,
    key_positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Append ``tokens`` [q] to ``cache`` and return the final hidden states [q, H].

    ``allowed`` [q, past + q] says which cached and new positions each new token may attend to;
    ``None`` means plain causal attention (prefill of a chain). ``key_positions`` [past + q] are the
    position ids of the keys (needed only for sliding-window models; defaults to 0..past-1 followed
    by ``position_ids``).
    """
    device = tokens.device
    past = cache_length(cache)
    mask = None
    if allowed is not None:
        if key_positions is None:
            key_positions = torch.cat([torch.arange(past, device=device), position_ids])
        dtype = next(model.parameters()).dtype
        mask = attention_mask_for(model, allowed.to(device), position_ids, key_positions, dtype)
    with tree_attention(model, enabled=mask is not None):
        out = model.base_model(
            input_ids=tokens[None], position_ids=position_ids[None], attention_mask=mask, cache=cache, use_cache=True
        )
    return out.last_hidden_state[0]


TREE_SDPA = "treegraft_tree_sdpa"
# grouped-query attention under a tree mask: "fold" the query heads of each K/V head into its rows (tree_sdpa),
# "repeat" K/V per query head (transformers' sdpa with a mask); chosen by measurement (docs/gpu.md)
GQA_UNDER_MASK = os.environ.get("TREEGRAFT_GQA", "fold")


def tree_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """transformers' sdpa for a forward under a tree mask, without repeating K/V for grouped-query attention.

    With a mask and several query rows, transformers' sdpa copies every K/V head ``G`` times (``repeat_kv``:
    Qwen3-32B's 64 query heads over 8 K/V heads copy the whole KV cache 8x in every layer of every
    verification). Here the ``G`` query heads of a K/V head become ``G x q`` rows of that head instead
    (query ``[B, Hkv, G*q, d]``, the mask tiled ``G`` times along its rows): the same dot products, no
    copy of the cache. Anything else (no mask, one row, no grouping, bias, soft-capping, sinks, dropout)
    goes to transformers' own sdpa."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    q_len = query.shape[2]
    if (groups == 1 or q_len == 1 or attention_mask is None or not isinstance(attention_mask, torch.Tensor)
            or attention_mask.dim() != 4 or attention_mask.shape[1] != 1 or dropout
            or any(kwargs.get(k) is not None for k in ("position_bias", "softcap", "s_aux", "sinks"))):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    batch, heads, _, dim = query.shape
    folded = query.reshape(batch, key.shape[1], groups * q_len, dim)
    rows, kv = attention_mask.shape[0], attention_mask.shape[-1]
    mask = attention_mask[:, :, None].expand(rows, 1, groups, q_len, kv).reshape(rows, 1, groups * q_len, kv)
    out = torch.nn.functional.scaled_dot_product_attention(folded, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(batch, heads, q_len, value.shape[-1]).transpose(1, 2).contiguous(), None


@contextlib.contextmanager
def tree_attention(model: nn.Module, enabled: bool = True):
    """Run ``model``'s sdpa attention layers through :func:`tree_sdpa` inside the block (a tree forward);
    other attention implementations, and every call outside the block, are left as they are."""
    configs = getattr(model, "_treegraft_attention_configs", None)
    if configs is None:  # the configs the attention layers read (a self-draft's layers are the target's)
        configs = list({id(m.config): m.config for m in model.modules()
                        if hasattr(m, "num_key_value_groups") and hasattr(m, "config")}.values())
        model._treegraft_attention_configs = configs
    switch = [c for c in configs if enabled and GQA_UNDER_MASK == "fold"
              and getattr(c, "_attn_implementation_internal", None) == "sdpa"]
    if switch:
        from transformers import AttentionInterface

        if TREE_SDPA not in AttentionInterface._global_mapping:
            AttentionInterface.register(TREE_SDPA, tree_sdpa)
    for c in switch:
        c._attn_implementation_internal = TREE_SDPA
    try:
        yield
    finally:
        for c in switch:
            c._attn_implementation_internal = "sdpa"


def keep_cache_positions(cache, prefix: int, tail: list[int]) -> None:
    """Keep cached positions ``0..prefix-1`` followed by ``tail`` (increasing, all >= prefix).

    Only the tail entries are moved (in place, right after the prefix), then the cache is cut, so
    the cost is proportional to the accepted tokens, not to the context.
    """
    n = len(tail)
    contiguous = tail == list(range(prefix, prefix + n))
    index: dict[torch.device, torch.Tensor] = {}  # one copy of the index per device the layers sit on
    for layer in cache.layers:
        if getattr(layer, "keys", None) is None or layer.keys.numel() == 0:
            continue
        if not contiguous:
            device = layer.keys.device
            idx = index.get(device)
            if idx is None:
                idx = index[device] = device_tensor(tail, device)
            layer.keys[..., prefix : prefix + n, :] = layer.keys.index_select(-2, idx)
            layer.values[..., prefix : prefix + n, :] = layer.values.index_select(-2, idx)
        layer.keys = layer.keys[..., : prefix + n, :]
        layer.values = layer.values[..., : prefix + n, :]


def truncate_cache(cache, length: int) -> None:
    """Drop every cached position from ``length`` on."""
    for layer in cache.layers:
        if getattr(layer, "keys", None) is None or layer.keys.numel() == 0:
            continue
        layer.keys = layer.keys[..., :length, :]
        layer.values = layer.values[..., :length, :]


def check_attention(model: nn.Module) -> None:
    """Refuse, in one line, an attention implementation that would read the tree mask wrongly:
    flash-attention-2 takes a 4D mask for a padding mask (sdpa and eager apply it as given)."""
    impl = str(getattr(model.config, "_attn_implementation", None) or "")
    if impl.startswith("flash_attention") or impl.startswith("flash"):
        raise ValueError(f"attention implementation {impl!r} cannot run a tree mask (it reads a 4D mask as padding); "
                         "load the model with attn_implementation='sdpa' or 'eager'")


def eos_token_ids(model: nn.Module | None, tokenizer=None) -> set[int]:
    """Every id that ends generation: the generation config's eos ids plus the tokenizer's."""
    ids: set[int] = set()
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for source in (gen_eos, getattr(tokenizer, "eos_token_id", None)):
        if source is None:
            continue
        ids.update([int(source)] if isinstance(source, int) else [int(x) for x in source])
    return ids
