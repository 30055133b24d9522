"""Decoders: the target-only baseline (`ar`) and, built on the same pieces, the speculative methods."""

from ..model_io import eos_token_ids
from .autoregressive import AutoregressiveDecoder, GenerationResult, PromptError, validate_prompt
from .sampling import SamplingConfig, sample_from_logits, target_distribution
from .tree_decoder import METHOD_PRESETS, SmallDrafterConfig, TreeConfig, TreeGraftDecoder

__all__ = [
    "AutoregressiveDecoder",
    "GenerationResult",
    "PromptError",
    "METHOD_PRESETS",
    "SamplingConfig",
    "SmallDrafterConfig",
    "TreeConfig",
    "TreeGraftDecoder",
    "eos_token_ids",
    "sample_from_logits",
    "target_distribution",
    "validate_prompt",
]
