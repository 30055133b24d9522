"""The middle drafter: a causal LM with its own KV cache over the context and the draft tree.

The drafter's cache holds the committed context (it may lag behind: tokens emitted
while it was not called are *pending* and are encoded, as a causal chain, at the start of its next
call), then one slot per tree node it encoded this turn. A call encodes only the requested nodes
it has not encoded yet (and their unencoded ancestors), with tree attention: a node attends to the
context, the pending chain, and its ancestors' slots. After verification :meth:`commit` keeps the
slots of the accepted path that were encoded (a prefix of it) and queues the rest as pending, so
the cache never holds a rejected token. The prompt itself is pending after :meth:`reset`: a method
that never calls the drafter never pays for its prefill.

With a restricted draft vocabulary (:class:`~treegraft.drafters.vocab.SubsetHead`: the K most
frequent tokens plus every context token), log-probabilities are a log-softmax over that subset;
verification is untouched, so decoding stays lossless.
"""

from __future__ import annotations

import torch
from torch import nn

from ...devices import Clock, device_tensor, input_device, output_device
from ...model_io import (cache_length, check_attention, forward_hidden, head_weight, keep_cache_positions, lm_logits, logit_softcap,
                        new_cache, truncate_cache)
from ...tree import DraftTree
from ...drafters.vocab import SubsetHead, VocabSubset
from ..logprobs import TokenLogProbs

__all__ = ["MiddleDrafter"]


