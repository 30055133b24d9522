"""Drafters: the n-gram lookup drafter (small) and the neural middle drafter."""

from .middle import MiddleDrafter
from .ngram import NGramConfig, NGramDrafter

__all__ = ["MiddleDrafter", "NGramConfig", "NGramDrafter"]
