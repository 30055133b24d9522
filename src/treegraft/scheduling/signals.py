"""Tree signals: cheap numeric summaries of the draft tree before a step's action (part of the scheduler state).

Every tree signal is a pure function of the tree, the step's frontier and (for two of them) the
n-gram drafter's proposal at the best frontier node. ``tree_signals`` returns them all as a named
vector; non-finite values become 0. The first six are the reference implementation's selection.

Two more candidates (our addition, :data:`TURN_SIGNALS`) summarise the decoder's previous turns,
whatever drafter made them, so a policy can tell predictable stretches of text from hard ones
before it builds anything: ``recent_al``, a running mean of the accepted length, and
``recent_target_conf``, a running mean of the target's top-1 probability at the positions it
verified and accepted (at the prompt's last positions before the first turn). Neither depends on
which schedule the previous turns used beyond what they accepted. ``expected_al`` (also ours) is the
budget planner's expected accepted length of the tree as it stands, at the size it would verify now
(:meth:`~treegraft.decoding.budget.BudgetPlanner.expected_al`): how much the tree already promises,
whichever drafter built it, on the planner's calibrated scale.

frontier: the nodes the next small step would expand from (created at the previous step; the root
at step 1). picks: the top-W alive unvisited nodes by current ``cum``, i.e. what a middle step with
expanded selection would select under the current scores ("reselection preview").
"""

from __future__ import annotations

import math

from ..tree import MIDDLE, DraftTree

__all__ = ["SIGNAL_NAMES", "REFERENCE_SIGNALS", "TURN_SIGNALS", "PLANNER_SIGNALS", "tree_signals", "frontier_of", "preview_picks"]

REFERENCE_SIGNALS = (
    "depth_before",
    "leaf_ratio_before",
    "collapse_debt",
    "pre_reselect_past_ratio",
    "pre_reselect_overlap",
    "pre_reselect_score",
)
TURN_SIGNALS = ("recent_al", "recent_target_conf")
# computed by the decoder's budget planner on the tree as it stands (0 without ``budget=auto``)
PLANNER_SIGNALS = ("expected_al",)
SIGNAL_NAMES = REFERENCE_SIGNALS + (
    "node_count",
    "frontier_cum_mean",
    "frontier_cum_max",
    "unvisited_count",
    "ngram_match_len",
    "small_top1_prob",
    "max_depth",
    "mid_node_share",
) + TURN_SIGNALS + PLANNER_SIGNALS


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
    tree: DraftTree, step: int, width: int, ngram_match_len: int = 0, small_top1_logprob: float | None = None,
    turn_signals: dict[str, float] | None = None,
) -> dict[str, float]:
    """All candidate signals as ``{name: value}`` in ``SIGNAL_NAMES`` order.

    ``ngram_match_len`` / ``small_top1_logprob``: the n-gram drafter's longest matched order and
    best score at the best frontier node (the caller has the drafter; 0 / None when unknown).
    ``turn_signals``: the decoder's :data:`TURN_SIGNALS` and :data:`PLANNER_SIGNALS` (0 when not given).
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
        "max_depth": float(max((d for d, a in zip(tree.depth, tree.alive) if a), default=0)),
        "mid_node_share": _mean(1.0 if c == MIDDLE else 0.0 for c, a in zip(tree.creator[1:], tree.alive[1:]) if a),
        **{name: float((turn_signals or {}).get(name, 0.0)) for name in TURN_SIGNALS + PLANNER_SIGNALS},
    }
    return {name: _finite(float(values[name])) for name in SIGNAL_NAMES}
