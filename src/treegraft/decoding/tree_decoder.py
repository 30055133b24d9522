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
from typing import Sequence

import torch
from torch import nn

from ..drafters.middle import MiddleDrafter
from ..drafters.ngram import NGramConfig, NGramDrafter
from ..tree import MIDDLE, SMALL, DraftTree, build_tree_inputs, prune_to_budget
from .autoregressive import GenerationResult, context_window, eos_token_ids, validate_prompt
from ..model_io import cache_length, forward_hidden, keep_cache_positions, lm_logits, new_cache
from .sampling import SamplingConfig
from .verify import accept_greedy, accept_sampling

__all__ = ["TreeConfig", "TreeGraftDecoder", "METHOD_SCHEDULES", "schedule_for"]

# Single-drafter endpoints: every step by one drafter (SPEC 3.1).
METHOD_SCHEDULES = {"all_small": SMALL, "all_mid": MIDDLE}


@dataclass
class TreeConfig:
    """Tree and drafter settings (SPEC section 3 defaults).

    method: ``all_small`` (every step by the n-gram drafter) or ``all_mid`` (every step by the middle drafter).
    depth: D drafting steps; width: W nodes expanded per step; top_m: children per expanded node.
    budget: B_ver, non-root nodes verified per turn, or ``"auto"`` (picked from the measured
        verification-latency curve, see :func:`treegraft.decoding.budget.pick_budget`).
    node_cap: construction stops adding nodes past this many.
    """

    method: str = "all_small"
    depth: int = 5
    width: int = 10
    top_m: int = 10
    budget: int | str = 63
    node_cap: int = 511
    ngram: NGramConfig = field(default_factory=NGramConfig)
    auto_latency_ratio: float = 2.0
    auto_max_budget: int = 64

    def __post_init__(self) -> None:
        if isinstance(self.ngram, dict):
            self.ngram = NGramConfig(**self.ngram)
        if self.method not in METHOD_SCHEDULES:
            raise ValueError(f"unknown tree method {self.method!r}; expected one of {sorted(METHOD_SCHEDULES)}")
        for name in ("depth", "width", "top_m", "node_cap"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.budget != "auto" and int(self.budget) < 0:
            raise ValueError(f"budget must be an int >= 0 or 'auto', got {self.budget!r}")


def schedule_for(method: str, depth: int) -> list[int]:
    return [METHOD_SCHEDULES[method]] * depth


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
    ):
        self.target = target
        self.cfg = cfg or TreeConfig()
        self.sampling = sampling or SamplingConfig()
        self.eos_ids = set(eos_ids) if eos_ids is not None else eos_token_ids(target, tokenizer)
        self.device = next(target.parameters()).device
        self.middle = MiddleDrafter(middle) if middle is not None else None
        if self.cfg.method == "all_mid" and self.middle is None:
            raise ValueError("method all_mid needs a middle drafter")
        self.ngram = NGramDrafter(self.cfg.ngram)
        self._budget: int | None = None if self.cfg.budget == "auto" else int(self.cfg.budget)
        self.verify_curve: dict[int, float] | None = None

    # ------------------------------------------------------------------ setup
    def budget(self) -> int:
        """B_ver; measured once per decoder when ``budget='auto'``."""
        if self._budget is None:
            from .budget import measure_verify_curve, pick_budget

            self.verify_curve = measure_verify_curve(self.target, context=256, max_size=self.cfg.auto_max_budget)
            self._budget = pick_budget(self.verify_curve, self.cfg.auto_latency_ratio)
        return self._budget

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
        stats["small_s"] += time.perf_counter() - start
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
        pool = sorted(pool, key=lambda n: (-tree.cum[n], tree.depth[n], n))
        return pool[: self.cfg.width]

    def build_tree(self, root_token: int, schedule: Sequence[int], stats: dict) -> DraftTree:
        """Single-drafter construction (SPEC 3.1): step 1 expands the root, step t the top W of step t-1's nodes."""
        tree = DraftTree.with_root(root_token)
        if self.middle is not None:
            self.middle.start_turn()
        for step, action in enumerate(schedule, start=1):
            pool = [0] if step == 1 else tree.nodes_created_at(step - 1)
            if not pool or len(tree) >= self.cfg.node_cap:
                break
            selected = self._top_w(tree, pool)
            if action == MIDDLE:
                self._expand_middle(tree, selected, step, stats)
            else:
                self._expand_small(tree, selected, step, stats)
        return tree

    # ------------------------------------------------------------------ one turn
    def _turn(self, root: int, generator, schedule: Sequence[int]) -> tuple[list[int], dict]:
        turn_start = time.perf_counter()
        stats = {"small_s": 0.0, "middle_s": 0.0, "verify_s": 0.0, "small_calls": 0, "middle_calls": 0,
                 "target_forward_s": 0.0, "middle_forward_s": 0.0}
        tree = self.build_tree(root, schedule, stats)
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
        keep = torch.cat([torch.arange(L), L + torch.tensor(acc.rows, dtype=torch.long)])
        keep_cache_positions(self.cache, keep)
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
            verified_nodes=len(kept),
            schedule=list(schedule),
            turn_s=time.perf_counter() - turn_start,
        )
        stats["other_s"] = stats["turn_s"] - stats["small_s"] - stats["middle_s"] - stats["verify_s"]
        # what is not a model forward: tree building, n-gram lookups, masks, acceptance, cache compaction
        stats["outside_forward_s"] = stats["turn_s"] - stats["target_forward_s"] - stats["middle_forward_s"]
        return emitted, stats

    # ------------------------------------------------------------------ public
    @torch.inference_mode()
    def generate(self, prompt_ids: Sequence[int] | torch.Tensor, max_new_tokens: int) -> GenerationResult:
        if isinstance(prompt_ids, torch.Tensor):
            prompt_ids = prompt_ids.flatten().tolist()
        prompt_ids = [int(t) for t in prompt_ids]
        # a turn may write up to B_ver + 1 positions past the committed context before compaction
        validate_prompt(prompt_ids, max_new_tokens, context_window(self.target))
        self.budget()
        generator = None
        if not self.sampling.greedy:
            generator = torch.Generator(device=self.device).manual_seed(self.sampling.seed)
        schedule = schedule_for(self.cfg.method, self.cfg.depth)

        start = time.perf_counter()
        self._prefill(prompt_ids)
        prefill_s = time.perf_counter() - start
        root = prompt_ids[-1]
        tokens: list[int] = []
        turns: list[dict] = []
        stop_reason = "max_new_tokens"
        while len(tokens) < max_new_tokens:
            emitted, stats = self._turn(root, generator, schedule)
            turns.append(stats)
            for token in emitted:
                tokens.append(token)
                if token in self.eos_ids:
                    stop_reason = "eos"
                    break
                if len(tokens) >= max_new_tokens:
                    break
            if stop_reason == "eos":
                break
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
