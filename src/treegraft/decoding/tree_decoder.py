"""Lossless tree speculative decoding with an n-gram drafter and a middle drafter.

Usage (no Hydra needed)::

    from treegraft.decoding import TreeConfig, TreeGraftDecoder
    decoder = TreeGraftDecoder(target, middle, tokenizer, TreeConfig(method="all_mid"))
    result = decoder.generate(prompt_ids, max_new_tokens=256)
    result.tokens, result.turns  # new tokens; per-turn records (AL, tree size, time split)

A turn builds a draft tree over D drafting steps (each done by the n-gram "small" drafter or the
middle LM), prunes it to the verification budget, verifies it with one target forward using tree
attention, accepts the longest matching path plus one bonus token, and keeps only the accepted
entries in every KV cache. Greedy output equals the target's own greedy decoding; sampled output
has the target's distribution.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch
from torch import nn

from ..drafters.middle import MiddleDrafter
from ..drafters.ngram import NGramConfig, NGramDrafter
from ..drafters.vocab import SubsetHead, VocabSubset, frequent_tokens
from ..model_io import (cache_length, forward_hidden, head_weight, keep_cache_positions, lm_logits, logit_softcap,
                        new_cache)
from ..paths import default_cache_dir
from ..scheduling import FixedScheduler, Scheduler, StepState, frontier_of, tree_signals
from ..tree import MIDDLE, SMALL, DraftTree, build_tree_inputs, prune_order, prune_to_budget
from .autoregressive import GenerationResult, eos_token_ids, extend_until_stop, hold_eos, make_generator, prepare_prompt
from .backoff import CallGate
from .budget import BudgetPlanner, cached_verify_curve
from .sampling import SamplingConfig
from .verify import accept_greedy, accept_sampling

__all__ = ["TreeConfig", "TreeGraftDecoder", "MethodPreset", "METHOD_PRESETS", "auto_shape"]

# a shared middle step computes the head rows of its rescoring parents and selection pool in one batch
# when there are at most this many (else the pool's rows wait for the selection)
ONE_HEAD_BATCH = 8
# verification computes the LM head in one batch for a row and its best-scored descendants while the
# parent's acceptance probability is at least this: an extra row in a batch costs ~1/13 of a lone row
LIKELY_ROW_P = 0.08


@dataclass(frozen=True)
class MethodPreset:
    """How a method builds its tree.

    shared: the shared-tree construction (asymmetric rescoring, grafting) rather than
        the single-drafter construction.
    schedule: ``"small"`` (every step skips), ``"mid"`` (every step calls) or ``"fixed"``
        (``TreeConfig.schedule``).
    """

    shared: bool
    schedule: str
    grafting: str = "nondestructive"
    expanded_selection: bool = True
    csd: bool = False  # Cascade-Speculative-Drafting chain instead of a tree


METHOD_PRESETS: dict[str, MethodPreset] = {
    "all_small": MethodPreset(shared=False, schedule="small"),
    "all_mid": MethodPreset(shared=False, schedule="mid"),
    "fixed": MethodPreset(shared=True, schedule="fixed"),
    "all_call": MethodPreset(shared=True, schedule="mid"),
    "no_nondestructive": MethodPreset(shared=True, schedule="fixed", grafting="destructive"),
    "no_expanded_selection": MethodPreset(shared=True, schedule="fixed", expanded_selection=False),
    "csd": MethodPreset(shared=False, schedule="mid", csd=True),
}


@dataclass
class TreeConfig:
    """Tree and drafter settings. The defaults are the project's (those of ``conf/tree/default.yaml``,
    which a test keeps equal): the paper's D, W, m (Appendix E) with B_ver and the shape measured on
    the machine; :meth:`paper` gives the paper's GPU-shaped tree (B_ver = 63, whole-tree rescoring).

    method: a key of ``METHOD_PRESETS``: ``all_small`` / ``all_mid`` (single-drafter endpoints),
        ``fixed`` (shared tree, ``schedule``), ``all_call`` (shared tree, every step a call),
        ``no_nondestructive`` / ``no_expanded_selection`` (ablations of ``fixed``), ``csd`` (a
        Cascade-Speculative-Drafting chain: the middle drafter drafts D tokens, itself sped up by the
        n-gram drafter's proposals, and the target verifies the chain).
    depth: D drafting steps; width: W nodes expanded per step; top_m: children per expanded node.
    budget: B_ver, non-root nodes verified per turn, or ``"auto"``: chosen before every turn by
        expected throughput from the measured verification curve and the acceptance observed so far
        (:class:`treegraft.decoding.budget.BudgetPlanner`), up to ``auto_max_budget``.
    shape: ``"paper"``: every step expands ``width`` nodes with ``top_m`` children and a middle step
        rescores the whole tree (the paper's construction, GPU-shaped); ``"auto"``: W, m and the middle step's rescoring
        scope follow B_ver (:func:`auto_shape`; ``width`` / ``top_m`` become caps), so construction
        grows with B_ver, not with W * m * D.
    draft_vocab: size K of the middle drafter's restricted draft vocabulary (the K most frequent
        tokens plus the context's, :mod:`treegraft.drafters.vocab`); None = the full vocabulary.
    node_cap: construction stops adding nodes past this many.
    schedule: the fixed schedule (1 = call the middle drafter, 0 = skip) of ``fixed`` and the ablations.
    grafting / expanded_selection: override the method's preset (``nondestructive|destructive``, bool).
    max_calls_per_turn: optional per-turn budget of middle-drafter calls (later steps are forced to skip).
    call_backoff: with a learned scheduler, stop calling the middle drafter for a few turns when this
        prompt's call turns produce fewer tokens per second than plain decoding would
        (:class:`~treegraft.decoding.backoff.CallGate`); fixed schedules never back off.
    skip_beyond_budget: leave out the work of a step that cannot change the pruned tree (every node it
        could add or rescore lies deeper than B_ver, so pruning would drop it); the verified tree is the
        same, only the wasted drafter calls go. Matters where B_ver is small (``auto`` on a CPU).
    """

    method: str = "all_small"
    depth: int = 5
    width: int = 10
    top_m: int = 10
    budget: int | str = "auto"
    node_cap: int = 511
    schedule: list[int] = field(default_factory=lambda: [1, 0, 1, 0, 1])
    grafting: str | None = None
    expanded_selection: bool | None = None
    max_calls_per_turn: int | None = None
    ngram: NGramConfig = field(default_factory=NGramConfig)
    auto_max_budget: int = 63
    skip_beyond_budget: bool = True
    call_backoff: bool = True
    shape: str = "auto"
    draft_vocab: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.ngram, dict):
            self.ngram = NGramConfig(**self.ngram)
        if self.method not in METHOD_PRESETS:
            raise ValueError(f"unknown tree method {self.method!r}; expected one of {sorted(METHOD_PRESETS)}")
        for name in ("depth", "width", "top_m", "node_cap"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.budget != "auto" and int(self.budget) < 0:
            raise ValueError(f"budget must be an int >= 0 or 'auto', got {self.budget!r}")
        self.schedule = [int(a) for a in self.schedule]
        uses_schedule = METHOD_PRESETS[self.method].schedule == "fixed"
        if uses_schedule and (len(self.schedule) != self.depth or any(a not in (0, 1) for a in self.schedule)):
            raise ValueError(f"schedule must be {self.depth} actions of 0 (skip) or 1 (call), got {self.schedule}")
        if self.grafting not in (None, "nondestructive", "destructive"):
            raise ValueError(f"grafting must be nondestructive or destructive, got {self.grafting!r}")
        if self.shape not in ("auto", "paper"):
            raise ValueError(f"shape must be auto or paper, got {self.shape!r}")
        if self.draft_vocab is not None and int(self.draft_vocab) < 1:
            raise ValueError(f"draft_vocab must be a positive size or null, got {self.draft_vocab!r}")

    @classmethod
    def paper(cls, **overrides) -> "TreeConfig":
        """The paper's tree (Appendix E: B_ver = 63, W = m = 10, whole-tree rescoring) and n-gram drafter
        (the cached target log-probabilities over the full vocabulary, no copy chain)."""
        ngram = NGramConfig(prefill_vocab=None, copy_len=0, scoring="target")
        return cls(**{"budget": 63, "shape": "paper", "ngram": ngram, **overrides})

    @property
    def preset(self) -> MethodPreset:
        base = METHOD_PRESETS[self.method]
        return MethodPreset(
            shared=base.shared,
            schedule=base.schedule,
            grafting=self.grafting or base.grafting,
            expanded_selection=base.expanded_selection if self.expanded_selection is None else self.expanded_selection,
            csd=base.csd,
        )

    def actions(self) -> list[int]:
        """The method's schedule for one turn."""
        kind = self.preset.schedule
        if kind == "small":
            return [SMALL] * self.depth
        if kind == "mid":
            return [MIDDLE] * self.depth
        return list(self.schedule)


def auto_shape(budget: int, max_width: int = 10, max_top_m: int = 10) -> tuple[int, int, int]:
    """``(W, m, scope)`` of ``shape=auto`` for B_ver = ``budget``.

    W = m = 1 + ceil(sqrt(B)) (capped): about D * W * m = 5 * (1 + sqrt B)^2 candidates for B kept
    nodes, enough to fill the budget with the best-scored ones (B = 8: 4 x 4; B = 31: 7 x 7; B = 63:
    9 x 9, the paper's size). A middle step rescores (and may graft under) only the first
    ``scope = 2 * B + W`` nodes in pruning order: nodes ranked below cannot enter the verified tree
    unless the middle drafter lifts them, and encoding them would cost a forward row each.
    """
    side = 1 + math.ceil(math.sqrt(max(int(budget), 1)))
    return min(max_width, side), min(max_top_m, side), 2 * int(budget) + side


@dataclass
class BuildState:
    """Per-turn construction state next to the tree (copy both to branch a construction)."""

    done: list[int] = field(default_factory=list)  # actions taken so far
    calls: int = 0  # middle-drafter calls so far
    rescored_from: int = 1  # nodes with id >= this were added since the last middle rescoring

    def copy(self) -> "BuildState":
        return BuildState(list(self.done), self.calls, self.rescored_from)


class TreeGraftDecoder:
    """Tree speculative decoder; see the module docstring."""

    def __init__(
        self,
        target: nn.Module,
        middle: nn.Module | None,
        tokenizer=None,
        cfg: TreeConfig | None = None,
        sampling: SamplingConfig | None = None,
        eos_ids: set[int] | None = None,
        scheduler: Scheduler | None = None,
        cache_dir: str | Path | None = None,
        eager_middle_prefill: bool = False,
    ):
        """``eager_middle_prefill``: encode the prompt into the middle drafter's cache at prefill
        (schedule enumeration wants every call's cost to be a call's own); by default the drafter
        catches up on the prompt at its first call, so a method or policy that does not call never pays
        for it and the time to the first turn is the target's prefill alone."""
        self.target = target
        self.tokenizer = tokenizer
        self.cfg = cfg or TreeConfig()
        self.sampling = sampling or SamplingConfig()
        self.eos_ids = set(eos_ids) if eos_ids is not None else eos_token_ids(target, tokenizer)
        self.device = next(target.parameters()).device
        self.cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        # the middle drafter exists only where it may be called (every method but all_small, whose
        # schedule is all skips; a learned policy may call with any method)
        may_call = scheduler is not None or self.cfg.preset.schedule != "small"
        if may_call and scheduler is None and middle is None:
            raise ValueError(f"method {self.cfg.method} calls the middle drafter, but none was given")
        draft_vocab = None
        if middle is not None and may_call and self.cfg.draft_vocab:
            draft_vocab = self._frequent(int(self.cfg.draft_vocab), head_weight(middle).shape[0])
        self.middle = MiddleDrafter(middle, draft_vocab) if middle is not None and may_call else None
        self._eager_middle_prefill = eager_middle_prefill
        self.ngram = NGramDrafter(self.cfg.ngram)
        self._small_kinds: dict[int, tuple] = {}  # this turn's n-gram nodes -> their kind (the drafter learns rates)
        self._budget: int | None = None if self.cfg.budget == "auto" else int(self.cfg.budget)
        self.planner: BudgetPlanner | None = None
        self._prefill_head: SubsetHead | None = None  # ngram.prefill_vocab's restricted head of the target
        self.turn_signals = {"recent_al": 0.0, "recent_target_conf": 0.0}  # the scheduler's view of past turns
        self.scheduler: Scheduler = scheduler or FixedScheduler(self.cfg.actions())
        # a learned policy's calls back off on a prompt where they do not pay (a fixed schedule is the schedule)
        self.gate: CallGate | None = CallGate() if scheduler is not None and self.cfg.call_backoff else None
        # runtime context of the scheduler state (ms per target verification / middle forward),
        # measured by a warm-up; 0 = unknown
        self.t_tgt_ms = 0.0
        self.t_mid_ms = 0.0
        self.context_samples: dict[str, list[float]] = {}  # warm_up's per-turn timings behind t_tgt_ms / t_mid_ms
        self.prompt_len = 0
        self._min_new_tokens = 0  # generate()'s: EOS is held back before this many new tokens ...
        self._emitted = 0  # ... counted from the tokens emitted before the current turn

    # ------------------------------------------------------------------ setup
    def _frequent(self, k: int, vocab_size: int) -> torch.Tensor:
        """The ``k`` most frequent token ids (:func:`~treegraft.drafters.vocab.frequent_tokens`; by id
        without a tokenizer)."""
        if self.tokenizer is None:
            return torch.arange(min(k, vocab_size))
        return frequent_tokens(self.tokenizer, k, vocab_size, self.cache_dir)

    @property
    def verify_curve(self) -> dict[int, float] | None:
        return self.planner.curve if self.planner is not None else None

    def _planner(self) -> BudgetPlanner:
        if self.planner is None:  # the verification curve is measured, or read from the cache, once
            curve = cached_verify_curve(self.target, self.cache_dir, self.cfg.auto_max_budget)
            self.planner = BudgetPlanner(curve, self.cfg.auto_max_budget)
        return self.planner

    def budget(self) -> int:
        """The B_ver a turn's construction plans for (tree shape, steps worth running): the configured
        value, or with ``budget=auto`` the planner's running estimate (:meth:`budget_for` decides the
        verified size once the tree is built)."""
        if self._budget is not None:
            return self._budget
        return self._planner().planning_budget()

    def budget_for(self, tree: DraftTree) -> int:
        """B_ver of this turn's tree: the configured value, or with ``budget=auto`` the size with the
        best expected throughput given the tree's scores (:meth:`BudgetPlanner.choose`)."""
        if self._budget is not None:
            return self._budget
        return self._planner().choose(tree)

    def shape(self) -> tuple[int, int, int | None]:
        """``(W, m, rescoring scope)`` of the current turn (scope None: the whole tree)."""
        if self.cfg.shape == "paper":
            return self.cfg.width, self.cfg.top_m, None
        return auto_shape(self.budget(), self.cfg.width, self.cfg.top_m)

    def warm_up(self, prompt_ids: Sequence[int], max_new_tokens: int = 8, repeats: int = 1) -> tuple[float, float]:
        """Measure the scheduler's runtime context on ``repeats`` warm-up generations that call the middle
        drafter at every step (not scored): sets and returns (t_tgt_ms, t_mid_ms), the *medians* over
        every warm-up turn of the verification forward and of one middle call (a slow spell of a
        shared machine moves a mean, not a median); the per-turn samples stay in ``context_samples``.

        The middle drafter encodes the prompt at prefill here, as in `collect` (``eager_middle_prefill``),
        so ``t_mid`` is what a call costs, not a call plus the prompt's catch-up: with the lazy catch-up
        the first call of a short warm-up carries the whole prompt, which doubled ``t_mid`` on a
        200-token prompt and made a learned scheduler price every call as twice as dear as the turns it
        was fitted on."""
        saved, eager, gate = self.scheduler, self._eager_middle_prefill, self.gate
        self.scheduler = FixedScheduler([MIDDLE] * self.cfg.depth) if self.middle is not None else saved
        self._eager_middle_prefill, self.gate = True, None
        turns = []
        try:
            for _ in range(max(1, int(repeats))):
                turns += self.generate(prompt_ids, max_new_tokens).turns
        finally:
            self.scheduler, self._eager_middle_prefill, self.gate = saved, eager, gate
        tgt = [1000 * t["target_forward_s"] for t in turns]
        mid = [1000 * t["middle_forward_s"] / t["middle_calls"] for t in turns if t["middle_calls"]]
        self.context_samples = {"t_tgt_ms": tgt, "t_mid_ms": mid}
        self.t_tgt_ms = float(statistics.median(tgt)) if tgt else 0.0
        self.t_mid_ms = float(statistics.median(mid)) if mid else 0.0
        return self.t_tgt_ms, self.t_mid_ms

    def _prefill(self, prompt_ids: list[int]) -> None:
        """Target cache over prompt[:-1], the n-gram drafter's target scores there, its index, the middle
        drafter's context.

        The scores are the target's top-m log-probabilities at every prompt position. With
        ``ngram.prefill_vocab`` = K they are a log-softmax over the K most frequent tokens plus the
        prompt's own (every token a prompt position can propose): the LM head then costs K / V of a
        full-vocabulary head over the prompt, which keeps the time to first token near ``ar``'s.
        """
        self.cache = new_cache()
        ctx = prompt_ids[:-1]
        m = self.cfg.ngram.top_m
        top_ids = torch.zeros(0, m, dtype=torch.long)
        top_lps = torch.zeros(0, m)
        if ctx:
            toks = torch.tensor(ctx, device=self.device)
            hidden = forward_hidden(self.target, self.cache, toks, torch.arange(len(ctx), device=self.device), None)
            head = None
            if self.cfg.ngram.prefill_vocab:
                if self._prefill_head is None:  # the frequent tokens' rows, gathered once per decoder
                    weight = head_weight(self.target)
                    base = self._frequent(int(self.cfg.ngram.prefill_vocab), weight.shape[0])
                    self._prefill_head = SubsetHead(weight, VocabSubset(base, weight.shape[0]), logit_softcap(self.target))
                head = self._prefill_head
                head.truncate(min(int(self.cfg.ngram.prefill_vocab), head_weight(self.target).shape[0]))
                head.add(prompt_ids)
            ids, lps = [], []
            for chunk in hidden.split(64):  # bounded memory: [64, V] logits at a time
                if head is None:
                    logp = torch.log_softmax(lm_logits(self.target, chunk), dim=-1)
                else:
                    logp = head.log_softmax(chunk)
                v, i = logp.topk(min(m, logp.shape[-1]), dim=-1)
                ids.append((i if head is None else head.subset.ids[i]).cpu())
                lps.append(v.cpu())
            top_ids, top_lps = torch.cat(ids), torch.cat(lps)
        self.ngram.reset(prompt_ids, top_ids, top_lps)
        # the target's confidence on the prompt's last positions stands in for past turns' (first turn)
        conf = float(top_lps[-16:, 0].exp().mean()) if len(top_lps) else 0.0
        self.turn_signals = {"recent_al": 0.0, "recent_target_conf": conf}
        if self.middle is not None:
            self.middle.reset(prompt_ids, encode=self._eager_middle_prefill)

    # ------------------------------------------------------------------ drafting
    def _expand_small(self, tree: DraftTree, nodes: list[int], step: int, stats: dict) -> None:
        start = time.perf_counter()
        cap = self.cfg.node_cap
        m = self.shape()[1]
        kinds = self._small_kinds
        if nodes == [0] and self.cfg.ngram.copy_len:  # a copy chain under the root, before its other children
            parent = 0
            for token, score, kind in self.ngram.copy_chain_kinds([]):
                if len(tree) >= cap:
                    break
                parent = tree.add_child(parent, token, score, SMALL, step)
                kinds.setdefault(parent, kind)
        for node in nodes:
            children, _ = self.ngram.propose_kinds(tree.path_tokens(node), m)
            for token, score, kind in children:
                if len(tree) >= cap:
                    break
                kinds.setdefault(tree.add_child(node, token, score, SMALL, step), kind)
        elapsed = time.perf_counter() - start
        stats["small_s"] += elapsed
        stats["small_propose_s"] = stats.get("small_propose_s", 0.0) + elapsed  # lookups only (per-call cost)
        stats["small_calls"] += len(nodes)

    def _ngram_outcomes(self, tree: DraftTree, kept: set[int], path_nodes: list[int], emitted: list[int]):
        """(kind, accepted) of every n-gram child whose parent was accepted (the root included) and whose
        own outcome is known: verified, or (greedy) within the emitted tokens."""
        on_path = set(path_nodes)
        accepted = set(path_nodes[1:])
        out = []
        for node, kind in self._small_kinds.items():
            if tree.parent[node] not in on_path or not tree.alive[node]:
                continue
            if node in kept:
                out.append((kind, node in accepted))
            elif self.sampling.greedy and tree.depth[node] <= len(emitted):
                out.append((kind, tree.token[node] == emitted[tree.depth[node] - 1]))
        return out

    def _expand_middle(self, tree: DraftTree, nodes: list[int], step: int, stats: dict) -> None:
        start = time.perf_counter()
        mid = self.middle
        before = mid.forward_s
        mid.encode(tree, nodes)
        stats["middle_forward_s"] += mid.forward_s - before
        m, cap = self.shape()[1], self.cfg.node_cap
        for node in nodes:
            lp, ids = mid.logprobs[node].topk(m)
            for token, score in zip(ids, lp):
                if len(tree) >= cap:
                    break
                tree.add_child(node, token, score, MIDDLE, step)
        stats["middle_s"] += time.perf_counter() - start
        stats["middle_calls"] += 1

    def _top_w(self, tree: DraftTree, pool: list[int]) -> list[int]:
        """The W best pool nodes by cum (ties: shallower, then earlier created)."""
        pool = sorted(pool, key=lambda n: (-tree.cum[n], tree.depth[n], n))
        return pool[: self.shape()[0]]

    def _rescore_scope(self, tree: DraftTree) -> list[int]:
        """The nodes a shared middle step encodes, rescores and may graft under (alive, in id order):
        the whole tree, or with ``shape=auto`` the root plus the first ``scope`` nodes in pruning order."""
        scope = self.shape()[2]
        if scope is None:
            return tree.alive_nodes()
        return sorted([0] + prune_order(tree)[:scope])

    def _middle_pool(self, tree: DraftTree, step: int, scope: list[int]) -> list[int]:
        """Where a shared middle step may graft: unvisited nodes of the scope at any depth (expanded
        selection), or the previous step's unvisited nodes (the ablation)."""
        if self.cfg.preset.expanded_selection:
            return [n for n in scope if not tree.visited[n]]
        in_scope = set(scope)
        return [n for n in self._newest_pool(tree, step) if not tree.visited[n] and n in in_scope]

    def _newest_pool(self, tree: DraftTree, step: int) -> list[int]:
        """The nodes created at the previous step (the root at step 1); empty if that step added none,
        in which case the step adds nothing (a later shared middle step can still graft anywhere)."""
        return [0] if step == 1 else tree.nodes_created_at(step - 1)

    def _graft_middle(self, tree: DraftTree, step: int, stats: dict) -> None:
        """A shared-tree middle step: rescore every node under q_m, select anywhere, graft."""
        start = time.perf_counter()
        mid = self.middle
        preset = self.cfg.preset
        before = mid.forward_s
        scope = self._rescore_scope(tree)
        in_scope = set(scope)
        parents = [n for n in scope if any(c in in_scope for c in tree.children[n].values())]
        # one incremental forward over every scope node not yet encoded; q_m at every scope parent, and
        # where the selection pool is small, at every pool node too: one LM-head batch instead of two
        # (a lone head row streams the whole head; a few more rows in the batch cost little)
        pool = self._middle_pool(tree, step, scope)
        need = sorted(set(parents) | set(pool))
        mid.encode(tree, scope, need_logprobs=need if len(need) <= ONE_HEAD_BATCH else parents)
        for n in scope[1:]:  # asymmetric scoring: the middle drafter recomputes every edge and cum in scope
            tree.edge[n] = mid.logprobs[tree.parent[n]].score(tree.token[n])
        tree.recompute_cum(0)
        selected = self._top_w(tree, pool)  # rescoring changes scores, not who is in the pool
        mid.encode(tree, selected)  # already encoded: this only adds their log-probability rows
        stats["middle_forward_s"] += mid.forward_s - before
        m, cap = self.shape()[1], self.cfg.node_cap
        for node in selected:
            if not tree.alive[node]:  # removed by a destructive graft above it in this same step
                continue
            tree.visited[node] = True
            if preset.grafting == "destructive":
                tree.remove_subtrees_below(node)
            lp, ids = mid.logprobs[node].topk(m)
            for token, score in zip(ids, lp):
                child = tree.children[node].get(token)
                if child is not None:  # non-destructive: the branch stays, with the middle's score
                    tree.edge[child] = score
                    continue
                if len(tree) >= cap:
                    break
                tree.add_child(node, token, score, MIDDLE, step)
        stats["middle_s"] += time.perf_counter() - start
        stats["middle_calls"] += 1

    def _graft_is_beyond(self, tree: DraftTree, step: int, horizon: int, rescored_from: int) -> bool:
        """True when a shared middle step cannot change the tree pruned to ``horizon`` nodes: every node
        it could select has depth >= horizon (its children would be deeper), and every node whose score
        it would newly rescore (added since the last rescoring) has depth > horizon."""
        depth, alive = tree.depth, tree.alive
        if any(alive[n] and depth[n] <= horizon for n in range(rescored_from, len(tree))):
            return False
        return all(depth[n] >= horizon for n in self._middle_pool(tree, step, self._rescore_scope(tree)))

    def step_state(self, tree: DraftTree, step: int, history: list[int], with_signals: bool) -> StepState:
        """The scheduler's view before step ``step``'s action (the scheduler state)."""
        signals = None
        if with_signals:
            frontier = frontier_of(tree, step)
            match, top1 = 0, None
            if frontier:
                best = min(frontier, key=lambda n: (-tree.cum[n], tree.depth[n], n))
                children, match = self.ngram.propose(tree.path_tokens(best), self.shape()[1])
                top1 = children[0][1] if children else None
            extra = dict(self.turn_signals)
            if self.planner is not None:  # what the tree promises now, at the size the planner would verify
                al = self.planner.expected_al(tree)
                extra["expected_al"] = al[self.planner.best_budget(al)]
            signals = tree_signals(tree, step, self.shape()[0], match, top1, extra)
        return StepState(step=step, depth=self.cfg.depth, history=list(history), prompt_len=self.prompt_len,
                         t_tgt_ms=self.t_tgt_ms, t_mid_ms=self.t_mid_ms, signals=signals)

    def _build_csd_chain(self, root_token: int, stats: dict) -> DraftTree:
        """A D-token chain drafted by the middle drafter, whose own drafts come from the n-gram drafter.

        Each round the n-gram drafter proposes a greedy chain below the current end; one middle
        forward scores it; the middle keeps the longest prefix equal to its own argmax choices and
        adds its argmax after it (a lossless greedy cascade at the drafting level).
        """
        tree, _ = self.start_tree(root_token)
        mid = self.middle
        depth = self.cfg.depth
        if self.cfg.skip_beyond_budget:
            depth = min(depth, self.budget())  # chain tokens past B_ver would be pruned anyway
        end = 0
        while tree.depth[end] < depth:
            t0 = time.perf_counter()
            path = tree.path_tokens(end)
            proposal: list[tuple[int, float]] = []
            for _ in range(depth - tree.depth[end] - 1):
                children, _ = self.ngram.propose(path + [t for t, _ in proposal], 1)
                if not children:
                    break
                proposal.append(children[0])
            chain, parent = [], end
            for token, score in proposal:
                parent = tree.add_child(parent, token, score, SMALL, tree.depth[parent] + 1)
                chain.append(parent)
            stats["small_s"] += time.perf_counter() - t0
            stats["small_calls"] += len(proposal)
            t1 = time.perf_counter()
            before = mid.forward_s
            mid.encode(tree, [end] + chain)
            stats["middle_forward_s"] += mid.forward_s - before
            stats["middle_calls"] += 1
            cur = end
            for node in chain:
                logp = mid.logprobs[cur]
                if logp.argmax() != tree.token[node]:
                    break
                tree.edge[node] = logp.score(tree.token[node])
                tree.cum[node] = tree.cum[cur] + tree.edge[node]
                cur = node
            tree.remove_subtrees_below(cur)  # the middle drafter's rejection of the rest
            logp = mid.logprobs[cur]
            best = logp.argmax()
            end = tree.add_child(cur, best, logp.score(best), MIDDLE, tree.depth[cur] + 1)
            stats["middle_s"] += time.perf_counter() - t1
        stats["schedule"] = [MIDDLE] * depth
        return tree

    def build_tree(self, root_token: int, actions: Sequence[int] | None, stats: dict) -> DraftTree:
        """Build one turn's tree, step t done by ``actions[t-1]`` (0 = n-gram drafter, 1 = middle drafter),
        or by the scheduler's decision before each step when ``actions`` is None.

        Single-drafter methods: step 1 expands the root, step t the top W of the nodes
        created at step t-1, with stored scores. Shared-tree methods: the small step is
        the same; a middle step rescores the whole tree and may graft under any unvisited node.
        """
        if self.cfg.preset.csd:
            return self._build_csd_chain(root_token, stats)
        tree, build = self.start_tree(root_token)
        for step in range(1, self.cfg.depth + 1):
            if len(tree) >= self.cfg.node_cap:
                break
            if actions is not None:
                action = int(actions[step - 1])
            elif self.gate is not None and not self.gate.is_open:
                action = SMALL
                stats["backed_off"] = True
            else:
                t0 = time.perf_counter()
                state = self.step_state(tree, step, build.done, self.scheduler.needs_signals)
                action = int(self.scheduler.decide(state))
                stats["schedule_s"] = stats.get("schedule_s", 0.0) + time.perf_counter() - t0
            self.apply_step(tree, build, step, action, stats)
        stats["schedule"] = list(build.done)
        return tree

    def start_tree(self, root_token: int) -> tuple[DraftTree, "BuildState"]:
        """A turn's root-only tree and its construction state (the middle drafter starts a new turn)."""
        if self.middle is not None:
            self.middle.start_turn()
        self._small_kinds = {}
        return DraftTree.with_root(root_token), BuildState()

    def apply_step(self, tree: DraftTree, build: "BuildState", step: int, action: int, stats: dict) -> None:
        """Do drafting step ``step`` with ``action`` (0 = n-gram drafter, 1 = middle drafter) in place."""
        if len(tree) >= self.cfg.node_cap:
            build.done.append(SMALL)
            return
        if action == MIDDLE and self.middle is None:
            raise ValueError("the scheduler chose a middle-drafter call, but there is no middle drafter")
        if action == MIDDLE and self.cfg.max_calls_per_turn is not None and build.calls >= self.cfg.max_calls_per_turn:
            action = SMALL
        build.done.append(action)
        horizon = self.budget() if self.cfg.skip_beyond_budget else None
        if action == MIDDLE and self.cfg.preset.shared:
            if horizon is not None and self._graft_is_beyond(tree, step, horizon, build.rescored_from):
                stats["skipped_steps"] = stats.get("skipped_steps", 0) + 1
                return
            self._graft_middle(tree, step, stats)
            build.rescored_from = len(tree)
            build.calls += 1
            return
        pool = self._newest_pool(tree, step)
        if not pool:
            return
        selected = self._top_w(tree, pool)
        if horizon is not None and all(tree.depth[n] >= horizon for n in selected):
            stats["skipped_steps"] = stats.get("skipped_steps", 0) + 1
            return  # every child would sit deeper than B_ver
        if action == MIDDLE:
            self._expand_middle(tree, selected, step, stats)
            build.calls += 1
        else:
            self._expand_small(tree, selected, step, stats)

    # ------------------------------------------------------------------ one turn
    def verify_tree(self, tree: DraftTree, stats: dict, generator=None):
        """Prune ``tree`` to B_ver and verify it with one target forward on top of the cache.

        Returns ``(inputs, acceptance)``. The target cache then holds the context plus every verified
        row; the caller keeps the accepted rows (``keep_cache_positions``) or drops them all
        (``truncate_cache(cache, int(inputs.position_ids[0]))``). The LM head runs only on the rows
        acceptance visits, in batches: the root and the chain of its best-scored descendants likely to be
        accepted (``LIKELY_ROW_P``) at once, and where the walk leaves that chain, the row it reaches
        together with that row's own likely chain.
        """
        kept = prune_to_budget(tree, self.budget_for(tree))
        start = time.perf_counter()
        L = cache_length(self.cache)
        inputs = build_tree_inputs(tree, kept, L)
        n = inputs.size
        allowed = torch.ones(n, L + n, dtype=torch.bool)
        allowed[:, L:] = inputs.ancestor_mask
        fwd = time.perf_counter()
        hidden = forward_hidden(
            self.target, self.cache, inputs.tokens.to(self.device), inputs.position_ids.to(self.device), allowed
        )
        stats["target_forward_s"] += time.perf_counter() - fwd
        # The LM head streams its whole weight for one row as for twenty (a 1.5B head: 13 ms for 1 row,
        # 18 for 11), so rows go in batches: a row and the chain of its best-scored descendants that
        # acceptance is likely to reach (a parent accepted with probability >= LIKELY_ROW_P).
        if self.planner is not None:
            acceptance, table = self.planner.acceptance, self.planner.acceptance.table()

            def p_accept(cum: float) -> float:
                return table[acceptance.bin_of(cum)]
        else:
            p_accept = math.exp
        rows: dict[int, torch.Tensor] = {}

        def likely_chain(row: int) -> list[int]:
            chain = [row]
            while inputs.child_rows[chain[-1]]:
                best = max(inputs.child_rows[chain[-1]].values(), key=lambda r: (tree.cum[inputs.node_ids[r]], -r))
                if p_accept(tree.cum[inputs.node_ids[best]]) < LIKELY_ROW_P:
                    break
                chain.append(best)
            return chain

        def row_logits(row: int) -> torch.Tensor:
            if row not in rows:
                t0 = time.perf_counter()
                batch = [r for r in likely_chain(row) if r not in rows]
                logits = lm_logits(self.target, hidden[batch])
                if self._emitted < self._min_new_tokens:  # a row at depth d predicts new token emitted + d
                    logits = [hold_eos(x, self.eos_ids, self._emitted + int(inputs.position_ids[r]) - L,
                                       self._min_new_tokens) for r, x in zip(batch, logits)]
                rows.update(zip(batch, logits))
                stats["target_forward_s"] += time.perf_counter() - t0
            return rows[row]

        row_logits(0)

        if self.sampling.greedy:
            acc = accept_greedy(inputs, row_logits)
        else:
            def child_order(row: int) -> list[int]:
                kids = list(inputs.child_rows[row].values())
                return sorted(kids, key=lambda r: (-tree.cum[inputs.node_ids[r]], inputs.node_ids[r]))

            acc = accept_sampling(inputs, row_logits, child_order, self.sampling, generator)
        stats["verify_s"] += time.perf_counter() - start
        return inputs, acc

    def _turn(self, root: int, generator, actions: Sequence[int] | None = None) -> tuple[list[int], dict]:
        turn_start = time.perf_counter()
        stats = {"small_s": 0.0, "middle_s": 0.0, "verify_s": 0.0, "small_calls": 0, "middle_calls": 0,
                 "target_forward_s": 0.0, "middle_forward_s": 0.0}
        tree = self.build_tree(root, actions, stats)
        inputs, acc = self.verify_tree(tree, stats, generator)
        budget = inputs.size - 1
        L = int(inputs.position_ids[0])  # the root sits at the context length
        start = time.perf_counter()
        keep_cache_positions(self.cache, L, [L + row for row in acc.rows])
        stats["verify_s"] += time.perf_counter() - start

        path_nodes = [inputs.node_ids[r] for r in acc.rows]
        path_tokens = [tree.token[node] for node in path_nodes]
        emitted = path_tokens[1:] + [acc.bonus]
        # n-gram drafter: the context grows by the emitted tokens; the target's top-m at the verified
        # positions (root and accepted nodes) extends its score cache
        start = time.perf_counter()
        self.ngram.observe(self._ngram_outcomes(tree, set(inputs.node_ids), path_nodes, emitted))
        self.ngram.append(emitted)
        logp = torch.log_softmax(torch.stack(acc.logits).float(), dim=-1)
        v, i = logp.topk(self.cfg.ngram.top_m, dim=-1)
        if self.cfg.ngram.extend_cache:
            self.ngram.set_scores(L, i.cpu(), v.cpu())
        stats["small_s"] += time.perf_counter() - start
        if self.middle is not None:
            self.middle.commit(path_nodes, path_tokens)
        conf = float(v[:, 0].exp().mean())  # the target's top-1 probability at the accepted positions
        recent = self.turn_signals
        self.turn_signals = {"recent_al": 0.5 * recent["recent_al"] + 0.5 * acc.accepted,
                             "recent_target_conf": 0.5 * recent["recent_target_conf"] + 0.5 * conf}
        if self.planner is not None:  # learn acceptance by path score, and this turn's costs
            self.planner.acceptance.update(tree, prune_order(tree), set(inputs.node_ids[1:]), path_nodes[1:], emitted,
                                           self.sampling.greedy)

        stats.update(
            accepted=acc.accepted,
            tree_nodes=len(tree),
            verified_nodes=inputs.size - 1,
            budget=budget,
            turn_s=time.perf_counter() - turn_start,
        )
        stats["other_s"] = stats["turn_s"] - stats["small_s"] - stats["middle_s"] - stats["verify_s"]
        # what is not a model forward: tree building, n-gram lookups, masks, acceptance, cache compaction
        stats["outside_forward_s"] = stats["turn_s"] - stats["target_forward_s"] - stats["middle_forward_s"]
        if self.planner is not None:
            self.planner.observe(budget, stats["target_forward_s"], stats["turn_s"] - stats["target_forward_s"])
        if self.gate is not None and actions is None:
            self.gate.observe(len(emitted), stats["turn_s"], stats["middle_calls"], self._planner().verify_s(0))
        return emitted, stats

    # ------------------------------------------------------------------ public
    @torch.inference_mode()
    def generate(self, prompt_ids: Sequence[int] | torch.Tensor, max_new_tokens: int,
                 before_turn: Callable[[int, int], None] | None = None,
                 on_tokens: Callable[[list[int]], None] | None = None, min_new_tokens: int = 0) -> GenerationResult:
        """Decode ``prompt_ids``; ``before_turn(turn_index, root_token)``, if given, runs before each
        turn on the decoder's current state (e.g. to enumerate schedules there; it must leave the
        state as it found it); ``on_tokens(new)`` receives each turn's emitted tokens as they arrive
        (streaming). ``min_new_tokens``: no EOS among the first this many tokens, as transformers'
        option of that name (the verification holds EOS back in the target's own logits, so the output
        is still exactly the target's decoding under that rule)."""
        prompt_ids = prepare_prompt(prompt_ids, max_new_tokens, self.target)
        self.budget()
        if self.gate is not None:
            self._planner()  # the gate prices a plain step from the verification curve
            self.gate.reset()
        generator = make_generator(self.sampling, self.device)
        self.prompt_len = len(prompt_ids)

        start = time.perf_counter()
        self._prefill(prompt_ids)
        prefill_s = time.perf_counter() - start
        root = prompt_ids[-1]
        tokens: list[int] = []
        turns: list[dict] = []
        stop_reason = None
        self._min_new_tokens = int(min_new_tokens)
        while stop_reason is None:
            self._emitted = len(tokens)
            if before_turn is not None:
                before_turn(len(turns), root)
            emitted, stats = self._turn(root, generator)
            turns.append(stats)
            before = len(tokens)
            stop_reason = extend_until_stop(tokens, emitted, self.eos_ids, max_new_tokens)
            if on_tokens is not None:
                on_tokens(tokens[before:])
            root = emitted[-1]
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return GenerationResult(
            tokens=tokens,
            prompt_tokens=len(prompt_ids),
            wall_time_s=time.perf_counter() - start,
            prefill_time_s=prefill_s,
            stop_reason=stop_reason,
            turns=turns,
        )
