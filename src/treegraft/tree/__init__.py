"""Draft trees: the data structure, pruning to a budget, and verification inputs."""

from .buffers import TreeInputs, build_tree_inputs, prune_order, prune_to_budget
from .draft_tree import MIDDLE, ROOT, SMALL, DraftTree

__all__ = ["DraftTree", "MIDDLE", "ROOT", "SMALL", "TreeInputs", "build_tree_inputs", "prune_order", "prune_to_budget"]
