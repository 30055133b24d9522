"""Drafters: the small drafters (the n-gram lookup drafter, or a neural one) and the neural middle drafter."""

from .middle import MiddleDrafter
from .ngram import NGramConfig, NGramDrafter
from .small import SmallDrafterConfig

__all__ = ["MiddleDrafter", "NGramConfig", "NGramDrafter", "SmallDrafterConfig"]
