"""Single-drafter construction (the All-Small and All-Mid endpoints).

Step 1 expands the root; step t > 1 the top W by path score of the nodes step t-1 created, each given
its drafter's top m tokens as children with ``cum = cum(parent) + log q(token)``.
"""

from __future__ import annotations

from ...engines.logprobs import topk
from ...tree import MIDDLE, DraftTree
from ..turn_stats import TurnStats
from .base import BuildState, TreeBuilder

__all__ = ["SingleDrafterBuilder"]


class SingleDrafterBuilder(TreeBuilder):
    """A middle step expands the newest nodes with the middle drafter, as the n-gram step does with its own."""

    def middle_step(self, tree: DraftTree, build: BuildState, step: int, stats: TurnStats) -> None:
        selected = self.expandable(tree, build, step, stats)
        if not selected:
            return
        start = self.clock.now()
        self.encode_middle(tree, selected, stats)
        m, cap = build.plan.top_m, self.cfg.node_cap
        proposals = topk([self.middle.logprobs[node] for node in selected], m)  # one host read
        for node, (lp, ids) in zip(selected, proposals):
            for token, score in zip(ids, lp):
                if len(tree) >= cap:
                    break
                tree.add_child(node, token, score, MIDDLE, step)
        stats.middle_s += self.clock.now() - start
        stats.middle_calls += 1
        build.calls += 1
