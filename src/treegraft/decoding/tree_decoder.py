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

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from torch import nn

from ..drafters.middle import MiddleDrafter
from ..drafters.ngram import NGramConfig, NGramDrafter
from ..scheduling import FixedScheduler, Scheduler, StepState, frontier_of, tree_signals
from ..tree import MIDDLE, SMALL, DraftTree, build_tree_inputs, prune_to_budget
from .autoregressive import GenerationResult, eos_token_ids, extend_until_stop, make_generator, prepare_prompt
from ..model_io import cache_length, forward_hidden, keep_cache_positions, lm_logits, new_cache
from .sampling import SamplingConfig
from .verify import accept_greedy, accept_sampling

__all__ = ["TreeConfig", "TreeGraftDecoder", "MethodPreset", "METHOD_PRESETS"]


@dataclass(frozen=True)
class MethodPreset:
    """How a method builds its tree.

    shared: the shared-tree construction of SPEC 3.2 (asymmetric rescoring, grafting) rather than
        the single-drafter construction of SPEC 3.1.
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
    """Tree and drafter settings (SPEC section 3 defaults).

    method: a key of ``METHOD_PRESETS``: ``all_small`` / ``all_mid`` (single-drafter endpoints),
        ``fixed`` (shared tree, ``schedule``), ``all_call`` (shared tree, every step a call),
        ``no_nondestructive`` / ``no_expanded_selection`` (ablations of ``fixed``), ``csd`` (a
        Cascade-Speculative-Drafting chain: the middle drafter drafts D tokens, itself sped up by the
        n-gram drafter's proposals, and the target verifies the chain).
    depth: D drafting steps; width: W nodes expanded per step; top_m: children per expanded node.
    budget: B_ver, non-root nodes verified per turn, or ``"auto"`` (picked from the measured
        verification-latency curve, see :func:`treegraft.decoding.budget.pick_budget`).
    node_cap: construction stops adding nodes past this many.
    schedule: the fixed schedule (1 = call the middle drafter, 0 = skip) of ``fixed`` and the ablations.
    grafting / expanded_selection: override the method's preset (``nondestructive|destructive``, bool).
    max_calls_per_turn: optional per-turn budget of middle-drafter calls (later steps are forced to skip).
    skip_beyond_budget: leave out the work of a step that cannot change the pruned tree (every node it
        could add or rescore lies deeper than B_ver, so pruning would drop it); the verified tree is the
        same, only the wasted drafter calls go. Matters where B_ver is small (``auto`` on a CPU).
    """

    method: str = "all_small"
    depth: int = 5
    width: int = 10
    top_m: int = 10
    budget: int | str = 63
    node_cap: int = 511
    schedule: list[int] = field(default_factory=lambda: [1, 0, 1, 0, 1])
    grafting: str | None = None
    expanded_selection: bool | None = None
    max_calls_per_turn: int | None = None
    ngram: NGramConfig = field(default_factory=NGramConfig)
    auto_latency_ratio: float = 2.0
    auto_max_budget: int = 64
    skip_beyond_budget: bool = True

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
    ):
        self.target = target
        self.cfg = cfg or TreeConfig()
        self.sampling = sampling or SamplingConfig()
        self.eos_ids = set(eos_ids) if eos_ids is not None else eos_token_ids(target, tokenizer)
        self.device = next(target.parameters()).device
        self.middle = MiddleDrafter(middle) if middle is not None else None
        if scheduler is None and MIDDLE in self.cfg.actions() and self.middle is None:
            raise ValueError(f"method {self.cfg.method} calls the middle drafter, but none was given")
        self.ngram = NGramDrafter(self.cfg.ngram)
        self._budget: int | None = None if self.cfg.budget == "auto" else int(self.cfg.budget)
        self.verify_curve: dict[int, float] | None = None
        self.scheduler: Scheduler = scheduler or FixedScheduler(self.cfg.actions())
        # runtime context of the scheduler state (ms per target verification / middle forward),
        # measured by a warm-up; 0 = unknown
        self.t_tgt_ms = 0.0
        self.t_mid_ms = 0.0
        self.prompt_len = 0

    # ------------------------------------------------------------------ setup
    def budget(self) -> int:
        """B_ver; measured once per decoder when ``budget='auto'``."""
        if self._budget is None:
            from .budget import measure_verify_curve, pick_budget

            self.verify_curve = measure_verify_curve(self.target, context=256, max_size=self.cfg.auto_max_budget,
                                                     stop_ratio=self.cfg.auto_latency_ratio)
            self._budget = pick_budget(self.verify_curve, self.cfg.auto_latency_ratio)
        return self._budget

    def warm_up(self, prompt_ids: Sequence[int], max_new_tokens: int = 8) -> tuple[float, float]:
        """Measure the scheduler's runtime context on a warm-up generation that calls the middle
        drafter at every step (not scored): sets and returns (t_tgt_ms, t_mid_ms)."""
        saved = self.scheduler
        self.scheduler = FixedScheduler([MIDDLE] * self.cfg.depth) if self.middle is not None else saved
        try:
            result = self.generate(prompt_ids, max_new_tokens)
        finally:
            self.scheduler = saved
        turns = result.turns
        self.t_tgt_ms = 1000 * sum(t["target_forward_s"] for t in turns) / max(len(turns), 1)
        calls = sum(t["middle_calls"] for t in turns)
        self.t_mid_ms = 1000 * sum(t["middle_forward_s"] for t in turns) / calls if calls else 0.0
        return self.t_tgt_ms, self.t_mid_ms

    def _prefill(self, prompt_ids: list[int]) -> None:
        """Target cache over prompt[:-1], target top-m at those positions, n-gram index, middle cache."""
        self.cache = new_cache()
        ctx = prompt_ids[:-1]
        m = self.cfg.ngram.top_m
        top_ids = torch.zeros(0, m, dtype=torch.long)
        top_lps = torch.zeros(0, m)
        if ctx:
            toks = torch.tensor(ctx, device=self.device)
            hidden = forward_hidden(self.target, self.cache, toks, torch.arange(len(ctx), device=self.device), None)
            ids, lps = [], []
            for chunk in hidden.split(64):  # bounded memory: [64, V] logits at a time
                logp = torch.log_softmax(lm_logits(self.target, chunk), dim=-1)
                v, i = logp.topk(m, dim=-1)
                ids.append(i.cpu())
                lps.append(v.cpu())
            top_ids, top_lps = torch.cat(ids), torch.cat(lps)
        self.ngram.reset(prompt_ids, top_ids, top_lps)
        if self.middle is not None:
            self.middle.reset(prompt_ids)

    # ------------------------------------------------------------------ drafting
    def _expand_small(self, tree: DraftTree, nodes: list[int], step: int, stats: dict) -> None:
        start = time.perf_counter()
        cap = self.cfg.node_cap
        for node in nodes:
            children, _ = self.ngram.propose(tree.path_tokens(node), self.cfg.top_m)
            for token, score in children:
                if len(tree) >= cap:
                    break
                tree.add_child(node, token, score, SMALL, step)
        elapsed = time.perf_counter() - start
        stats["small_s"] += elapsed
        stats["small_propose_s"] = stats.get("small_propose_s", 0.0) + elapsed  # lookups only (per-call cost)
        stats["small_calls"] += len(nodes)

    def _expand_middle(self, tree: DraftTree, nodes: list[int], step: int, stats: dict) -> None:
        start = time.perf_counter()
        mid = self.middle
        before = mid.forward_s
        mid.encode(tree, nodes)
        stats["middle_forward_s"] += mid.forward_s - before
        m, cap = self.cfg.top_m, self.cfg.node_cap
        for node in nodes:
            lp, ids = mid.logprobs[node].topk(m)
            for token, score in zip(ids.tolist(), lp.tolist()):
                if len(tree) >= cap:
                    break
                tree.add_child(node, token, score, MIDDLE, step)
        stats["middle_s"] += time.perf_counter() - start
        stats["middle_calls"] += 1

    def _top_w(self, tree: DraftTree, pool: list[int]) -> list[int]:
        """The W best pool nodes by cum (ties: shallower, then earlier created)."""
        pool = sorted(pool, key=lambda n: (-tree.cum[n], tree.depth[n], n))
        return pool[: self.cfg.width]

    def _newest_pool(self, tree: DraftTree, step: int) -> list[int]:
        """The nodes created at the previous step (the root at step 1); empty if that step added none,
        in which case the step adds nothing (a later shared middle step can still graft anywhere)."""
        return [0] if step == 1 else tree.nodes_created_at(step - 1)

    def _graft_middle(self, tree: DraftTree, step: int, stats: dict) -> None:
        """A shared-tree middle step (SPEC 3.2): rescore every node under q_m, select anywhere, graft."""
        start = time.perf_counter()
        mid = self.middle
        preset = self.cfg.preset
        before = mid.forward_s
        alive = tree.alive_nodes()
        parents = [n for n in alive if tree.children[n]]
        # one incremental forward over every node not yet encoded; q_m at every node with children
        mid.encode(tree, alive, need_logprobs=parents)
        for n in alive[1:]:  # asymmetric scoring: the middle drafter recomputes every edge and cum
            tree.edge[n] = float(mid.logprobs[tree.parent[n]][tree.token[n]])
        tree.recompute_cum(0)
        if preset.expanded_selection:
            pool = [n for n in alive if not tree.visited[n]]
        else:
            pool = [n for n in self._newest_pool(tree, step) if not tree.visited[n]]
        selected = self._top_w(tree, pool)
        mid.encode(tree, selected)  # already encoded: this only adds their log-probability rows
        stats["middle_forward_s"] += mid.forward_s - before
        m, cap = self.cfg.top_m, self.cfg.node_cap
        for node in selected:
            if not tree.alive[node]:  # removed by a destructive graft above it in this same step
                continue
            tree.visited[node] = True
            if preset.grafting == "destructive":
                tree.remove_subtrees_below(node)
            lp, ids = mid.logprobs[node].topk(m)
            for token, score in zip(ids.tolist(), lp.tolist()):
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
        if self.cfg.preset.expanded_selection:
            pool = [n for n in range(len(tree)) if alive[n] and not tree.visited[n]]
        else:
            pool = [n for n in self._newest_pool(tree, step) if not tree.visited[n]]
        return all(depth[n] >= horizon for n in pool)

    def step_state(self, tree: DraftTree, step: int, history: list[int], with_signals: bool) -> StepState:
        """The scheduler's view before step ``step``'s action (SPEC 5.1)."""
        signals = None
        if with_signals:
            frontier = frontier_of(tree, step)
            match, top1 = 0, None
            if frontier:
                best = min(frontier, key=lambda n: (-tree.cum[n], tree.depth[n], n))
                children, match = self.ngram.propose(tree.path_tokens(best), self.cfg.top_m)
                top1 = children[0][1] if children else None
            signals = tree_signals(tree, step, self.cfg.width, match, top1)
        return StepState(step=step, depth=self.cfg.depth, history=list(history), prompt_len=self.prompt_len,
                         t_tgt_ms=self.t_tgt_ms, t_mid_ms=self.t_mid_ms, signals=signals)

    def _build_csd_chain(self, root_token: int, stats: dict) -> DraftTree:
        """A D-token chain drafted by the middle drafter, whose own drafts come from the n-gram drafter.

        Each round the n-gram drafter proposes a greedy chain below the current end; one middle
        forward scores it; the middle keeps the longest prefix equal to its own argmax choices and
        adds its argmax after it (a lossless greedy cascade at the drafting level).
        """
        tree = DraftTree.with_root(root_token)
        mid = self.middle
        mid.start_turn()
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
                if int(torch.argmax(logp)) != tree.token[node]:
                    break
                tree.edge[node] = float(logp[tree.token[node]])
                tree.cum[node] = tree.cum[cur] + tree.edge[node]
                cur = node
            tree.remove_subtrees_below(cur)  # the middle drafter's rejection of the rest
            logp = mid.logprobs[cur]
            best = int(torch.argmax(logp))
            end = tree.add_child(cur, best, float(logp[best]), MIDDLE, tree.depth[cur] + 1)
            stats["middle_s"] += time.perf_counter() - t1
        stats["schedule"] = [MIDDLE] * depth
        return tree

    def build_tree(self, root_token: int, actions: Sequence[int] | None, stats: dict) -> DraftTree:
        """Build one turn's tree, step t done by ``actions[t-1]`` (0 = n-gram drafter, 1 = middle drafter),
        or by the scheduler's decision before each step when ``actions`` is None.

        Single-drafter methods (SPEC 3.1): step 1 expands the root, step t the top W of the nodes
        created at step t-1, with stored scores. Shared-tree methods (SPEC 3.2): the small step is
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
        (``truncate_cache(cache, int(inputs.position_ids[0]))``).
        """
        kept = prune_to_budget(tree, self.budget())
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

        def row_logits(row: int) -> torch.Tensor:
            t0 = time.perf_counter()
            out = lm_logits(self.target, hidden[row])
            stats["target_forward_s"] += time.perf_counter() - t0
            return out

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
        self.ngram.append(emitted)
        if self.cfg.ngram.extend_cache:
            logp = torch.log_softmax(torch.stack(acc.logits), dim=-1)
            v, i = logp.topk(self.cfg.ngram.top_m, dim=-1)
            self.ngram.set_scores(L, i.cpu(), v.cpu())
        stats["small_s"] += time.perf_counter() - start
        if self.middle is not None:
            self.middle.commit(path_nodes, path_tokens)

        stats.update(
            accepted=acc.accepted,
            tree_nodes=len(tree),
            verified_nodes=inputs.size - 1,
            turn_s=time.perf_counter() - turn_start,
        )
        stats["other_s"] = stats["turn_s"] - stats["small_s"] - stats["middle_s"] - stats["verify_s"]
        # what is not a model forward: tree building, n-gram lookups, masks, acceptance, cache compaction
        stats["outside_forward_s"] = stats["turn_s"] - stats["target_forward_s"] - stats["middle_forward_s"]
        return emitted, stats

    # ------------------------------------------------------------------ public
    @torch.inference_mode()
    def generate(self, prompt_ids: Sequence[int] | torch.Tensor, max_new_tokens: int,
                 before_turn: Callable[[int, int], None] | None = None) -> GenerationResult:
        """Decode ``prompt_ids``; ``before_turn(turn_index, root_token)``, if given, runs before each
        turn on the decoder's current state (e.g. to enumerate schedules there; it must leave the
        state as it found it)."""
        prompt_ids = prepare_prompt(prompt_ids, max_new_tokens, self.target)
        self.budget()
        generator = make_generator(self.sampling, self.device)
        self.prompt_len = len(prompt_ids)

        start = time.perf_counter()
        self._prefill(prompt_ids)
        prefill_s = time.perf_counter() - start
        root = prompt_ids[-1]
        tokens: list[int] = []
        turns: list[dict] = []
        stop_reason = None
        while stop_reason is None:
            if before_turn is not None:
                before_turn(len(turns), root)
            emitted, stats = self._turn(root, generator)
            turns.append(stats)
            stop_reason = extend_until_stop(tokens, emitted, self.eos_ids, max_new_tokens)
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
