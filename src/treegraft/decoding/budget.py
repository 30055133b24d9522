"""Choosing B_ver, the number of draft nodes verified per turn, by expected throughput.

On a GPU a 63-node verification costs about one decoding step, so the paper verifies 63 nodes; on a
CPU each extra row costs a share of a step. ``budget: auto`` therefore picks, before every turn,

    B* = argmax_B  (1 + E[AL(B)]) / (t_draft + t_verify(B + 1))

(Sequoia's hardware-aware tree size, Chen et al. 2024, with an online acceptance model in the spirit
of EAGLE-2's confidence-ranked trees):

* ``t_verify(n)`` is the target's measured verification curve (a forward over n tree rows on a real
  KV cache, :func:`~treegraft.models.runtime.forward_curve`), cached per machine, model and runtime,
  and rescaled online by the ratio of observed verification times to the curve (longer contexts,
  machine drift);
* ``t_draft`` is the running mean of everything in a turn but the verification forward;
* ``E[AL(B)] = sum_{k <= B} p_k``, where ``p_k`` is the probability that the k-th node in pruning
  order (:func:`~treegraft.tree.prune_order`) is accepted: AL counts exactly the kept nodes on the
  target's path, so the expected AL of the top-B nodes is the sum of their acceptance rates.
  ``p_k`` is learned per decoder (per method) from every turn: verified nodes give their outcome, a
  rank the tree did not reach counts as a miss;
  under greedy decoding an unverified node is known too when its depth is within the emitted tokens
  (accepted + bonus), and one extending the emitted path counts with the observed continuation
  rate. A prior ``1 / (k + 1)`` with a small weight starts the estimate.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from ..atomic import atomic_write_json, read_json
from ..models.runtime import curve_at, forward_curve, model_runtime, runtime_cache_key
from ..tree import DraftTree

__all__ = ["DEFAULT_SIZES", "measure_verify_curve", "cached_verify_curve", "AcceptanceModel", "BudgetPlanner"]

DEFAULT_SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)


def measure_verify_curve(model: nn.Module, context: int = 256, max_size: int = 64, sizes=None,
                         repeats: int = 3) -> dict[int, float]:
    """Median seconds of a verification forward for each tree size in ``sizes`` (default: up to ``max_size``)."""
    sizes = [s for s in (sizes or DEFAULT_SIZES) if s <= max_size] or [1]
    return forward_curve(model, sizes=sizes, context=context, repeats=repeats)


def _model_id(model: nn.Module) -> str:
    config = model.config
    ident = f"{getattr(config, '_name_or_path', '')}|{config.model_type}|{getattr(config, 'num_hidden_layers', '')}"
    ident += f"|{getattr(config, 'hidden_size', '')}|{config.vocab_size}"
    return hashlib.sha256(ident.encode()).hexdigest()[:12] + f" ({getattr(config, '_name_or_path', '') or config.model_type})"


def cached_verify_curve(model: nn.Module, cache_dir: str | Path | None, max_size: int = 64,
                        context: int = 256) -> dict[int, float]:
    """:func:`measure_verify_curve`, cached in ``<cache_dir>/verify_curves.json`` per machine, model,
    runtime, context and sizes (None: measured every time)."""
    sizes = [s for s in DEFAULT_SIZES if s <= max_size + 1] or [1]
    device = next(model.parameters()).device
    key = f"{runtime_cache_key(_model_id(model), device)} | {model_runtime(model)} | ctx {context} | {sizes}"
    path = Path(cache_dir) / "verify_curves.json" if cache_dir else None
    cache = read_json(path, {}) if path else {}
    if key in cache:
        return {int(n): float(s) for n, s in cache[key].items()}
    curve = measure_verify_curve(model, context=context, sizes=sizes, max_size=max(sizes))
    if path:
        cache = read_json(path, {})
        cache[key] = curve
        atomic_write_json(cache, path)
    return curve


@dataclass
class AcceptanceModel:
    """Acceptance rate by pruning rank, ``p_k = (hits_k + w * prior_k) / (seen_k + w)``, k = 1..max_rank."""

    max_rank: int = 64
    prior_weight: float = 2.0
    hits: list[float] = field(default_factory=list)
    seen: list[float] = field(default_factory=list)
    cont_hits: float = 1.0  # accepted children among verified nodes whose parent was accepted (+1 prior)
    cont_seen: float = 2.0

    def __post_init__(self) -> None:
        if not self.hits:
            self.hits = [0.0] * (self.max_rank + 1)
            self.seen = [0.0] * (self.max_rank + 1)

    def p(self, k: int) -> float:
        prior = 1.0 / (k + 1)
        return (self.hits[k] + self.prior_weight * prior) / (self.seen[k] + self.prior_weight)

    def expected_al(self, budget: int) -> float:
        return sum(self.p(k) for k in range(1, min(budget, self.max_rank) + 1))

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
        for rank in range(1, self.max_rank + 1):
            node = order[rank - 1] if rank <= len(order) else None
            if node is None:  # the tree had fewer nodes: nothing at this rank could be accepted
                hit = 0.0
            elif node in kept:
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
            self.hits[rank] += hit
            self.seen[rank] += 1.0


@dataclass
class BudgetPlanner:
    """Picks B_ver before every turn from the verification curve, the drafting cost and :class:`AcceptanceModel`."""

    curve: dict[int, float]
    max_budget: int = 64
    acceptance: AcceptanceModel = field(default_factory=AcceptanceModel)
    draft_s: float | None = None  # running mean of a turn's time outside the verification forward
    verify_scale: float = 1.0  # running mean of observed / curve verification time
    decay: float = 0.9

    def __post_init__(self) -> None:
        self.acceptance.max_rank = max(self.acceptance.max_rank, self.max_budget)
        while len(self.acceptance.hits) <= self.acceptance.max_rank:
            self.acceptance.hits.append(0.0)
            self.acceptance.seen.append(0.0)

    def verify_s(self, budget: int) -> float:
        return self.verify_scale * curve_at(self.curve, budget + 1)

    def throughput(self, budget: int) -> float:
        """Expected tokens per second of a turn verifying ``budget`` nodes."""
        return (1.0 + self.acceptance.expected_al(budget)) / ((self.draft_s or 0.0) + self.verify_s(budget))

    def choose(self) -> int:
        return max(range(0, self.max_budget + 1), key=lambda b: (self.throughput(b), -b))

    def observe(self, budget: int, verify_s: float, other_s: float) -> None:
        """Fold in one turn's measured verification forward and everything else."""
        expected = curve_at(self.curve, budget + 1)
        if expected > 0 and verify_s > 0:
            self.verify_scale = self.decay * self.verify_scale + (1 - self.decay) * (verify_s / expected)
        self.draft_s = other_s if self.draft_s is None else self.decay * self.draft_s + (1 - self.decay) * other_s
