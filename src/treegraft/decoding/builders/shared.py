"""Shared-tree construction (TreeGraft): both drafters work on one tree, the schedule says who does each step.

A small step is the single-drafter one (newest pool, stored scores). A middle step, in one incremental
forward of the middle drafter over every node of its scope it has not encoded yet:

* asymmetric scoring: recomputes every node's ``edge`` and ``cum`` under q_m (top-down);
* expanded grafting-position selection: picks the top W by the new scores among *all* unvisited nodes
  of the scope, at any depth, root included (ablation: the newest nodes only);
* non-destructive grafting: a selected node's q_m top-m tokens become children; a token already there
  keeps its node and subtree and takes the middle drafter's score (ablation: destructive grafting
  first deletes the selected node's subtrees). Every graft under a node that already had children records
  which branches it kept (:meth:`~treegraft.tree.DraftTree.note_graft`), for the grafting traces, and so
  does a graft under a node of such a subtree later in the same step (destructive grafting has deleted
  it and skips it: :meth:`~treegraft.tree.DraftTree.note_graft_below`).
"""

from __future__ import annotations

from ...engines.logprobs import scores, topk
from ...tree import MIDDLE, DraftTree, prune_order
from ..turn_stats import TurnStats
from .base import BuildState, TreeBuilder

__all__ = ["SharedTreeBuilder", "ONE_HEAD_BATCH"]

# a shared middle step computes the head rows of its rescoring parents and selection pool in one batch
# when there are at most this many (else the pool's rows wait for the selection)
ONE_HEAD_BATCH = 8


class SharedTreeBuilder(TreeBuilder):
    def rescore_scope(self, tree: DraftTree, build: BuildState) -> list[int]:
        """The nodes a middle step encodes, rescores and may graft under (alive, in id order): the whole
        tree, or with ``shape=auto`` the root plus the first ``scope`` nodes in pruning order."""
        scope = build.plan.scope
        if scope is None:
            return tree.alive_nodes()
        return sorted([0] + prune_order(tree)[:scope])

    def middle_pool(self, tree: DraftTree, step: int, scope: list[int]) -> list[int]:
        """Where a middle step may graft: unvisited nodes of the scope at any depth (expanded selection),
        or the previous step's unvisited nodes (the ablation)."""
        if self.preset.expanded_selection:
            return [n for n in scope if not tree.visited[n]]
        in_scope = set(scope)
        return [n for n in self.newest_pool(tree, step) if not tree.visited[n] and n in in_scope]

    def graft_is_beyond(self, tree: DraftTree, build: BuildState, step: int) -> bool:
        """True when a middle step cannot change the tree pruned to the horizon: every node it could
        select has depth >= horizon (its children would be deeper), and every node whose score it would
        newly rescore (added since the last rescoring) has depth > horizon."""
        horizon = build.plan.horizon
        depth, alive = tree.depth, tree.alive
        if any(alive[n] and depth[n] <= horizon for n in range(build.rescored_from, len(tree))):
            return False
        return all(depth[n] >= horizon for n in self.middle_pool(tree, step, self.rescore_scope(tree, build)))

    def middle_step(self, tree: DraftTree, build: BuildState, step: int, stats: TurnStats) -> None:
        if build.plan.horizon is not None and self.graft_is_beyond(tree, build, step):
            stats.skipped_steps += 1
            return
        self.graft(tree, build, step, stats)

    def graft(self, tree: DraftTree, build: BuildState, step: int, stats: TurnStats) -> None:
        """The middle step itself: rescore the scope under q_m, select anywhere, graft."""
        start = self.clock.now()
        mid = self.middle
        scope = self.rescore_scope(tree, build)
        in_scope = set(scope)
        parents = [n for n in scope if any(c in in_scope for c in tree.children[n].values())]
        # one incremental forward over every scope node not yet encoded; q_m at every scope parent, and
        # where the selection pool is small, at every pool node too: one LM-head batch instead of two
        # (a lone head row streams the whole head; a few more rows in the batch cost little)
        pool = self.middle_pool(tree, step, scope)
        need = sorted(set(parents) | set(pool))
        self.encode_middle(tree, scope, stats, need_logprobs=need if len(need) <= ONE_HEAD_BATCH else parents)
        # asymmetric scoring: the middle drafter recomputes every edge and cum in scope (one host read)
        edges = scores([(mid.logprobs[tree.parent[n]], tree.token[n]) for n in scope[1:]])
        for n, edge in zip(scope[1:], edges):
            tree.edge[n] = edge
        tree.recompute_cum(0)
        selected = self.top_w(tree, pool, build.plan.width)  # rescoring changes scores, not who is in the pool
        self.encode_middle(tree, selected, stats)  # already encoded: this only adds their log-probability rows
        m, cap = build.plan.top_m, self.cfg.node_cap
        proposals = topk([mid.logprobs[node] for node in selected], m)  # one host read
        destructive = self.preset.grafting == "destructive"
        grafted: dict[int, int] = {}  # provenance: this step's grafts so far (node -> order)
        for node, (lp, ids) in zip(selected, proposals):
            if not tree.alive[node]:  # removed by a destructive graft above it in this same step
                continue
            tree.visited[node] = True
            if destructive:
                tree.remove_subtrees_below(node)
            existing = dict(tree.children[node]) if tree.children[node] else None  # the historical branches
            added = []
            for token, score in zip(ids, lp):
                child = tree.children[node].get(token)
                if child is not None:  # non-destructive: the branch stays, with the middle's score
                    tree.edge[child] = score
                    continue
                if len(tree) >= cap:
                    break
                added.append(tree.add_child(node, token, score, MIDDLE, step))
            if destructive:
                continue
            # provenance: which branches only non-destructive grafting kept; a node below one grafted earlier
            # in this step is one destructive grafting deleted (and skips), so what it adds is kept too
            above = None if not grafted else min((a for a in tree.ancestors(node)[:-1] if a in grafted),
                                                 key=grafted.get, default=None)
            grafted[node] = len(grafted)
            if above is not None:
                tree.note_graft_below(above, step, node, added)
            elif existing:
                tree.note_graft(node, step, existing, ids)
        stats.middle_s += self.clock.now() - start
        stats.middle_calls += 1
        build.rescored_from = len(tree)
        build.calls += 1
