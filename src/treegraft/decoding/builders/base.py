"""What every tree builder shares: the turn's plan, the construction state and the small drafter's step
(the n-gram drafter's lookups, or a neural small drafter's top-m)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from ...devices import Clock
from ...drafters.ngram import NGramDrafter
from ...engines.logprobs import argmax_scores, topk
from ...tree import COPY_CHAIN, MIDDLE, SMALL, DraftTree
from ..tree_config import TreeConfig
from ..turn_stats import TurnStats

__all__ = ["TurnPlan", "BuildState", "TreeBuilder"]


@dataclass(frozen=True)
class TurnPlan:
    """What a turn's construction plans for, decided once before its first step.

    budget: the planning B_ver (the configured one, or ``budget=auto``'s running estimate).
    width / top_m: W nodes expanded per step, m children each. scope: how many nodes (in pruning order)
    a shared middle step rescores, None = the whole tree. horizon: a step whose every new node would sit
    at or deeper than this is left out (``skip_beyond_budget``), None = never.
    """

    budget: int
    width: int
    top_m: int
    scope: int | None
    horizon: int | None


@dataclass
class BuildState:
    """Per-turn construction state next to the tree (copy both to branch a construction)."""

    plan: TurnPlan
    done: list[int] = field(default_factory=list)  # actions taken so far
    calls: int = 0  # middle-drafter calls so far
    rescored_from: int = 1  # nodes with id >= this were added since the last middle rescoring

    def copy(self) -> "BuildState":
        return BuildState(self.plan, list(self.done), self.calls, self.rescored_from)


class TreeBuilder:
    """Builds one turn's draft tree step by step; subclasses say what a middle-drafter step does.

    ``start`` gives the root-only tree and its state, ``apply_step`` runs step ``t`` with an action
    (0 = n-gram drafter, 1 = middle drafter) in place, ``build`` runs all D steps with the actions a
    ``decide(tree, state, step)`` callback returns. The small step is the same everywhere: the top W of
    the nodes the previous step created, each given up to m children by the small drafter (the n-gram
    drafter, which also puts a copy chain under the root, or a neural small drafter).
    """

    def __init__(self, cfg: TreeConfig, ngram: NGramDrafter, middle=None, clock: Clock | None = None, small=None,
                 small_top_m: int | None = None):
        """``clock``: the decoder's (:class:`~treegraft.devices.Clock`: it waits for the models' devices).
        ``small``: a neural small drafter (a :class:`~treegraft.engines.protocols.DraftModel`, e.g. a
        :class:`~treegraft.engines.torch.MiddleDrafter` over a self-draft) that proposes the small steps'
        children instead of the n-gram drafter; ``small_top_m``: its children per node (None: the turn's m)."""
        self.cfg = cfg
        self.preset = cfg.preset
        self.ngram = ngram
        self.middle = middle
        self.small = small
        self.small_top_m = small_top_m
        self.clock = clock or Clock()
        self.small_kinds: dict[int, tuple] = {}  # this turn's n-gram nodes -> their kind (the drafter learns rates)

    @property
    def reads_ngram_scores(self) -> bool:
        """Whether this construction reads the n-gram drafter's cached target scores (so the decoder must cache the
        target's top-m at every verified position): the n-gram drafter's tree steps do, chain mode's chain does not."""
        return self.small is None and self.ngram.reads_scores

    def start(self, root_token: int, plan: TurnPlan) -> tuple[DraftTree, BuildState]:
        """A turn's root-only tree and its construction state (the middle drafter starts a new turn)."""
        if self.middle is not None:
            self.middle.start_turn()
        if self.small is not None:
            self.small.start_turn()
        self.small_kinds = {}
        return DraftTree.with_root(root_token), BuildState(plan)

    def build(self, root_token: int, plan: TurnPlan, decide: Callable[[DraftTree, BuildState, int], int],
              stats: TurnStats) -> DraftTree:
        tree, build = self.start(root_token, plan)
        for step in range(1, self.cfg.depth + 1):
            if len(tree) >= self.cfg.node_cap:
                break
            self.apply_step(tree, build, step, int(decide(tree, build, step)), stats)
        stats.schedule = list(build.done)
        return tree

    def apply_step(self, tree: DraftTree, build: BuildState, step: int, action: int, stats: TurnStats) -> None:
        if len(tree) >= self.cfg.node_cap:
            build.done.append(SMALL)
            return
        if action == MIDDLE and self.middle is None:
            raise ValueError("the scheduler chose a middle-drafter call, but there is no middle drafter")
        if action == MIDDLE and self.cfg.max_calls_per_turn is not None and build.calls >= self.cfg.max_calls_per_turn:
            action = SMALL
        build.done.append(action)
        if action == MIDDLE:
            self.middle_step(tree, build, step, stats)
            return
        selected = self.expandable(tree, build, step, stats)
        if selected:
            self.expand_small(tree, selected, step, build.plan, stats)

    def middle_step(self, tree: DraftTree, build: BuildState, step: int, stats: TurnStats) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------------ shared pieces
    @staticmethod
    def newest_pool(tree: DraftTree, step: int) -> list[int]:
        """The nodes created at the previous step (the root at step 1); empty if that step added none,
        in which case the step adds nothing (a later shared middle step can still graft anywhere)."""
        return [0] if step == 1 else tree.nodes_created_at(step - 1)

    @staticmethod
    def top_w(tree: DraftTree, pool: list[int], width: int) -> list[int]:
        """The W best pool nodes by cum (ties: shallower, then earlier created)."""
        return sorted(pool, key=lambda n: (-tree.cum[n], tree.depth[n], n))[:width]

    def expandable(self, tree: DraftTree, build: BuildState, step: int, stats: TurnStats) -> list[int]:
        """The nodes a newest-pool step expands: the top W of the previous step's nodes, or none when
        every child would sit deeper than the horizon (the step is then counted as skipped)."""
        pool = self.newest_pool(tree, step)
        if not pool:
            return []
        selected = self.top_w(tree, pool, build.plan.width)
        horizon = build.plan.horizon
        if horizon is not None and all(tree.depth[n] >= horizon for n in selected):
            stats.skipped_steps += 1
            return []
        return selected

    def expand_small(self, tree: DraftTree, nodes: list[int], step: int, plan: TurnPlan, stats: TurnStats) -> None:
        """The small drafter's children (up to m each) under ``nodes``, timed into ``stats.small_s``."""
        if self.small is not None:
            self.expand_small_neural(tree, nodes, step, plan, stats)
            return
        start = self.clock.now()
        cap = self.cfg.node_cap
        kinds = self.small_kinds
        if self.cfg.ngram.mode == "chain":
            # one chain a turn, under the best node of the first small step that finds one (read off the tree,
            # which a branched construction copies): a later small step would only re-draft the same chain. A chain
            # that destructive grafting deleted is drafted again under the newest nodes
            if not any(c == SMALL and alive for c, alive in zip(tree.creator, tree.alive)):
                parent = nodes[0]
                for token, score, kind in self.ngram.chain_kinds(tree.path_tokens(parent)):
                    if len(tree) >= cap:
                        break
                    parent = tree.add_child(parent, token, score, SMALL, step)
                    kinds.setdefault(parent, kind)
                stats.small_calls += 1
            nodes = []
        elif nodes == [0] and self.cfg.ngram.copy_len:  # a copy chain under the root, before its other children
            parent = 0
            for token, score, kind in self.ngram.copy_chain_kinds([]):
                if len(tree) >= cap:
                    break
                parent = tree.add_child(parent, token, score, COPY_CHAIN, step)
                kinds.setdefault(parent, kind)
        for node in nodes:
            children, _ = self.ngram.propose_kinds(tree.path_tokens(node), plan.top_m)
            for token, score, kind in children:
                if len(tree) >= cap:
                    break
                kinds.setdefault(tree.add_child(node, token, score, SMALL, step), kind)
        elapsed = self.clock.now() - start
        stats.small_s += elapsed
        stats.small_propose_s += elapsed
        stats.small_calls += len(nodes)

    def expand_small_neural(self, tree: DraftTree, nodes: list[int], step: int, plan: TurnPlan,
                            stats: TurnStats) -> None:
        """A neural small drafter's step: one incremental forward over ``nodes`` (and whatever ancestors it
        has not encoded), then its top-m tokens under each node, scored by its own log-probabilities."""
        start = self.clock.now()
        small = self.small
        before = small.forward_s
        small.encode(tree, nodes)
        m, cap = self.small_top_m or plan.top_m, self.cfg.node_cap
        proposals = topk([small.logprobs[node] for node in nodes], m)  # one host read
        for node, (lp, ids) in zip(nodes, proposals):
            for token, score in zip(ids, lp):
                if len(tree) >= cap:
                    break
                tree.add_child(node, token, score, SMALL, step)
        elapsed = self.clock.now() - start
        stats.small_s += elapsed
        stats.small_propose_s += elapsed
        stats.small_forward_s += small.forward_s - before
        stats.small_calls += len(nodes)

    def small_chain(self, tree: DraftTree, end: int, length: int, stats: TurnStats) -> list[int]:
        """Up to ``length`` nodes of the small drafter's greedy chain below ``end``, added to the tree (the
        cascade's proposal), timed into ``stats.small_s``."""
        start = self.clock.now()
        chain, parent = [], end
        if self.small is None:
            path = tree.path_tokens(end)
            proposal: list[tuple[int, float]] = []
            for _ in range(length):
                children, _ = self.ngram.propose(path + [t for t, _ in proposal], 1)
                if not children:
                    break
                proposal.append(children[0])
            for token, score in proposal:
                parent = tree.add_child(parent, token, score, SMALL, tree.depth[parent] + 1)
                chain.append(parent)
        else:
            before = self.small.forward_s
            for _ in range(length):  # one forward per token: a neural chain is sequential
                self.small.encode(tree, [parent])
                token, score = argmax_scores([self.small.logprobs[parent]])[0]
                parent = tree.add_child(parent, token, score, SMALL, tree.depth[parent] + 1)
                chain.append(parent)
            stats.small_forward_s += self.small.forward_s - before
        stats.small_s += self.clock.now() - start
        stats.small_calls += len(chain)
        return chain

    def ngram_outcomes(self, tree: DraftTree, kept: set[int], path_nodes: list[int], emitted: list[int],
                       greedy: bool) -> list[tuple[tuple, bool]]:
        """(kind, accepted) of every n-gram child whose parent was accepted (the root included) and whose
        own outcome is known: verified, or (greedy) within the emitted tokens."""
        on_path = set(path_nodes)
        accepted = set(path_nodes[1:])
        out = []
        for node, kind in self.small_kinds.items():
            if tree.parent[node] not in on_path or not tree.alive[node]:
                continue
            if node in kept:
                out.append((kind, node in accepted))
            elif greedy and tree.depth[node] <= len(emitted):
                out.append((kind, tree.token[node] == emitted[tree.depth[node] - 1]))
        return out

    def encode_middle(self, tree: DraftTree, nodes: list[int], stats: TurnStats,
                      need_logprobs: list[int] | None = None) -> None:
        """The middle drafter encodes ``nodes``; its forward time goes to ``stats``."""
        before = self.middle.forward_s
        self.middle.encode(tree, nodes, need_logprobs=need_logprobs)
        stats.middle_forward_s += self.middle.forward_s - before
