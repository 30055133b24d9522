"""The self-draft middle drafter: a target's first ``k`` decoder layers run as a model of their own.

:func:`make_self_draft` builds, on the meta device, a causal LM of the target's own class whose config has
``k`` layers, then hands it the target's embedding, first ``k`` layers, final norm, rotary embedding and
LM head, so every tensor it holds is one of the target's (no copy, the target's dtype and device, and an
offloaded target's hooks with them). It keeps a KV cache of its own, so a decoder uses it exactly like an
independent middle drafter. A pair asks for it with ``PairSpec(self_draft_layers=k)``
(:func:`~.loading.load_pair`).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

__all__ = ["make_self_draft"]


def make_self_draft(target: nn.Module, num_layers: int) -> nn.Module:
    """A causal LM that runs the target's first ``num_layers`` decoder layers, sharing every weight.

    The drafter is a model of the target's own class whose config has ``num_layers`` layers; its
    embedding, layers, final norm, rotary embedding and LM head *are* the target's modules, so it
    costs no memory and follows the target's dtype and device. It keeps its own KV cache (layer
    indices 0..k-1), so it can be used exactly like an independent middle drafter.
    """
    base = target.base_model
    total = len(base.layers)
    if not 1 <= num_layers <= total:
        raise ValueError(f"self_draft_layers must be in 1..{total} for this target, got {num_layers}")
    config = copy.deepcopy(target.config)
    config.num_hidden_layers = num_layers
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = list(config.layer_types[:num_layers])
    with torch.device("meta"):
        draft = type(target)(config)
    draft_base = draft.base_model
    for name, module in base.named_children():
        if name == "layers":
            draft_base.layers = nn.ModuleList(list(base.layers[:num_layers]))
        else:
            setattr(draft_base, name, module)
    draft.lm_head = target.lm_head
    # every tensor of the draft is one of the target's (by identity: an offloaded target's own weights sit on meta)
    shared = {id(t) for t in [*target.parameters(), *target.buffers()]}
    leftover = [n for n, t in [*draft.named_parameters(), *draft.named_buffers()] if id(t) not in shared]
    if leftover:
        raise RuntimeError(f"self-draft of {type(target).__name__} left modules unshared: {leftover[:3]}")
    draft.generation_config = copy.deepcopy(target.generation_config)
    return draft.eval()
