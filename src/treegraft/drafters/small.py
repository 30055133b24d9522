"""The small drafter q_s of the tree decoder: the n-gram drafter (default) or a small *neural* drafter.

Appendix D of the paper replaces the n-gram small drafter with a small neural drafter of the same
tokenizer, everything else equal. Here a neural small drafter is one of

* ``self_draft``: the middle drafter's first ``layers`` decoder layers with its final norm and LM head
  (:func:`~treegraft.models.make_self_draft`: the middle's own modules, no copy), the stand-in on a
  family without a smaller model (Qwen2.5-Coder: 0.5B is the smallest);
* ``model``: another causal LM of the same tokenizer loaded by source (``embedded:<name>``, a local
  folder, a hub id), e.g. Qwen3-0.6B under a Qwen3-1.7B middle drafter; with ``layers`` its first
  ``layers`` decoder layers only.

Either runs behind the middle drafter's own engine (:class:`~treegraft.engines.torch.MiddleDrafter`):
an incremental KV cache of its own over the context and the draft tree, the accepted path kept after
verification and the rest of the emitted tokens encoded at its next call, so there is one cache
machinery, not two. On a small step it proposes, for each node the step expands, its own top-m tokens
scored by its own log-probabilities (the builders' small-step selection is unchanged).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn

__all__ = ["SMALL_DRAFTERS", "SmallDrafterConfig", "small_config", "neural_small_model"]

SMALL_DRAFTERS = ("ngram", "self_draft", "model")


@dataclass(frozen=True)
class SmallDrafterConfig:
    """Which small drafter a tree decoder uses (``conf/small/<name>.yaml``).

    name: ``ngram`` (the n-gram lookup drafter, the default), ``self_draft`` (the middle drafter's first
        ``layers`` layers) or ``model`` (the model ``model``, or its first ``layers`` layers).
    layers: decoder layers the neural drafter runs (required for ``self_draft``; optional for ``model``).
    model: the small model's source for ``model`` (``embedded:<name>``, a folder, a hub id).
    top_m: children per expanded node on a small step (None: the turn's m, as for the n-gram drafter).
    """

    name: str = "ngram"
    layers: int | None = None
    model: str | None = None
    top_m: int | None = None

    def __post_init__(self) -> None:
        if self.name not in SMALL_DRAFTERS:
            raise ValueError(f"unknown small drafter {self.name!r}; expected one of {', '.join(SMALL_DRAFTERS)}")
        if self.layers is not None and (isinstance(self.layers, bool) or int(self.layers) < 1):
            raise ValueError(f"small drafter layers must be an int >= 1 or null, got {self.layers!r}")
        if self.top_m is not None and (isinstance(self.top_m, bool) or int(self.top_m) < 1):
            raise ValueError(f"small drafter top_m must be an int >= 1 or null, got {self.top_m!r}")
        if self.name == "ngram" and (self.layers is not None or self.model is not None):
            raise ValueError(f"small drafter ngram takes no layers or model, got layers={self.layers!r}, "
                             f"model={self.model!r}")
        if self.name == "self_draft" and (self.layers is None or self.model is not None):
            raise ValueError(f"small drafter self_draft needs layers (an int) and no model, got layers={self.layers!r}, "
                             f"model={self.model!r}")
        if self.name == "model" and not self.model:
            raise ValueError(f"small drafter model needs model=<source> (embedded:<name>, a folder or a hub id), "
                             f"got {self.model!r}")

    @property
    def neural(self) -> bool:
        return self.name != "ngram"

    def as_dict(self) -> dict:
        return asdict(self)


def small_config(small: "SmallDrafterConfig | dict | None") -> SmallDrafterConfig:
    """A :class:`SmallDrafterConfig` from a settings dict (``small_settings`` / the Hydra ``small`` node),
    a config, or None (the n-gram drafter); an unknown key is an error naming it."""
    if small is None:
        return SmallDrafterConfig()
    if isinstance(small, SmallDrafterConfig):
        return small
    if not hasattr(small, "keys"):
        raise ValueError(f"small drafter settings must be a dict or SmallDrafterConfig, got {type(small).__name__}")
    settings = {str(k): small[k] for k in small.keys()}
    known = set(SmallDrafterConfig.__dataclass_fields__)
    unknown = sorted(set(settings) - known)
    if unknown:
        raise ValueError(f"unknown small drafter setting {', '.join(map(repr, unknown))}; expected one of "
                         f"{', '.join(sorted(known))}")
    return SmallDrafterConfig(**settings)


def _decoder_layers(model: nn.Module) -> int:
    return len(model.base_model.layers)


# the last model a `model` small drafter loaded, by (source, runtime or dtype, device): a decoder is built
# per method and prompt set, and one small model is loaded once, not once per decoder
_LOADED: dict[tuple, nn.Module] = {}


def neural_small_model(cfg: SmallDrafterConfig, middle: nn.Module | None, tokenizer=None, runtime: str | None = None,
                       models_dir=None) -> nn.Module:
    """The causal LM a neural small drafter runs.

    ``self_draft``: :func:`~treegraft.models.make_self_draft` of ``middle`` (shares its parameters; layers
    must be within the middle's). ``model``: ``cfg.model`` loaded on the middle drafter's input device, in
    ``runtime`` (the middle drafter's, e.g. ``int8``) or else the middle's dtype, checked against
    ``tokenizer`` (same vocabulary) and the middle's output size; with ``layers`` its first layers only.
    """
    from ..devices import input_device
    from ..models import TokenizerMismatchError, load_model, load_tokenizer, make_self_draft

    if not cfg.neural:
        raise ValueError("the n-gram small drafter runs no model")
    if cfg.name == "self_draft":
        if not isinstance(middle, nn.Module):
            raise ValueError("small drafter self_draft runs the middle drafter's first layers: it needs the middle "
                             "drafter as a PyTorch model (engine=torch), got none")
        total = _decoder_layers(middle)
        if int(cfg.layers) > total:
            raise ValueError(f"small drafter self_draft layers must be in 1..{total} (the middle drafter's decoder "
                             f"layers), got {cfg.layers}")
        return make_self_draft(middle, int(cfg.layers))
    device = input_device(middle) if isinstance(middle, nn.Module) else torch.device("cpu")
    dtype = next(middle.parameters()).dtype if isinstance(middle, nn.Module) else torch.float32
    if tokenizer is not None:
        theirs, ours = load_tokenizer(cfg.model, models_dir).get_vocab(), tokenizer.get_vocab()
        if theirs != ours:
            moved = sum(1 for t in set(ours) & set(theirs) if ours[t] != theirs[t])
            raise TokenizerMismatchError(
                f"small drafter model {cfg.model!r} has another tokenizer than the target's ({len(theirs)} vs "
                f"{len(ours)} tokens, {moved} shared tokens with other ids); the small drafter must share the "
                "target's tokenizer")
    key = (cfg.model, runtime or str(dtype), str(device))
    model = _LOADED.get(key)
    if model is None:
        _LOADED.clear()  # one small model held at a time
        model = load_model(cfg.model, dtype, device, models_dir, runtime)
        _LOADED[key] = model
    if isinstance(middle, nn.Module):
        head, small_head = middle.get_output_embeddings(), model.get_output_embeddings()
        want, got = (int(getattr(h, "out_features", None) or h.weight.shape[0]) for h in (head, small_head))
        if want != got:
            raise ValueError(f"small drafter model {cfg.model!r} has {got} output logits, the middle drafter {want}: "
                             "the small drafter must share the target's tokenizer")
    if cfg.layers is not None:
        total = _decoder_layers(model)
        if int(cfg.layers) > total:
            raise ValueError(f"small drafter layers must be in 1..{total} (the decoder layers of {cfg.model}), "
                             f"got {cfg.layers}")
        if int(cfg.layers) < total:
            model = make_self_draft(model, int(cfg.layers))
    return model
