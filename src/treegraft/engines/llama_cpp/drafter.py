"""The middle drafter on llama.cpp (:class:`~treegraft.engines.protocols.DraftModel`).

Its tree grows call by call, so it gives every encoded node a seq of its own: a new node's seq starts as a
copy of its nearest encoded ancestor's seq (the context and that ancestor's path), and the node's cell also
carries the seqs of its new descendants in the same batch.
"""

from __future__ import annotations

import torch

from ...devices import Clock, now
from ...tree import DraftTree
from ..logprobs import TokenLogProbs
from .head import VocabHead
from .model import GGUFModel, LlamaCppError, SavedPrompt

__all__ = ["LlamaCppDrafter"]


class LlamaCppDrafter:
    """:class:`~treegraft.engines.protocols.DraftModel` over a :class:`GGUFModel` (the middle drafter).

    Same contract as :class:`~treegraft.engines.torch.MiddleDrafter`: the prompt is pending until the
    first call, a call encodes the requested nodes not yet encoded (and their unencoded ancestors),
    :meth:`commit` keeps the encoded prefix of the accepted path and queues the rest as pending.

    With a ``head`` (a :class:`VocabHead`; needs ``draft_vocab`` and a ``hidden_states`` model) llama.cpp
    returns hidden states and the head is applied here, over the draft vocabulary and only to the rows
    whose distribution is read; without one, llama.cpp's full LM head gives every node row's logits."""

    clock = Clock()
    reserve = 256  # free cells a turn may take; below that, the next call re-encodes the context
    fast_rows = 32  # a call that catches up on more context rows than this (the prompt) takes the stock kernels

    def __init__(self, model: GGUFModel, draft_vocab: torch.Tensor | None = None, head: VocabHead | None = None):
        if head is not None and (draft_vocab is None or not model.hidden_states):
            raise ValueError("a VocabHead needs a draft vocabulary and a hidden_states model")
        self.model = model
        self.draft_vocab = draft_vocab
        self.head = head
        self.tokens: list[int] = []  # the committed context, in the cache's seq 0
        self.ids: torch.Tensor | None = None  # the draft vocabulary plus every context token (sorted)
        self.pos_of: torch.Tensor | None = None
        self.committed = 0
        self.pending: list[int] = []
        self.seq_of: dict[int, int] = {}  # encoded node -> its seq, this turn
        self.logprobs: dict[int, TokenLogProbs] = {}
        self._row_out: dict[int, torch.Tensor] = {}  # encoded node -> its logits (or hidden state), this turn
        self.calls = 0
        self.tokens_encoded = 0
        self.forward_s = 0.0
        self.charged_s = 0.0  # seconds of a shared prompt encoding charged since reset (PromptReuse)
        self._prompt: list[int] = []
        self.epoch = 0  # clears of the cache within a prompt (a snapshot's node cells live in one epoch)

    # the draft vocabulary grows with the context, as SubsetHead does
    def _add_vocab(self, tokens: list[int]) -> None:
        if self.draft_vocab is None:
            return
        new = torch.tensor(sorted(set(tokens)), dtype=torch.long)
        if self.ids is not None and bool((self.pos_of[new] >= 0).all()):
            return  # nothing new (most turns): keep the vocabulary and its head rows (CPU tensors: no device sync)
        base = self.ids if self.ids is not None else self.draft_vocab
        self.ids = torch.unique(torch.cat([base, new]))
        self.pos_of = torch.full((self.model.n_vocab,), -1, dtype=torch.long)
        self.pos_of[self.ids] = torch.arange(len(self.ids))

    def reset(self, prompt_ids: list[int], encode: bool = False) -> None:
        self.model.clear()
        self.tokens, self.committed, self.pending = [], 0, list(prompt_ids[:-1])
        self._prompt, self.charged_s = list(prompt_ids[:-1]), 0.0
        self.seq_of, self.logprobs, self._row_out = {}, {}, {}
        self.ids = None
        self._add_vocab(list(prompt_ids))
        if encode and self.pending:
            start = now()
            self._decode_rows([], None)
            self.forward_s += now() - start

    @property
    def context_len(self) -> int:
        return self.committed + len(self.pending)

    def start_turn(self) -> None:
        self._drop_nodes(list(self.seq_of))
        self.seq_of, self.logprobs, self._row_out = {}, {}, {}

    def snapshot(self) -> tuple:
        """Within a turn the cells only grow: restoring drops the seqs of the nodes encoded since (and
        the context caught up since), so schedules that share a prefix branch from the same state."""
        return (self.committed, list(self.pending), dict(self.seq_of), dict(self.logprobs), dict(self._row_out),
                self.epoch)

    def restore(self, snap: tuple) -> None:
        committed, pending, seq_of, logprobs, row_out, epoch = snap
        if epoch != self.epoch:  # the cache was cleared since (:meth:`_clear`): the snapshot's node cells
            self._drop_nodes(list(self.seq_of))  # are gone; keep today's context, re-encode nodes when needed
            self.seq_of, self.logprobs, self._row_out = {}, dict(logprobs), dict(row_out)
            return
        self._drop_nodes([n for n in self.seq_of if n not in seq_of])
        if self.committed > committed:
            self.model.bury(0, committed)
            self.tokens = self.tokens[:committed]
        self.committed, self.pending = committed, list(pending)
        self.seq_of, self.logprobs, self._row_out = dict(seq_of), dict(logprobs), dict(row_out)

    def _drop_nodes(self, nodes: list[int]) -> None:
        for n in nodes:
            self.model.bury(self.seq_of[n])

    def _free_seqs(self, k: int) -> list[int]:
        used = set(self.seq_of.values())
        free = [s for s in range(1, self.model.grave) if s not in used][:k]
        if len(free) < k:
            raise LlamaCppError(f"middle drafter tree needs more than {self.model.grave - 1} node seqs this turn")
        return free

    def _catch_up_prompt(self) -> None:
        """The prompt's rows alone into a cleared cache (seq 0, cells 0.. in order, stock kernels: they only
        steer drafts), before anything else is encoded on them; with ``PromptReuse`` on the model, the saved
        encoding of the same prompt is restored instead and its seconds charged (``charged_s``)."""
        m, n = self.model, len(self._prompt)
        start = now()
        reuse = m.prompt_reuse
        saved = reuse.saved if reuse is not None else None
        m.clear()  # nothing is committed: every cell is a buried one
        if saved is not None and saved.tokens == tuple(self._prompt):
            m.load_seq0(saved.state, n)
        else:
            t0 = now()
            for s in range(0, n, m.n_batch):
                chunk = self._prompt[s:s + m.n_batch]
                m.decode(chunk, list(range(s, s + len(chunk))), [[0]] * len(chunk), [False] * len(chunk), fast=True)
            if reuse is not None:
                saved = reuse.saved = SavedPrompt(tuple(self._prompt), m.save_seq0(), now() - t0, {})
        if saved is not None:
            charge = saved.seconds - (now() - start)
            self.charged_s += charge
            self.forward_s += charge
        self.tokens_encoded += n
        self.tokens, self.committed, self.pending = list(self._prompt), n, self.pending[n:]

    def _decode_rows(self, new_nodes: list[int], tree: DraftTree | None) -> None:
        """One decode of the pending chain (seq 0) and the new tree nodes, each node with a seq of its own;
        every node row's logits (with a ``head``: hidden state) are kept for the turn (a later call may ask for an encoded node's). A prompt
        of more than ``fast_rows`` rows is caught up on its own first (:meth:`_catch_up_prompt`)."""
        m = self.model
        if (self.committed == 0 and len(self._prompt) > self.fast_rows
                and self.pending[:len(self._prompt)] == self._prompt):
            self._catch_up_prompt()
            if not new_nodes and not self.pending:  # an eager prefill (reset(encode=True)): nothing else to encode
                return
        seqs = dict(zip(new_nodes, self._free_seqs(len(new_nodes))))
        desc: dict[int, list[int]] = {n: [] for n in new_nodes}
        for n in new_nodes:  # a node's cell also carries the seqs of its new descendants
            a = tree.parent[n]
            while a >= 0 and a in seqs:
                desc[a].append(seqs[n])
                a = tree.parent[a]
            # the nearest encoded ancestor's seq (or the context's) is where the node's seq starts
            m.seq_cp(self.seq_of[a] if a >= 0 else 0, seqs[n])
        on_context = [seqs[n] for n in new_nodes if self._anchor(tree, n, seqs) < 0]
        p, ctx = len(self.pending), self.context_len
        tokens = self.pending + [tree.token[n] for n in new_nodes]
        positions = list(range(self.committed, ctx)) + [ctx + tree.depth[n] for n in new_nodes]
        rows = [[0, *on_context]] * p + [[seqs[n], *desc[n]] for n in new_nodes]
        logits = [False] * p + [True] * len(new_nodes)
        # the drafter's logits only steer the drafts, never the output: a long catch-up may take fast kernels
        fast = p > self.fast_rows
        # batches of at most n_batch rows, the new nodes in the last (a long prompt is caught up first)
        last = max(0, len(tokens) - m.n_batch)
        if len(new_nodes) > m.n_batch:
            raise LlamaCppError(f"middle drafter call of {len(new_nodes)} nodes exceeds n_batch {m.n_batch}")
        for start in range(0, last, m.n_batch):
            end = min(start + m.n_batch, last)
            m.decode(tokens[start:end], positions[start:end], rows[start:end], logits[start:end], fast=fast)
        m.decode(tokens[last:], positions[last:], rows[last:], logits[last:], fast=fast)
        rows = [p - last + i for i in range(len(new_nodes))]
        outs = m.hidden_rows(rows) if self.head is not None else m.logits_rows(rows)
        for i, n in enumerate(new_nodes):
            self._row_out[n] = outs[i]
        self.tokens_encoded += len(tokens)
        self.tokens += self.pending
        self.committed, self.pending = ctx, []
        self.seq_of.update(seqs)

    @staticmethod
    def _anchor(tree: DraftTree, node: int, new: dict[int, int]) -> int:
        a = tree.parent[node]
        while a >= 0 and a in new:
            a = tree.parent[a]
        return a

    def _clear(self) -> None:
        """Clear the cache (buried cells come back only this way); the context becomes pending, to be
        re-encoded with the next call (a saved prompt restored), and this turn's nodes as they are needed
        again. Node scores already read stay valid: a node's logits depend only on its path."""
        self.model.clear()
        self.tokens, self.committed, self.pending = [], 0, self.tokens + self.pending
        self.seq_of = {}
        self.epoch += 1

    def encode(self, tree: DraftTree, nodes: list[int], need_logprobs: list[int] | None = None) -> None:
        """Encode ``nodes`` (and unencoded ancestors); fill ``self.logprobs`` for ``need_logprobs``
        (default ``nodes``)."""
        need = list(nodes if need_logprobs is None else need_logprobs)
        todo = tree.closure_missing(nodes, self.seq_of)
        # a turn can bury many cells (schedule enumeration encodes and buries 2^D constructions' nodes; a
        # 96-token collect on a 1,400-token CNN/DM prompt ran out: "31 rows with 30 of 4096 cells free")
        if self.model.free_cells() < len(self.pending) + len(todo):
            self._clear()
            todo = tree.closure_missing(nodes, self.seq_of)
        start = now()
        if todo or self.pending:
            self._decode_rows(todo, tree)
            self.calls += 1
        unread = list(dict.fromkeys(n for n in need if n not in self.logprobs))
        rows = [self._row_out[n] for n in unread]
        if rows and self.head is not None:  # one product for every row read (llama.cpp's rows: full logits already)
            rows = self.head.logits(torch.stack(rows), self.ids)
        for n, row in zip(unread, rows):
            self.logprobs[n] = self._logprobs(row)
        self.forward_s += now() - start

    def _logprobs(self, logits: torch.Tensor) -> TokenLogProbs:
        """``logits``: over the full vocabulary, or over ``self.ids`` already (a ``head``'s)."""
        if self.ids is None:
            return TokenLogProbs(torch.log_softmax(logits, dim=-1))
        if self.head is None:
            logits = logits[self.ids]
        return TokenLogProbs(torch.log_softmax(logits, dim=-1), 0, self.ids, self.pos_of)

    def release(self) -> None:
        """Nothing to free: the KV cells live in the model's context, sized once and reused."""

    def commit(self, path_nodes: list[int], path_tokens: list[int]) -> None:
        kept = 0
        for node in path_nodes:
            if node in self.seq_of:
                kept += 1
            else:
                break
        if kept:
            last = self.seq_of[path_nodes[kept - 1]]
            self.model.seq_cp(last, 0, self.committed, self.committed + kept)
        self._drop_nodes(list(self.seq_of))
        self.committed += kept
        self.tokens += list(path_tokens[:kept])
        self.pending.extend(path_tokens[kept:])
        self.seq_of = {}
        if self.model.free_cells() < self.reserve:
            self._clear()
        self._add_vocab(list(path_tokens))
        self.logprobs, self._row_out = {}, {}
