"""The PyTorch engine: any Hugging Face causal LM pair, CPU or GPU (one device or split by accelerate).

:class:`TorchTarget` (``target.py``) and :class:`MiddleDrafter` (``drafter.py``) implement the engine
protocols over a stock transformers model and its ``DynamicCache``; :class:`TorchEngines` hands them out
for a loaded pair (:class:`~treegraft.engines.protocols.PairEngines`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from torch import nn

from ...drafters.small import SmallDrafterConfig, neural_small_model
from ...model_io import eos_token_ids, head_weight
from ..protocols import FrequentTokens
from .drafter import MiddleDrafter
from .target import TorchTarget, TorchTreeForward, cached_verify_curve

__all__ = ["TorchEngines", "TorchTarget", "TorchTreeForward", "MiddleDrafter", "cached_verify_curve"]


@dataclass
class TorchEngines:
    """A pair's models on the PyTorch engine: ``TorchEngines(target, middle, tokenizer)`` (``middle``
    None: methods that never call a middle drafter only) or :meth:`of` a loaded pair."""

    target_model: nn.Module
    middle_model: nn.Module | None = None
    tokenizer: object = None
    middle_runtime: str | None = None  # the runtime a neural small drafter's own model is loaded in
    record: dict | None = None  # what records say about the engine (engine=auto's choice included)
    name = "torch"

    @classmethod
    def of(cls, pair) -> "TorchEngines":
        """The engines of a :class:`~treegraft.models.LoadedPair`."""
        return cls(pair.target, pair.middle, pair.tokenizer, pair.middle_runtime, pair.engine)

    @property
    def has_middle(self) -> bool:
        return self.middle_model is not None

    def target(self, frequent: FrequentTokens) -> TorchTarget:
        return TorchTarget(self.target_model, frequent)

    def middle(self, frequent: FrequentTokens, draft_vocab: int | None) -> MiddleDrafter:
        """The middle drafter, its head restricted to the ``draft_vocab`` most frequent tokens (None: all)."""
        if self.middle_model is None:
            raise ValueError("this pair has no middle drafter model")
        return _drafter(self.middle_model, frequent, draft_vocab)

    def small(self, settings: SmallDrafterConfig, frequent: FrequentTokens, draft_vocab: int | None,
              model: nn.Module | None = None) -> MiddleDrafter:
        """A neural small drafter: ``model`` or the one ``settings`` name (a self-draft of the middle
        drafter, or a model loaded in the middle drafter's runtime), with the middle drafter's restricted
        vocabulary for the same LM-head saving."""
        if model is None:
            model = neural_small_model(settings, self.middle_model, self.tokenizer, runtime=self.middle_runtime)
        return _drafter(model, frequent, draft_vocab)

    def eos_ids(self) -> set[int]:
        return eos_token_ids(self.target_model, self.tokenizer)

    def verify_curve(self, cache_dir: str | Path | None, max_size: int = 64) -> dict[int, float]:
        return cached_verify_curve(self.target_model, cache_dir, max_size)

    def info(self) -> dict:
        return dict(self.record) if self.record else {"engine": "torch"}

    def workers(self, requested: int) -> int:
        """As many forked workers as asked (each runs its own copy-on-write view of the weights)."""
        return max(1, int(requested))


def _drafter(model: nn.Module, frequent: FrequentTokens, draft_vocab: int | None) -> MiddleDrafter:
    vocab = frequent(int(draft_vocab), head_weight(model).shape[0]) if draft_vocab else None
    return MiddleDrafter(model, vocab)
