"""Tree signals: cheap numeric summaries of the draft tree before a step's action (SPEC 5.1).

Every signal is a pure function of the tree, the step's frontier and (for two of them) the
n-gram drafter's proposal at the best frontier node. ``tree_signals`` returns them all as a named
vector; non-finite values become 0. The first six are the reference implementation's selection.

frontier: the nodes the next small step would expand from (created at the previous step; the root
at step 1). picks: the top-W alive unvisited nodes by current ``cum``, i.e. what a middle step with
expanded selection would select under the current scores ("reselection preview").
"""

from __future__ import annotations

import math

from ..tree import DraftTree

__all__ = ["SIGNAL_NAMES", "REFERENCE_SIGNALS", "tree_signals", "frontier_of", "preview_picks"]

REFERENCE_SIGNALS = (
    "depth_before",
    "leaf_ratio_before",
    "collapse_debt",
    "pre_reselect_past_ratio",
    "pre_reselect_overlap",
    "pre_reselect_score",
)
SIGNAL_NAMES = REFERENCE_SIGNALS + (
    "node_count",
    "frontier_cum_mean",
    "frontier_cum_max",
    "unvisited_count",
    "ngram_match_len",
    "small_top1_prob",
)


def frontier_of(tree: DraftTree, step: int) -> list[int]:
    """Nodes created at step ``step - 1`` (the root at step 1)."""
    return [0] if step == 1 else tree.nodes_created_at(step - 1)


def preview_picks(tree: DraftTree, width: int) -> list[int]:
    """The top-``width`` alive unvisited nodes by ``cum`` (ties: shallower, then earlier)."""
    pool = [n for n in range(len(tree)) if tree.alive[n] and not tree.visited[n]]
    pool.sort(key=lambda n: (-tree.cum[n], tree.depth[n], n))
    return pool[:width]


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else 0.0


def _finite(x: float) -> float:
    return x if math.isfinite(x) else 0.0


def tree_signals(
    tree: DraftTree, step: int, width: int, ngram_match_len: int = 0, small_top1_logprob: float | None = None
) -> dict[str, float]:
    """All candidate signals as ``{name: value}`` in ``SIGNAL_NAMES`` order.

    ``ngram_match_len`` / ``small_top1_logprob``: the n-gram drafter's longest matched order and
    best score at the best frontier node (the caller has the drafter; 0 / None when unknown).
    """
    frontier = frontier_of(tree, step)
    picks = preview_picks(tree, width)
    frontier_depth = _mean(tree.depth[n] for n in frontier)
    frontier_depths = {tree.depth[n] for n in frontier}
    frontier_set = set(frontier)
    pick_depth = _mean(tree.depth[n] for n in picks)
    finite_pick_cums = [tree.cum[n] for n in picks if math.isfinite(tree.cum[n])]
    frontier_cums = [tree.cum[n] for n in frontier]
    values = {
        "depth_before": frontier_depth,
        "leaf_ratio_before": _mean(1.0 if not tree.children[n] else 0.0 for n in frontier),
        "collapse_debt": max(0.0, -(pick_depth - frontier_depth)) if picks else 0.0,
        "pre_reselect_past_ratio": _mean(1.0 if tree.depth[n] not in frontier_depths else 0.0 for n in picks),
        "pre_reselect_overlap": _mean(1.0 if n in frontier_set else 0.0 for n in picks),
        "pre_reselect_score": _mean(finite_pick_cums),
        "node_count": float(tree.num_alive),
        "frontier_cum_mean": _mean(frontier_cums),
        "frontier_cum_max": max(frontier_cums) if frontier_cums else 0.0,
        "unvisited_count": float(sum(1 for n in range(len(tree)) if tree.alive[n] and not tree.visited[n])),
        "ngram_match_len": float(ngram_match_len),
        "small_top1_prob": math.exp(small_top1_logprob) if small_top1_logprob is not None else 0.0,
    }
    return {name: _finite(float(values[name])) for name in SIGNAL_NAMES}