class MiddleDrafter:
    def __init__(self, model: nn.Module, draft_vocab: torch.Tensor | None = None):
        """``draft_vocab``: ids of a restricted draft vocabulary (LongTensor [K]); None = full vocabulary."""
        check_attention(model)
        self.model = model
        self.draft_vocab = draft_vocab
        self.head: SubsetHead | None = None
        self.device = input_device(model)  # token and position ids go here
        self.head_device = output_device(model)  # log-probabilities come out here
        self.clock = Clock.of(model)
        self.cache = None
        self.committed = 0  # cached context positions (before any tree slot)
        self.pending: list[int] = []  # context tokens not yet in the cache
        self.slot_of: dict[int, int] = {}  # tree node id -> cache position, this turn
        self.logprobs: dict[int, TokenLogProbs] = {}  # node id -> log q_m(. | node), this turn
        self.hidden: dict[int, torch.Tensor] = {}  # node id -> final hidden state [H], this turn
        self.calls = 0
        self.tokens_encoded = 0  # tokens through the model's forward (context catch-up and tree nodes)
        self.forward_s = 0.0  # seconds inside the model (forwards and LM-head rows), for the time split
        self.charged_s = 0.0  # never charged: every reset encodes its own prompt

    def reset(self, prompt_ids: list[int], encode: bool = False) -> None:
        """A new context: the prompt except its last token (the first turn's root), encoded now with
        ``encode``, else pending until the first call."""
        self.cache = new_cache()
        self.committed = 0
        self.pending = list(prompt_ids[:-1])
        self.slot_of, self.logprobs, self.hidden = {}, {}, {}
        if self.draft_vocab is not None:
            if self.head is None:
                weight = head_weight(self.model)
                subset = VocabSubset(self.draft_vocab, weight.shape[0], self.head_device)
                self.head = SubsetHead(weight, subset, logit_softcap(self.model))
            self.head.truncate(len(self.draft_vocab))
            self.head.add(prompt_ids)
        if encode and self.pending:
            start = self.clock.now()
            with torch.inference_mode():
                toks = device_tensor(self.pending, self.device)
                forward_hidden(self.model, self.cache, toks, torch.arange(len(self.pending), device=self.device), None)
            self.forward_s += self.clock.now() - start
            self.committed, self.pending = len(self.pending), []

    def release(self) -> None:
        """Drop the KV cache and this turn's rows (a finished generation's); the next :meth:`reset` starts anew.
        The restricted head keeps its frequent base rows (a few MB, reused by every prompt)."""
        self.cache = None
        self.slot_of, self.logprobs, self.hidden = {}, {}, {}

    def snapshot(self) -> tuple:
        """The turn state (cache length, context bookkeeping, this turn's slots and rows), for :meth:`restore`.

        Within a turn the cache only grows, so restoring is a truncation plus dict copies: schedules
        that share a prefix can branch from the same state without re-encoding it.
        """
        return (cache_length(self.cache), self.committed, list(self.pending), dict(self.slot_of),
                dict(self.logprobs), dict(self.hidden))

    def restore(self, snap: tuple) -> None:
        length, self.committed, pending, slot_of, logprobs, hidden = snap
        if cache_length(self.cache) > length:
            truncate_cache(self.cache, length)
        self.pending, self.slot_of, self.logprobs, self.hidden = list(pending), dict(slot_of), dict(logprobs), dict(hidden)

    def start_turn(self) -> None:
        """A new turn's tree: no slots yet, and the cache holds the committed context only (slots of a
        turn that was abandoned rather than committed, e.g. an enumeration's last branch, go)."""
        self.slot_of, self.logprobs, self.hidden = {}, {}, {}
        if self.cache is not None and cache_length(self.cache) > self.committed:
            truncate_cache(self.cache, self.committed)

    @property
    def context_len(self) -> int:
        """Length of the context (committed + pending): the position of the current root."""
        return self.committed + len(self.pending)

    @torch.inference_mode()
    def encode(self, tree: DraftTree, nodes: list[int], need_logprobs: list[int] | None = None) -> None:
        """Encode ``nodes`` (and unencoded ancestors) into the cache; fill ``self.logprobs`` for ``need_logprobs``.

        ``need_logprobs`` defaults to ``nodes``. Log-probabilities are float32 log-softmax rows, one
        matrix per call (no host read: :func:`scores` / :func:`topk` read them in batches).
        """
        need = list(nodes if need_logprobs is None else need_logprobs)
        new_nodes = tree.closure_missing(nodes, self.slot_of)
        if new_nodes or self.pending:
            self._forward(tree, new_nodes)
            self.calls += 1
        missing = [n for n in need if n not in self.logprobs]
        if missing:
            start = self.clock.now()
            rows = torch.stack([self.hidden[n] for n in missing])
            if self.head is None:
                logp = torch.log_softmax(lm_logits(self.model, rows), dim=-1)
                ids = pos_of = None
            else:
                logp = self.head.log_softmax(rows)
                ids, pos_of = self.head.subset.ids, self.head.subset.pos_of
            for i, node in enumerate(missing):
                self.logprobs[node] = TokenLogProbs(logp, i, ids, pos_of)
            self.forward_s += self.clock.now() - start

    def _forward(self, tree: DraftTree, new_nodes: list[int]) -> None:
        device = self.device
        past = cache_length(self.cache)
        ctx = self.context_len
        p = len(self.pending)
        q = p + len(new_nodes)
        tokens = device_tensor(self.pending + [tree.token[n] for n in new_nodes], device)
        positions = device_tensor(list(range(self.committed, ctx)) + [ctx + tree.depth[n] for n in new_nodes], device)
        # may-attend matrix [q, past + q], built on the device: the committed context for every row, the
        # pending chain causally, and each new node's ancestors (pending rows, earlier slots, new rows)
        allowed = torch.zeros(q, past + q, dtype=torch.bool, device=device)
        allowed[:, : self.committed] = True  # the committed context (tree slots never precede pending rows)
        if p:
            allowed[:p, past : past + p] = torch.ones(p, p, dtype=torch.bool, device=device).tril_()
            allowed[p:, past : past + p] = True
        row_of = {n: past + p + i for i, n in enumerate(new_nodes)}
        cells_r, cells_c = [], []
        for i, node in enumerate(new_nodes):
            n = node
            while n >= 0:
                cells_r.append(p + i)
                cells_c.append(row_of.get(n, self.slot_of.get(n)))
                n = tree.parent[n]
        key_pos = torch.arange(past + q, device=device)  # the committed context's own positions
        if cells_r:
            cells = device_tensor([cells_r, cells_c], device)
            allowed[cells[0], cells[1]] = True
        if self.slot_of:  # earlier slots of this turn sit at the context length plus their depth
            slots = device_tensor([list(self.slot_of.values()), [ctx + tree.depth[n] for n in self.slot_of]], device)
            key_pos[slots[0]] = slots[1]
        key_pos[past:] = positions
        start = self.clock.now()
        hidden = forward_hidden(self.model, self.cache, tokens, positions, allowed, key_pos)
        self.tokens_encoded += q
        self.forward_s += self.clock.now() - start
        if p:
            self.committed += p
            self.pending = []
        for i, n in enumerate(new_nodes):
            self.hidden[n] = hidden[p + i]
        for n in new_nodes:
            self.slot_of[n] = row_of[n]

    def commit(self, path_nodes: list[int], path_tokens: list[int]) -> None:
        """After verification: keep the encoded prefix of ``[root] + accepted``; queue the rest as pending.

        ``path_nodes`` are the tree ids of the root and the accepted nodes, ``path_tokens`` their tokens.
        """
        kept = 0
        for node in path_nodes:
            if node in self.slot_of:
                kept += 1
            else:
                break
        tail = [self.slot_of[n] for n in path_nodes[:kept]]
        if self.committed + len(tail) < cache_length(self.cache):
            keep_cache_positions(self.cache, self.committed, tail)
        self.committed += kept
        self.pending.extend(path_tokens[kept:])
        if self.head is not None:  # emitted tokens join the draft vocabulary (whatever is in context stays scorable)
            self.head.add(path_tokens)
        self.slot_of, self.logprobs, self.hidden = {}, {}, {}
