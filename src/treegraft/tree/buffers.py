"""Pruning a draft tree to the verification budget and turning it into model inputs.

Both functions are pure: a tree in, plain data out (Medusa/EAGLE "tree buffers").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .draft_tree import DraftTree

__all__ = ["prune_order", "prune_to_budget", "TreeInputs", "build_tree_inputs"]


def _ranked_candidates(tree: DraftTree) -> list[int]:
    """Alive non-root nodes by ``cum`` (higher first; ties: shallower first, then earlier created)."""
    candidates = [n for n in range(1, len(tree)) if tree.alive[n]]
    candidates.sort(key=lambda n: (-tree.cum[n], tree.depth[n], n))
    return candidates


def _unkept_chain(tree: DraftTree, node: int, kept: set[int]) -> list[int]:
    """``node`` and its ancestors up to the first kept one (or the root), deepest first."""
    chain = []
    while node > 0 and node not in kept:
        chain.append(node)
        node = tree.parent[node]
    return chain


def prune_order(tree: DraftTree) -> list[int]:
    """Every alive non-root node in the order pruning keeps them under an unbounded budget: each
    candidate (by ``cum``) brings its not-yet-kept ancestors first. ``order[:B]`` is what a budget of B
    keeps, except where a chain does not fit at the boundary (:func:`prune_to_budget` then skips it)."""
    kept: set[int] = set()
    order: list[int] = []
    for node in _ranked_candidates(tree):
        if node in kept:
            continue
        chain = _unkept_chain(tree, node, kept)[::-1]
        kept.update(chain)
        order.extend(chain)
    return order


def prune_to_budget(tree: DraftTree, budget: int) -> list[int]:
    """The non-root nodes to verify: at most ``budget`` of them, ancestor-closed, in id order.

    Nodes are ranked by ``cum`` (higher first; ties: shallower first, then earlier created) and
    taken greedily together with whatever part of their ancestor chain is not yet kept; a node whose
    chain does not fit in the remaining budget is skipped. Every kept node's parent is the root or
    kept, so the result is ancestor-closed by construction. Id order is a topological order, since
    a parent is always created before its children.
    """
    if budget < 0:
        raise ValueError(f"budget must be >= 0, got {budget}")
    kept: set[int] = set()
    for node in _ranked_candidates(tree):
        if len(kept) >= budget:
            break
        if node in kept:
            continue
        chain = _unkept_chain(tree, node, kept)
        if len(kept) + len(chain) <= budget:
            kept.update(chain)
    return sorted(kept)


@dataclass
class TreeInputs:
    """A kept tree as model inputs; row 0 is the root, rows 1.. are the kept nodes in id order.

    Host data only (an engine moves the tensors to its device); the decoder reads the lists, never the
    tensors. Shapes (n = number of kept nodes):
      node_ids        list[int], n + 1: tree node id of each row
      token_ids       list[int], n + 1: token of each row
      positions       list[int], n + 1: context_len + depth of each row
      tokens          LongTensor [n + 1]
      position_ids    LongTensor [n + 1]: context_len + depth
      ancestor_mask   BoolTensor [n + 1, n + 1]: [i, j] is True iff row j is row i or one of its ancestors
      parent_row      list[int], n + 1: row of the parent (-1 for the root)
      child_rows      list[dict[int, int]], n + 1: token -> row of each kept child
      retrieve_paths  LongTensor [num_leaves, max_depth + 1]: rows from the root to each leaf, padded with -1
    """

    node_ids: list[int]
    token_ids: list[int]
    positions: list[int]
    tokens: torch.Tensor
    position_ids: torch.Tensor
    ancestor_mask: torch.Tensor
    parent_row: list[int]
    child_rows: list[dict[int, int]]
    retrieve_paths: torch.Tensor

    @property
    def size(self) -> int:
        return len(self.node_ids)


def build_tree_inputs(tree: DraftTree, kept: list[int], context_len: int) -> TreeInputs:
    """Verification inputs for the root plus ``kept`` (ancestor-closed, in id order)."""
    node_ids = [0] + list(kept)
    row_of = {node: row for row, node in enumerate(node_ids)}
    n = len(node_ids)
    parent_row = [-1] * n
    child_rows: list[dict[int, int]] = [{} for _ in range(n)]
    mask = torch.zeros(n, n, dtype=torch.bool, device="cpu")  # host data: an engine moves it
    mask[0, 0] = True
    for row in range(1, n):
        node = node_ids[row]
        prow = row_of.get(tree.parent[node])
        if prow is None:
            raise ValueError(f"kept set is not ancestor-closed: parent of node {node} is missing")
        if prow >= row:
            raise ValueError("kept nodes must be in topological (id) order")
        parent_row[row] = prow
        child_rows[prow][tree.token[node]] = row
        mask[row] = mask[prow]
        mask[row, row] = True
    depths = [tree.depth[node] for node in node_ids]
    token_ids = [tree.token[node] for node in node_ids]
    positions = [context_len + d for d in depths]
    leaves = [row for row in range(n) if not child_rows[row]]
    max_depth = max(depths)
    paths = torch.full((len(leaves), max_depth + 1), -1, dtype=torch.long, device="cpu")
    for i, leaf in enumerate(leaves):
        chain = []
        r = leaf
        while r >= 0:
            chain.append(r)
            r = parent_row[r]
        chain.reverse()
        paths[i, : len(chain)] = torch.tensor(chain, device="cpu")
    return TreeInputs(
        node_ids=node_ids,
        token_ids=token_ids,
        positions=positions,
        tokens=torch.tensor(token_ids, dtype=torch.long, device="cpu"),
        position_ids=torch.tensor(positions, dtype=torch.long, device="cpu"),
        ancestor_mask=mask,
        parent_row=parent_row,
        child_rows=child_rows,
        retrieve_paths=paths,
    )
