"""One place that turns a method name into a decoder, for the CLI, the benchmarks and the stages."""

from __future__ import annotations

from dataclasses import fields

from ..models import LoadedPair
from .autoregressive import AutoregressiveDecoder, eos_token_ids
from .hf_peers import HFAssistedDecoder, HFPromptLookupDecoder
from .sampling import SamplingConfig
from .tree_decoder import METHOD_PRESETS, TreeConfig, TreeGraftDecoder

__all__ = ["METHODS", "build_decoder", "tree_config_from"]

METHODS = ("ar", *METHOD_PRESETS, "hf_assisted", "hf_prompt_lookup")


def tree_config_from(method: str, tree: dict | None) -> TreeConfig:
    """A :class:`TreeConfig` for ``method`` from a plain dict of tree settings (e.g. the Hydra `tree` group)."""
    known = {f.name for f in fields(TreeConfig)}
    settings = {k: v for k, v in (tree or {}).items() if k in known}
    return TreeConfig(method=method, **settings)


def build_decoder(method: str, pair: LoadedPair, tree: dict | None = None, sampling: SamplingConfig | None = None):
    """A decoder with ``.generate(prompt_ids, max_new_tokens) -> GenerationResult`` for ``method``."""
    sampling = sampling or SamplingConfig()
    eos = eos_token_ids(pair.target, pair.tokenizer)
    if method == "ar":
        return AutoregressiveDecoder(pair.target, eos, sampling)
    if method in METHOD_PRESETS:
        return TreeGraftDecoder(pair.target, pair.middle, pair.tokenizer, tree_config_from(method, tree), sampling, eos)
    if method == "hf_assisted":
        return HFAssistedDecoder(pair.target, pair.middle, eos, sampling)
    if method == "hf_prompt_lookup":
        return HFPromptLookupDecoder(pair.target, eos, sampling)
    raise ValueError(f"unknown method {method!r}; expected one of {', '.join(METHODS)}")
