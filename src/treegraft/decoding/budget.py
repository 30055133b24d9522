"""Choosing B_ver, the number of draft nodes verified per turn, by expected throughput.

On a GPU a 63-node verification costs about one decoding step, so the paper verifies 63 nodes; on a
CPU each extra row costs a share of a step. ``budget: auto`` therefore picks, for every turn's tree,

    B* = argmax_B  (1 + E[AL(B)]) / (t_draft + t_verify(B + 1))

(Sequoia's hardware-aware tree size, Chen et al. 2024, chosen per tree from the drafts' own scores
as EAGLE-2 ranks its tree by confidence):

* ``t_verify(n)`` is the target's measured verification curve (a forward over n tree rows on a real
  KV cache, the engine's ``verify_curve``), cached per machine, model and runtime,
  and rescaled online by the ratio of observed verification times to the curve (longer contexts,
  machine drift);
* ``t_draft`` is the median, over the last ``draft_window`` turns, of everything in a turn but the
  verification forward (a median: a one-off such as the middle drafter's prompt catch-up, 15 s for a
  612-token article on a Zen 1 EPYC, would hold a running mean up for dozens of turns, and a large
  ``t_draft`` makes every verified row look cheap);
* ``E[AL(B)] = sum_{k <= B} p(node_k)`` over the first B nodes in pruning order
  (:func:`~treegraft.tree.prune_order`): AL counts exactly the kept nodes on the target's path, so
  the expected AL of the top-B nodes is the sum of their acceptance probabilities. ``p`` is a
  calibration of the node's path score ``cum`` (bins, monotone), learned per decoder (per method)
  from every turn: verified nodes give their outcome; under greedy decoding an unverified node is
  known too when its depth is within the emitted tokens (accepted + bonus), and one extending the
  emitted path counts with the observed continuation rate. Before any data a bin's prior is
  ``exp(cum)`` (the score read as a probability).

Because B is chosen after the tree is built, a turn whose drafts look weak verifies little or nothing
and a turn with a confident copy chain verifies it whole. The construction itself (the tree shape,
which steps are worth running) uses a *planning* budget, the running mean of the chosen B.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

from ..models.runtime import curve_at
from ..tree import DraftTree, prune_order

__all__ = ["CUM_EDGES", "AcceptanceModel", "BudgetPlanner"]

# upper edges of the path-score bins (log-probabilities); the last bin takes everything below
CUM_EDGES = (0.0, -0.1, -0.25, -0.5, -0.75, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0, -9.0)


@dataclass
class AcceptanceModel:
    """P(a node is accepted | its path score), per bin of ``cum``: ``(hits + w * prior) / (seen + w)``,
    made non-increasing from the best bin down (a lower score is never more likely to be accepted)."""

    prior_weight: float = 2.0
    max_nodes: int = 256  # nodes per turn that teach (in pruning order): the rest could never be verified
    hits: list[float] = field(default_factory=lambda: [0.0] * (len(CUM_EDGES) + 1))
    seen: list[float] = field(default_factory=lambda: [0.0] * (len(CUM_EDGES) + 1))
    cont_hits: float = 1.0  # accepted children among verified nodes whose parent was accepted (+1 prior)
    cont_seen: float = 2.0

    @staticmethod
    def bin_of(cum: float) -> int:
        for i, edge in enumerate(CUM_EDGES[1:]):
            if cum > edge:
                return i
        return len(CUM_EDGES) - 1 if cum > -float("inf") else len(CUM_EDGES)

    def _priors(self) -> list[float]:
        mids = [(hi + lo) / 2 for hi, lo in zip(CUM_EDGES, CUM_EDGES[1:])] + [CUM_EDGES[-1] - 3.0, -float("inf")]
        return [math.exp(m) for m in mids]

    def table(self) -> list[float]:
        """The calibrated probability of every bin (best scores first)."""
        out, best = [], 1.0
        for hits, seen, prior in zip(self.hits, self.seen, self._priors()):
            weight = seen + self.prior_weight
            p = (hits + self.prior_weight * prior) / weight if weight > 0 else prior
            best = min(best, p)
            out.append(best)
        return out

    def p(self, cum: float) -> float:
        return self.table()[self.bin_of(cum)]

    @property
    def continuation_rate(self) -> float:
        """P(a node is accepted | its parent was accepted), from verified nodes."""
        return self.cont_hits / self.cont_seen

    def update(self, tree: DraftTree, order: list[int], kept: set[int], accepted: list[int], emitted: list[int],
               greedy: bool) -> None:
        """Learn from one turn. ``order``: the tree's pruning order; ``kept``: verified node ids;
        ``accepted``: accepted node ids (root excluded) in path order; ``emitted``: accepted tokens + bonus."""
        accepted_set = set(accepted)
        on_path = {0} | accepted_set
        for node in kept:
            if tree.parent[node] in on_path:
                self.cont_seen += 1
                self.cont_hits += node in accepted_set
        cont = self.continuation_rate
        known = len(emitted)
        for node in order[: self.max_nodes]:
            if node in kept:
                hit = float(node in accepted_set)
            elif not greedy:
                continue  # a sampled acceptance is not determined by the emitted tokens
            else:
                path = tree.path_tokens(node)
                prefix = path[:known]
                if prefix != emitted[: len(prefix)]:
                    hit = 0.0
                elif len(path) <= known:
                    hit = 1.0
                else:  # extends the emitted path: only the continuation rate says how likely
                    hit = cont ** (len(path) - known)
            b = self.bin_of(tree.cum[node])
            self.hits[b] += hit
            self.seen[b] += 1.0


@dataclass
class BudgetPlanner:
    """Picks B_ver for each turn's tree from the verification curve, the drafting cost and :class:`AcceptanceModel`."""

    curve: dict[int, float]
    max_budget: int = 63
    acceptance: AcceptanceModel = field(default_factory=AcceptanceModel)
    draft_s: float | None = None  # median of the recent turns' time outside the verification forward
    draft_window: int = 9  # turns the median covers
    recent_draft: list[float] = field(default_factory=list)
    verify_scale: float = 1.0  # running mean of observed / curve verification time
    planned: float = 8.0  # running mean of the chosen B (the planning budget of the next construction)
    decay: float = 0.9

    def verify_s(self, budget: int) -> float:
        return self.verify_scale * curve_at(self.curve, budget + 1)

    def expected_al(self, tree: DraftTree, order: list[int] | None = None) -> list[float]:
        """E[AL(B)] for B = 0 .. min(len(order), max_budget)."""
        order = prune_order(tree) if order is None else order
        table = self.acceptance.table()
        out, total = [0.0], 0.0
        for node in order[: self.max_budget]:
            total += table[self.acceptance.bin_of(tree.cum[node])]
            out.append(total)
        return out

    def choose(self, tree: DraftTree, order: list[int] | None = None) -> int:
        """B* for this tree (0 = verify the root alone: a plain decoding step)."""
        return self.best_budget(self.expected_al(tree, order))

    def best_budget(self, al: list[float]) -> int:
        """B* for a tree whose E[AL(B)] is ``al`` (:meth:`expected_al`)."""
        draft = self.draft_s or 0.0
        return max(range(len(al)), key=lambda b: ((1.0 + al[b]) / (draft + self.verify_s(b)), -b))

    def planning_budget(self) -> int:
        """The budget a construction plans for (shape, steps worth running): 1.5x the recent mean B, >= 4."""
        return max(4, min(self.max_budget, math.ceil(1.5 * self.planned)))

    def observe(self, budget: int, verify_s: float, other_s: float) -> None:
        """Fold in one turn's chosen B, its measured verification forward and everything else."""
        expected = curve_at(self.curve, budget + 1)
        if expected > 0 and verify_s > 0:
            self.verify_scale = self.decay * self.verify_scale + (1 - self.decay) * (verify_s / expected)
        self.recent_draft = (self.recent_draft + [float(other_s)])[-self.draft_window:]
        self.draft_s = statistics.median(self.recent_draft)
        self.planned = self.decay * self.planned + (1 - self.decay) * budget
