"""Drafters: the small drafters (the n-gram lookup drafter, or a neural one's settings) and the draft
vocabularies; the middle drafter's engines live in :mod:`treegraft.engines`."""

from .ngram import NGramConfig, NGramDrafter
from .small import SmallDrafterConfig

__all__ = ["NGramConfig", "NGramDrafter", "SmallDrafterConfig"]
