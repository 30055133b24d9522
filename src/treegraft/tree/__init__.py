"""Draft trees: the data structure, pruning to a budget, and verification inputs."""

from .buffers import TreeInputs, build_tree_inputs, prune_order, prune_to_budget
from .draft_tree import COPY_CHAIN, CREATOR_NAMES, MIDDLE, ROOT, SMALL, DraftTree

__all__ = ["COPY_CHAIN", "CREATOR_NAMES", "DraftTree", "MIDDLE", "ROOT", "SMALL", "TreeInputs", "build_tree_inputs",
           "prune_order", "prune_to_budget"]
