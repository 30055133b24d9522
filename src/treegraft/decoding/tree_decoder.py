"""Lossless tree speculative decoding with an n-gram drafter and a middle drafter.

Usage (no Hydra needed)::

    from treegraft.engines.torch import TorchEngines
    from treegraft.front import decoder_for
    decoder = decoder_for("all_mid", TorchEngines(target, middle, tokenizer))
    result = decoder.generate(prompt_ids, max_new_tokens=256)
    result.tokens, result.turns  # new tokens; per-turn records (AL, tree size, time split)

A turn builds a draft tree over D drafting steps (each done by the small drafter, the n-gram drafter
by default or a small neural drafter (:mod:`treegraft.drafters.small`), or by the middle LM;
:mod:`treegraft.decoding.builders`), prunes it to the verification budget, verifies it with
one target forward using tree attention, accepts the longest matching path plus one bonus token, and
keeps only the accepted entries in every KV cache. Greedy output equals the target's own greedy
decoding; sampled output has the target's distribution. Every turn also records which accepted
tokens lie on branches only non-destructive grafting kept (:meth:`DraftTree.note_graft`), and a
generation keeps up to two such turns as traces (``GenerationResult.grafting_examples``). The models
sit behind the engine protocols (:mod:`treegraft.engines.protocols`): this module never touches a model or
a cache itself.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable, Sequence

import torch

from ..devices import Clock
from ..drafters.ngram import NGramDrafter
from ..drafters.small import SmallDrafterConfig, small_config
from ..engines.protocols import DraftModel, TargetEngine
from ..paths import default_cache_dir
from ..scheduling import FixedScheduler, Scheduler, StepState, frontier_of, tree_signals
from ..tree import SMALL, DraftTree, prune_order, prune_to_budget
from .autoregressive import GenerationResult, extend_until_stop, hold_eos_rows, make_generator, prepare_prompt
from .backoff import CallGate
from .budget import BudgetPlanner
from .runtime_context import RuntimeContext
from .builders import BuildState, TurnPlan, builder_for
from .sampling import SamplingConfig
from .tree_config import METHOD_PRESETS, MethodPreset, TreeConfig, auto_shape
from .turn_stats import TurnStats
from .traces import decoded_trace, grafting_counts, keep_trace, trace_of
from .verify import verify_tree

__all__ = ["TreeConfig", "TreeGraftDecoder", "calls_middle", "MethodPreset", "METHOD_PRESETS", "SmallDrafterConfig",
           "auto_shape"]



def calls_middle(cfg: TreeConfig, scheduler: Scheduler | None) -> bool:
    """Whether a decoder of ``cfg`` may call the middle drafter: every method but ``all_small`` (a schedule
    of skips only), and any method a learned policy decides."""
    return scheduler is not None or cfg.preset.schedule != "small"


class TreeGraftDecoder(RuntimeContext):
    """Tree speculative decoder; see the module docstring."""

    def __init__(
        self,
        engine: TargetEngine,
        middle: DraftModel | None = None,
        tokenizer=None,
        cfg: TreeConfig | None = None,
        sampling: SamplingConfig | None = None,
        eos_ids: set[int] | None = None,
        scheduler: Scheduler | None = None,
        cache_dir: str | Path | None = None,
        eager_middle_prefill: bool = False,
        small: SmallDrafterConfig | dict | None = None,
        small_drafter: DraftModel | None = None,
    ):
        """``engine``: the target's engine; ``middle``: the middle drafter's (None where the method never
        calls it: :func:`calls_middle`); both come from a pair's engines (:func:`treegraft.front.decoder_for`
        builds them). ``eager_middle_prefill``: encode the prompt into the middle drafter's cache at
        prefill (schedule enumeration wants every call's cost to be a call's own); by default the drafter
        catches up on the prompt at its first call, so a method or policy that does not call never pays
        for it and the time to the first turn is the target's prefill alone. ``small``: the small
        drafter's settings (:class:`~treegraft.drafters.small.SmallDrafterConfig` or its dict; None: the
        n-gram drafter); a neural one runs ``small_drafter`` (own KV cache, the middle drafter's restricted
        draft vocabulary)."""
        self.tokenizer = tokenizer
        self.cfg = cfg or TreeConfig()
        self.sampling = sampling or SamplingConfig()
        self.eos_ids = set(eos_ids or ())
        self.cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        self.engine: TargetEngine = engine
        self.device = self.engine.device
        may_call = calls_middle(self.cfg, scheduler)
        if may_call and scheduler is None and middle is None:
            raise ValueError(f"method {self.cfg.method} calls the middle drafter, but none was given")
        self.middle: DraftModel | None = middle if may_call else None
        self.small_cfg = small_config(small)
        if self.small_cfg.neural and small_drafter is None:
            raise ValueError(f"small drafter {self.small_cfg.name} needs its drafter engine (small_drafter)")
        self.small: DraftModel | None = small_drafter if self.small_cfg.neural else None  # None: the n-gram drafter
        # the one clock of every timed region: it waits for the target's and the drafters' devices
        self.clock = Clock([*self.engine.clock.devices, *(self.middle.clock.devices if self.middle is not None else ()),
                            *(self.small.clock.devices if self.small is not None else ())])
        self._eager_middle_prefill = eager_middle_prefill
        self.ngram = NGramDrafter(self.cfg.ngram)
        self.builder = builder_for(self.cfg, self.ngram, self.middle, self.clock, self.small, self.small_cfg.top_m)
        self._budget: int | None = None if self.cfg.budget == "auto" else int(self.cfg.budget)
        self.planner: BudgetPlanner | None = None
        self._plan: TurnPlan | None = None  # the current turn's (plan_turn)
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
        self._trace: dict | None = None  # the last turn's grafting trace (ids), where it accepted a kept branch

    # ------------------------------------------------------------------ setup
    @property
    def verify_curve(self) -> dict[int, float] | None:
        return self.planner.curve if self.planner is not None else None

    def _planner(self) -> BudgetPlanner:
        if self.planner is None:  # the verification curve is measured, or read from the cache, once
            curve = self.engine.verify_curve(self.cache_dir, self.cfg.auto_max_budget)
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

    def plan_turn(self) -> TurnPlan:
        """The next turn's :class:`~treegraft.decoding.builders.TurnPlan`, decided once: the planning
        budget, and from it W, m and the middle step's rescoring scope (``shape=auto``)."""
        budget = self.budget()
        if self.cfg.shape == "paper":
            width, top_m, scope = self.cfg.width, self.cfg.top_m, None
        else:
            width, top_m, scope = auto_shape(budget, self.cfg.width, self.cfg.top_m)
            if self.cfg.middle_scope is not None:
                scope = min(scope, int(self.cfg.middle_scope))
        return TurnPlan(budget, width, top_m, scope, budget if self.cfg.skip_beyond_budget else None)

    def _prefill(self, prompt_ids: list[int]) -> None:
        """The target's cache over prompt[:-1] and its top-m scores there (the n-gram drafter's), the
        drafter's index, the middle drafter's context."""
        top_m = self.cfg.ngram.top_m if self.cfg.ngram.prefill_scores else 0
        top_ids, top_lps = self.engine.prefill(prompt_ids, top_m, self.cfg.ngram.prefill_vocab)
        if isinstance(top_ids, torch.Tensor):  # an engine that hands back host tensors
            top_ids, top_lps = top_ids.tolist(), top_lps.float().tolist()
        if self._ngram_in_use:
            self.ngram.reset(prompt_ids, top_ids, top_lps)
        # the target's confidence on the prompt's last positions stands in for past turns' (first turn)
        last = [row for row in top_lps[-16:] if len(row)]
        conf = sum(math.exp(row[0]) for row in last) / len(last) if last else 0.0
        self.turn_signals = {"recent_al": 0.0, "recent_target_conf": conf}
        if self.middle is not None:
            self.middle.reset(prompt_ids, encode=self._eager_middle_prefill)
        if self.small is not None:
            self.small.reset(prompt_ids, encode=self._eager_middle_prefill)

    @property
    def _ngram_in_use(self) -> bool:
        """Whether the n-gram drafter is kept up: it is the small drafter, or the scheduler reads its match
        signals (with a neural small drafter and a fixed schedule its index would be work for nothing)."""
        return self.small is None or bool(self.scheduler.needs_signals)

    @property
    def _reads_ngram_scores(self) -> bool:
        """Whether anything reads the n-gram drafter's cached target scores: the construction's drafts, or the
        scheduler's n-gram signals (``propose``) where its tree kinds learn by them (in chain mode those kinds are
        never observed, so the signal is the same with or without the cache)."""
        return self.builder.reads_ngram_scores or (bool(self.scheduler.needs_signals) and self.ngram.reads_scores)

    # ------------------------------------------------------------------ drafting
    def step_state(self, tree: DraftTree, step: int, history: list[int], with_signals: bool) -> StepState:
        """The scheduler's view before step ``step``'s action (the scheduler state) in the current turn."""
        signals = None
        if with_signals:
            plan = self._plan or self.plan_turn()
            frontier = frontier_of(tree, step)
            match, top1 = 0, None
            if frontier:
                best = min(frontier, key=lambda n: (-tree.cum[n], tree.depth[n], n))
                children, match = self.ngram.propose(tree.path_tokens(best), plan.top_m)
                top1 = children[0][1] if children else None
            extra = dict(self.turn_signals)
            if self.planner is not None:  # what the tree promises now, at the size the planner would verify
                al = self.planner.expected_al(tree)
                extra["expected_al"] = al[self.planner.best_budget(al)]
            signals = tree_signals(tree, step, plan.width, match, top1, extra)
        return StepState(step=step, depth=self.cfg.depth, history=list(history), prompt_len=self.prompt_len,
                         t_tgt_ms=self.t_tgt_ms, t_mid_ms=self.t_mid_ms, signals=signals)

    def start_tree(self, root_token: int) -> tuple[DraftTree, BuildState]:
        """A turn's root-only tree and its construction state, under this turn's plan (decided here)."""
        self._plan = self.plan_turn()
        return self.builder.start(root_token, self._plan)

    def apply_step(self, tree: DraftTree, build: BuildState, step: int, action: int, stats: TurnStats) -> None:
        """Do drafting step ``step`` with ``action`` (0 = n-gram drafter, 1 = middle drafter) in place."""
        self.builder.apply_step(tree, build, step, action, stats)

    def build_tree(self, root_token: int, actions: Sequence[int] | None, stats: TurnStats) -> DraftTree:
        """Build one turn's tree, step t done by ``actions[t-1]``, or by the scheduler's decision before
        each step when ``actions`` is None (or by the n-gram drafter while the call gate is closed)."""

        def decide(tree: DraftTree, build: BuildState, step: int) -> int:
            if actions is not None:
                return int(actions[step - 1])
            if self.gate is not None and not self.gate.is_open:
                stats.backed_off = True
                return SMALL
            t0 = self.clock.now()
            action = int(self.scheduler.decide(self.step_state(tree, step, build.done, self.scheduler.needs_signals)))
            stats.schedule_s += self.clock.now() - t0
            return action

        self._plan = self.plan_turn()
        return self.builder.build(root_token, self._plan, decide, stats)

    # ------------------------------------------------------------------ one turn
    def verify_tree(self, tree: DraftTree, stats: TurnStats, generator=None):
        """Prune ``tree`` to B_ver and verify it with one target forward (:func:`~.verify.verify_tree`)."""
        kept = prune_to_budget(tree, self.budget_for(tree))
        if self.planner is not None:
            acceptance, table = self.planner.acceptance, self.planner.acceptance.table()

            def p_accept(cum: float) -> float:
                return table[acceptance.bin_of(cum)]
        else:
            p_accept = math.exp
        hold = None
        if self._emitted < self._min_new_tokens:  # a row at depth d predicts new token emitted + d
            def hold(logits: torch.Tensor, depths: list[int]) -> torch.Tensor:
                return hold_eos_rows(logits, self.eos_ids, [self._emitted + d for d in depths], self._min_new_tokens)
        return verify_tree(self.engine, tree, kept, self.clock, stats, p_accept, self.sampling, generator, hold)

    def _middle_charged(self) -> float:
        """Seconds of a shared prompt encoding the middle drafter was charged since its reset (llama.cpp)."""
        return self.middle.charged_s if self.middle is not None else 0.0

    def _turn(self, root: int, generator, actions: Sequence[int] | None = None) -> tuple[list[int], TurnStats]:
        clock = self.clock
        turn_start = clock.now()
        charged = self._middle_charged()
        stats = TurnStats()
        tree = self.build_tree(root, actions, stats)
        inputs, acc = self.verify_tree(tree, stats, generator)
        budget = inputs.size - 1
        L = inputs.positions[0]  # the root sits at the context length
        start = clock.now()
        self.engine.keep(L, list(acc.rows))
        stats.verify_s += clock.now() - start

        path_nodes = [inputs.node_ids[r] for r in acc.rows]
        path_tokens = [tree.token[node] for node in path_nodes]
        emitted = path_tokens[1:] + [acc.bonus]
        # n-gram drafter: the context grows by the emitted tokens; where the construction reads its scores, the
        # target's top-m at the verified positions (root and accepted nodes) extends its score cache
        start = clock.now()
        ngram_in_use = self._ngram_in_use
        if ngram_in_use:
            self.ngram.observe(self.builder.ngram_outcomes(tree, set(inputs.node_ids), path_nodes, emitted,
                                                           self.sampling.greedy))
            self.ngram.append(emitted)
        if self.cfg.ngram.extend_cache and ngram_in_use and self._reads_ngram_scores:
            logp = torch.log_softmax(torch.stack(acc.logits).float(), dim=-1)
            m = min(self.cfg.ngram.top_m, logp.shape[-1])
            v, i = logp.topk(m, dim=-1)
            packed = torch.cat([i.double(), v.double()], dim=1).tolist()  # one host read: ids and log-probabilities
            top_ids, top_lps = [[int(t) for t in row[:m]] for row in packed], [row[m:] for row in packed]
            self.ngram.set_scores(L, top_ids, top_lps)
            top1 = [row[0] for row in top_lps]
        else:  # nothing reads the top-m: the top-1 log-probability alone (a top-m of 151,936 logits: 0.4-0.6 ms a row)
            rows = torch.stack(acc.logits).float()
            top1 = (rows.amax(dim=-1) - rows.logsumexp(dim=-1)).tolist()
        if self.small is not None:  # the neural small drafter keeps the accepted path's slots, queues the rest
            self.small.commit(path_nodes, path_tokens)
        stats.small_s += clock.now() - start
        if self.middle is not None:
            self.middle.commit(path_nodes, path_tokens)
        # grafting provenance: accepted tokens on branches only non-destructive grafting kept
        first = tree.first_kept(path_nodes)
        stats.grafts_kept = len(tree.grafts)
        stats.accepted_on_kept = len(path_nodes) - first if first is not None else 0
        self._trace = trace_of(tree, path_nodes, first, acc.bonus) if first is not None else None
        conf = sum(math.exp(lp) for lp in top1) / len(top1)  # the target's top-1 probability at the accepted positions
        recent = self.turn_signals
        self.turn_signals = {"recent_al": 0.5 * recent["recent_al"] + 0.5 * acc.accepted,
                             "recent_target_conf": 0.5 * recent["recent_target_conf"] + 0.5 * conf}
        if self.planner is not None:  # learn acceptance by path score, and this turn's costs
            self.planner.acceptance.update(tree, prune_order(tree), set(inputs.node_ids[1:]), path_nodes[1:], emitted,
                                           self.sampling.greedy)
        stats.accepted, stats.tree_nodes, stats.verified_nodes, stats.budget = acc.accepted, len(tree), budget, budget
        charged = self._middle_charged() - charged  # a shared prompt encoding, charged as if done here
        stats.middle_s += charged
        stats.turn_s = clock.now() - turn_start + charged
        stats.other_s = stats.turn_s - stats.small_s - stats.middle_s - stats.verify_s
        # what is not a model forward: tree building, n-gram lookups, masks, acceptance, cache compaction
        stats.outside_forward_s = stats.turn_s - stats.target_forward_s - stats.middle_forward_s - stats.small_forward_s
        if self.planner is not None:
            self.planner.observe(budget, stats.target_forward_s, stats.turn_s - stats.target_forward_s)
        if self.gate is not None and actions is None:
            self.gate.observe(len(emitted), stats.turn_s, stats.middle_calls, self._planner().verify_s(0))
        return emitted, stats

    # ------------------------------------------------------------------ public
    def release(self) -> None:
        """Free what only one generation needs: the KV caches and the prefill's restricted head (the
        next :meth:`generate` rebuilds them); :meth:`generate` calls it at its end, so a decoder kept
        between prompts holds no cache on the device."""
        self.engine.release()
        if self.middle is not None:
            self.middle.release()
        if self.small is not None:
            self.small.release()

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
        prompt_ids = prepare_prompt(prompt_ids, max_new_tokens, self.engine.context_window())
        self.budget()
        if self.gate is not None:  # the gate prices a plain step from the verification curve
            self.gate.reset(self._catch_up_estimate_s(len(prompt_ids)), max_new_tokens * self._planner().verify_s(0))
        generator = make_generator(self.sampling, self.engine.head_device)
        self.prompt_len = len(prompt_ids)

        clock = self.clock
        start = clock.now()
        self._prefill(prompt_ids)
        # a prompt encoding shared between decoders (llama.cpp's PromptReuse) counts in full
        start -= self.engine.prefill_charge_s + self._middle_charged()
        prefill_s = clock.now() - start
        charged = self._middle_charged()
        root = prompt_ids[-1]
        tokens: list[int] = []
        turns: list[dict] = []
        traces: list[dict] = []  # the turns that accepted the most tokens on kept branches (ids)
        stop_reason = None
        self._min_new_tokens = int(min_new_tokens)
        while stop_reason is None:
            self._emitted = len(tokens)
            if before_turn is not None:
                before_turn(len(turns), root)
            emitted, stats = self._turn(root, generator)
            if self._trace is not None:
                traces = keep_trace(traces, self._trace, len(turns), prompt_ids, tokens)
            turns.append(stats.record())
            before = len(tokens)
            stop_reason = extend_until_stop(tokens, emitted, self.eos_ids, max_new_tokens)
            if on_tokens is not None:
                on_tokens(tokens[before:])
            root = emitted[-1]
        wall_s = clock.now() - start + self._middle_charged() - charged
        self.release()
        return GenerationResult(
            tokens=tokens,
            prompt_tokens=len(prompt_ids),
            wall_time_s=wall_s,
            prefill_time_s=prefill_s,
            stop_reason=stop_reason,
            turns=turns,
            grafting=grafting_counts(turns),
            grafting_examples=[decoded_trace(t, self.tokenizer, self.small_cfg.name) for t in traces],
        )
