"""A Cascade-Speculative-Drafting-style chain: the middle drafter drafts D tokens, itself sped up by the
small drafter's proposals (the n-gram drafter's, or a neural small drafter's greedy chain), and the
target verifies the chain."""

from __future__ import annotations

from typing import Callable

from ...engines.logprobs import argmax_scores
from ...tree import MIDDLE, DraftTree
from ..turn_stats import TurnStats
from .base import BuildState, TreeBuilder, TurnPlan

__all__ = ["CascadeChainBuilder"]


class CascadeChainBuilder(TreeBuilder):
    """Each round the small drafter proposes a greedy chain below the current end; one middle forward
    scores it; the middle drafter keeps the longest prefix equal to its own argmax choices and adds its
    argmax after it (a lossless greedy cascade at the drafting level). No schedule: every step is the
    middle drafter's."""

    @property
    def reads_ngram_scores(self) -> bool:
        """The cascade's n-gram proposals (:meth:`small_chain`) rank by the cached target scores in either mode."""
        return self.small is None

    def build(self, root_token: int, plan: TurnPlan, decide: Callable[[DraftTree, BuildState, int], int],
              stats: TurnStats) -> DraftTree:
        tree, _ = self.start(root_token, plan)
        mid = self.middle
        depth = self.cfg.depth
        if plan.horizon is not None:
            depth = min(depth, plan.horizon)  # chain tokens past B_ver would be pruned anyway
        end = 0
        clock = self.clock
        while tree.depth[end] < depth:
            chain = self.small_chain(tree, end, depth - tree.depth[end] - 1, stats)
            t1 = clock.now()
            self.encode_middle(tree, [end] + chain, stats)
            stats.middle_calls += 1
            # the middle drafter's choice (and its log-probability) after each node of [end] + chain, one host read
            best = argmax_scores([mid.logprobs[n] for n in [end] + chain])
            cur, k = end, 0
            for node in chain:
                token, logp = best[k]
                if token != tree.token[node]:
                    break
                tree.edge[node] = logp  # the chain token is the argmax: its score is the row's maximum
                tree.cum[node] = tree.cum[cur] + logp
                cur, k = node, k + 1
            tree.remove_subtrees_below(cur)  # the middle drafter's rejection of the rest
            token, logp = best[k]
            end = tree.add_child(cur, token, logp, MIDDLE, tree.depth[cur] + 1)
            stats.middle_s += clock.now() - t1
        stats.schedule = [MIDDLE] * depth
        return tree

    def apply_step(self, tree, build, step, action, stats) -> None:
        raise ValueError("a cascade chain has no schedule to enumerate: it is built whole (CascadeChainBuilder.build)")
