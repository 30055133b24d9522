"""The small drafter: n-gram lookup over the context, scored with the target's cached top-m.

The context (prompt + emitted tokens) is indexed by n-grams of orders 1..N, each mapped
to the positions where it ends; the index grows as tokens are emitted and is never rebuilt. For a
node, the last n tokens of context + path are looked up, longest n first; every occurrence proposes
the token that followed it, scored by the target's cached log-probability of that token at that
position (the top-m the target computed at prefill, and, with ``extend_cache``, at the positions it
verified since). A token outside the cached top-m gets a floor: the position's m-th log-probability
minus ``floor_penalty``; a position with no cache at all (``extend_cache=False`` past the prompt)
gets ``uncached_score``. Distinct tokens are collected over orders N..1 until m are found; within
an order, higher scores first. No match at any order proposes nothing.

Copy chains (our addition, ``copy_len`` > 0): where the context + path ends in an n-gram of order
>= ``copy_min_order`` seen before, :meth:`copy_chain` proposes the ``copy_len`` tokens that followed
its most recent occurrence, as one deep branch: what prompt lookup decoding drafts, inside the tree.

Chain mode (``mode: chain``, our addition, for engines whose verification cost grows with every row, as
llama.cpp's on a CPU): a turn's n-gram draft is one chain instead of a tree: at each depth the longest matching
n-gram's most frequent follower (the most recent among equals, :meth:`chain_kinds`), up to ``chain_len`` tokens,
each scored by the log of its kind's observed acceptance rate (matched order, depth, whether every occurrence
agreed), so a prefix's ``cum`` is the log-probability that it is accepted and the budget planner cuts the chain
where expected tokens per second are best. Why: on such a CPU a verified row past the first costs a fifth of a
step or more, and the tree's siblings (a second guess at a position) are rarely worth a row (docs/results: on a
Zen 5 the same chain, with rates fitted ahead of time on other prompts and cut by the replay's rule, made 1.18x
plain decoding where the n-gram tree made 1.05-1.07x). Chain mode shapes the n-gram drafter's tree steps only: a
neural small drafter and ``csd``'s cascade draft as they do in tree mode.

Scoring (``scoring``): ``target`` is the paper's (the cached target log-probability, or the floor);
copied tokens score at least the log of the copy rate. ``calibrated`` (our addition) scores a child by
the log of the rate at which children of its kind were accepted when their parent was: the kind is
(matched order, rank among that order's proposals, whether the target predicted the token where it
occurred) or ``copy`` (with the same agreement), counted from every turn
(:meth:`observe`; prior 0.3, copies 0.5). Why: the cached score says how likely the target found a
token *where it occurred*, which is a poor guide to whether it follows *now*: a unigram match's
continuation is usually wrong however confident the target was there, and an identifier copied from
the prompt was unlikely where it first appeared yet is a sure copy later. Calibrated scores make a
path's ``cum`` the log-probability that it is accepted, so pruning keeps deep copy chains over wide
shallow guesses, and the ranking inside an order still follows the target's cached scores.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

import torch

__all__ = ["NGramConfig", "NGramDrafter", "COPY", "CHAIN", "copy_kind"]

COPY = ("copy",)  # the kind of a copy chain's tokens (prefix of every copy kind: ("copy", order, first|next))
CHAIN = ("chain",)  # prefix of a chain-mode token's kind: ("chain", matched order, depth (capped at 2), unanimous)


def copy_kind(order: int, first: bool, agree: int = -1) -> tuple:
    """The kind of a copy chain's token: the matched order (capped at 4), whether it is the chain's
    first token, and whether the target predicted the copied token where it occurred
    (:meth:`NGramDrafter.agreement`). A chain's first token is accepted about as often as copying is going on
    at all; a later one, given its parent was accepted, far more often (the text is being copied): one rate for both
    would make the planner verify either too little of a running copy or too much of a stray one."""
    return (*COPY, min(int(order), 4), "first" if first else "next", int(agree))


@dataclass
class NGramConfig:
    max_n: int = 5
    top_m: int = 10
    extend_cache: bool = True
    floor_penalty: float = 2.0
    uncached_score: float = -12.0
    # only the most recent occurrences of an n-gram are read (bounds the cost for frequent unigrams)
    max_occurrences: int = 64
    # scores at prompt positions: log-softmax over the K most frequent tokens plus the prompt's own
    # (None: the full vocabulary); see TreeGraftDecoder._prefill
    prefill_vocab: int | None = 8192
    copy_len: int = 24  # tokens of a copy chain under the root (0: none)
    copy_min_order: int = 2  # shortest matched n-gram that starts a copy chain
    scoring: str = "calibrated"  # target (cached target log-probabilities) | calibrated (observed acceptance rates)
    # the target's top-m at the prompt's positions too (false: generated positions only; the prompt's rows then
    # need no logits, which on llama.cpp is the full LM head over every prompt row)
    prefill_scores: bool = True
    # calibrated: every rate times this prompt's observed / expected acceptances, with this many expected
    # acceptances of prior (None: rates shared by every prompt alike)
    prompt_prior: float | None = 4.0
    # tree: up to top_m children per expanded node, plus the copy chain | chain: one chain a turn (chain_len deep)
    mode: str = "tree"
    chain_len: int = 8

    def __post_init__(self) -> None:
        if self.max_n < 1 or self.top_m < 1:
            raise ValueError(f"ngram max_n and top_m must be >= 1, got {self.max_n}, {self.top_m}")
        if self.scoring not in ("target", "calibrated"):
            raise ValueError(f"ngram scoring must be target or calibrated, got {self.scoring!r}")
        if self.mode not in ("tree", "chain"):
            raise ValueError(f"ngram mode must be tree or chain, got {self.mode!r}")
        if self.mode == "chain" and (self.scoring != "calibrated" or self.chain_len < 1):
            raise ValueError(f"ngram mode chain needs scoring calibrated and chain_len >= 1, got scoring "
                             f"{self.scoring!r}, chain_len {self.chain_len}")
        if self.prompt_prior is not None and self.prompt_prior <= 0:
            raise ValueError(f"ngram prompt_prior must be > 0 or null, got {self.prompt_prior}")



class NGramDrafter:
    """Incremental n-gram index + target top-m cache. Call :meth:`reset`, then :meth:`append` per turn."""

    def __init__(self, cfg: NGramConfig | None = None):
        self.cfg = cfg or NGramConfig()
        self.tokens: list[int] = []
        self.index: list[dict[tuple, list[int]]] = []
        # per position p: ({token: logprob} of the target's next-token distribution at p, floor score, its top-1)
        self.scores: list[tuple[dict[int, float], float, int] | None] = []
        self.prompt_len = 0
        # acceptance counts per kind of child (see `scoring`), kept across prompts: kind -> [hits, seen]
        self.rates: dict[tuple, list[float]] = {}
        # this prompt's accepted children and the sum of their kinds' rates when they were observed
        self.prompt_hits = self.prompt_expected = 0.0

    def reset(self, prompt_ids: list[int], top_ids, top_logprobs) -> None:
        """Index the prompt; ``top_ids``/``top_logprobs`` [T', m] (host tensors or nested lists) are the
        target's top-m at positions 0..T'-1."""
        self.tokens = []
        self.index = [defaultdict(list) for _ in range(self.cfg.max_n + 1)]
        self.scores = []
        self.prompt_len = len(prompt_ids)
        self.prompt_hits = self.prompt_expected = 0.0
        self.append(prompt_ids)
        self.set_scores(0, top_ids, top_logprobs)

    def append(self, new_tokens: list[int]) -> None:
        """Extend the context (and its index) with emitted tokens."""
        toks = self.tokens
        for token in new_tokens:
            toks.append(int(token))
            self.scores.append(None)
            end = len(toks) - 1
            for n in range(1, min(self.cfg.max_n, end + 1) + 1):
                self.index[n][tuple(toks[end - n + 1 : end + 1])].append(end)

    def set_scores(self, start: int, top_ids: torch.Tensor | list[list[int]],
                   top_logprobs: torch.Tensor | list[list[float]]) -> None:
        """Cache the target's top-m at positions ``start .. start + len(top_ids) - 1`` (host tensors or lists)."""
        ids = top_ids.tolist() if isinstance(top_ids, torch.Tensor) else top_ids
        lps = top_logprobs.float().tolist() if isinstance(top_logprobs, torch.Tensor) else top_logprobs
        penalty = self.cfg.floor_penalty
        for offset, (row_ids, row_lps) in enumerate(zip(ids, lps)):
            pos = start + offset
            if pos >= len(self.scores):
                break
            if not row_ids:  # an unscored row (a prompt encoded without logits)
                continue
            if pos >= self.prompt_len and not self.cfg.extend_cache:
                continue
            self.scores[pos] = (dict(zip(row_ids, row_lps)), row_lps[-1] - penalty, int(row_ids[0]))

    @property
    def reads_scores(self) -> bool:
        """Whether the tree steps' drafts read the target's cached top-m (:meth:`set_scores`): chain mode's chain
        scores by its kinds' rates alone. :meth:`propose` always reads it (``csd``'s cascade calls it in either mode:
        ``TreeBuilder.reads_ngram_scores`` says what a construction needs)."""
        return self.cfg.mode == "tree"

    def _score(self, pos: int, token: int) -> float:
        return self._score_and_agreement(pos, token)[0]

    def _score_and_agreement(self, pos: int, token: int) -> tuple[float, int]:
        """:meth:`_score` and :meth:`agreement` from one read of the position's cache (the lookup's inner loop)."""
        cached = self.scores[pos]
        if cached is None:
            return self.cfg.uncached_score, -1
        table, floor, top = cached
        return table.get(token, floor), int(top == token)

    def agreement(self, pos: int, token: int) -> int:
        """Did the target itself predict ``token`` after position ``pos``: 1 (its top-1 there), 0 (not), -1
        (no cached distribution at ``pos``). Under greedy decoding every emitted token agrees; a prompt token
        agrees where the prompt is text the target would have written (code it is asked to repeat, a list
        it continues) and not where it is the user's own wording, which the output rarely copies."""
        return self._score_and_agreement(pos, token)[1]

    def shared_rate(self, kind: tuple) -> float:
        """P(a child of this kind is accepted | its parent was), over every prompt so far: observed, with a
        prior of weight 2."""
        hits, seen = self.rates.get(kind, (0.0, 0.0))
        if kind[: len(COPY)] == COPY:
            prior = 0.8 if kind[2] == "next" else 0.5
        else:
            prior = 0.3
        return (hits + 2 * prior) / (seen + 2)

    def prompt_factor(self) -> float:
        """How much more (> 1) or less often than its kinds' shared rates said this prompt's children were
        accepted: (hits + c) / (expected + c), c = ``prompt_prior``. Why: how predictable a text is differs
        by prompt (an answer restating its question, code, a free essay) more than any kind says; an essay's
        unigram continuations are accepted half as often as the average prompt's."""
        c = self.cfg.prompt_prior
        return 1.0 if c is None else (self.prompt_hits + c) / (self.prompt_expected + c)

    def rate(self, kind: tuple) -> float:
        """:meth:`shared_rate` times :meth:`prompt_factor` (at most 0.99)."""
        return min(0.99, self.shared_rate(kind) * self.prompt_factor())

    def observe(self, outcomes: list[tuple[tuple, bool]]) -> None:
        """Count (kind, accepted) outcomes of children whose parent was accepted."""
        for kind, hit in outcomes:
            self.prompt_expected += self.shared_rate(kind)
            self.prompt_hits += float(hit)
            counts = self.rates.setdefault(kind, [0.0, 0.0])
            counts[0] += float(hit)
            counts[1] += 1.0

    def propose(self, path: list[int], m: int | None = None) -> tuple[list[tuple[int, float]], int]:
        """Up to ``m`` (token, score) children for the node whose path below the root is ``path``.

        The sequence looked up is context + path (the root is the context's last token). Returns the
        children (best first within each order, longer orders first) and the longest matched order
        (0 when nothing matched).
        """
        children, match = self.propose_kinds(path, m)
        return [(token, score) for token, score, _ in children], match

    def propose_kinds(self, path: list[int], m: int | None = None) -> tuple[list[tuple[int, float, tuple]], int]:
        """:meth:`propose` with each child's kind ``(order, rank, agree)``: rank among its order (capped at 2),
        agree the best :meth:`agreement` over the occurrences that proposed it."""
        m = m or self.cfg.top_m
        toks = self.tokens
        n_max = self.cfg.max_n
        tail = toks[-n_max:] + path if len(path) < n_max else path
        tail = tail[-n_max:]
        calibrated = self.cfg.scoring == "calibrated"
        found: set[int] = set()
        out: list[tuple[int, float, tuple]] = []
        match = 0
        for n in range(min(n_max, len(tail)), 0, -1):
            level: dict[int, float] = {}
            agree: dict[int, int] = {}
            for end, nxt in self._followers(tail, n):
                if nxt in found:
                    continue
                score, agrees = self._score_and_agreement(end, nxt)
                if score > level.get(nxt, float("-inf")):
                    level[nxt] = score
                agree[nxt] = max(agree.get(nxt, -1), agrees)
            if level:
                match = max(match, n)
            for rank, (token, score) in enumerate(sorted(level.items(), key=lambda kv: -kv[1])):
                kind = (n, min(rank, 2), agree[token])
                found.add(token)
                out.append((token, math.log(self.rate(kind)) if calibrated else score, kind))
                if len(out) >= m:
                    return out, match
        return out, match

    def _followers(self, tail: list[int], n: int) -> list[tuple[int, int]]:
        """(end, follower) of the last ``max_occurrences`` occurrences of the n-gram ending ``tail``, oldest first,
        but the one ending at the newest token (it has no follower yet); [] where the n-gram never occurred."""
        ends = self.index[n].get(tuple(tail[-n:]))
        if not ends:
            return []
        toks, last = self.tokens, len(self.tokens) - 1
        return [(end, toks[end + 1]) for end in ends[-self.cfg.max_occurrences:] if end < last]

    def copy_chain(self, path: list[int], max_len: int | None = None) -> list[tuple[int, float]]:
        """The tokens that followed the most recent occurrence of the longest n-gram (order >=
        ``copy_min_order``) ending context + path, as (token, score) pairs; [] when there is none."""
        return [(token, score) for token, score, _ in self.copy_chain_kinds(path, max_len)]

    def copy_chain_kinds(self, path: list[int], max_len: int | None = None) -> list[tuple[int, float, tuple]]:
        """:meth:`copy_chain` with each token's :func:`copy_kind`; calibrated scores are per kind."""
        max_len = self.cfg.copy_len if max_len is None else max_len
        if max_len <= 0:
            return []
        toks = self.tokens
        n_max = self.cfg.max_n
        tail = (toks[-n_max:] + path)[-n_max:]
        last = len(toks) - 1
        calibrated = self.cfg.scoring == "calibrated"
        for n in range(min(n_max, len(tail)), self.cfg.copy_min_order - 1, -1):
            ends = [e for e in self.index[n].get(tuple(tail[-n:]), ()) if e < last]
            if not ends:
                continue
            start = ends[-1]
            chain = []
            for pos in range(start, min(last, start + max_len)):
                token = toks[pos + 1]
                kind = copy_kind(n, pos == start, self.agreement(pos, token))
                copy_score = math.log(self.rate(kind))
                chain.append((token, copy_score if calibrated else max(self._score(pos, token), copy_score), kind))
            return chain
        return []

    def chain_kinds(self, path: list[int], max_len: int | None = None) -> list[tuple[int, float, tuple]]:
        """Chain mode's draft below context + ``path``: up to ``max_len`` (``chain_len``) (token, score, kind)
        triples, each the longest matching n-gram's most frequent follower (the most recent among equals) of
        the sequence so far, drafted tokens included; kind ``("chain", order, min(depth, 2), unanimous)``,
        score the log of its rate. Stops where nothing matches."""
        max_len = self.cfg.chain_len if max_len is None else max_len
        n_max = self.cfg.max_n
        tail = (self.tokens[-n_max:] + list(path))[-n_max:]
        out: list[tuple[int, float, tuple]] = []
        for depth in range(max_len):
            hit = self._top_follower(tail)
            if hit is None:
                break
            token, order, unanimous = hit
            kind = (*CHAIN, order, min(depth, 2), int(unanimous))
            out.append((token, math.log(self.rate(kind)), kind))
            tail = (tail + [token])[-n_max:]
        return out

    def _top_follower(self, tail: list[int]) -> tuple[int, int, bool] | None:
        """(token, matched order, unanimous) of the longest n-gram ending ``tail`` that occurred with a follower:
        its most frequent follower over the last ``max_occurrences`` occurrences, the most recent among equals."""
        for n in range(min(self.cfg.max_n, len(tail)), 0, -1):
            counts: dict[int, int] = {}
            latest: dict[int, int] = {}
            for end, token in self._followers(tail, n):
                counts[token] = counts.get(token, 0) + 1
                latest[token] = end
            if counts:
                token = max(counts, key=lambda t: (counts[t], latest[t]))
                return token, n, len(counts) == 1
        return None
