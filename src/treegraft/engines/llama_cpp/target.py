"""The target on llama.cpp (:class:`~treegraft.engines.protocols.TargetEngine`): a draft tree verified
in one ``llama_decode``.

Every tree row carries the seq ids of the leaves below it (one seq per root-to-leaf path, the committed
context copied to each leaf's seq first, unified KV), so llama.cpp's own attention mask gives each row its
context plus its ancestors, at position committed length + depth. Keeping the accepted path moves its
cells into seq 0 (``seq_cp`` over the path's positions) and drops the leaf seqs; a rejected tree is
dropped whole.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ...devices import Clock, now
from ...tree import TreeInputs
from .costs import cached_engine_curve
from .model import GGUFModel, LlamaCppError, SavedPrompt

__all__ = ["LlamaCppTarget", "LlamaTreeForward"]


def _subset_log_softmax(logits: torch.Tensor, ids: torch.Tensor | None) -> torch.Tensor:
    return torch.log_softmax(logits if ids is None else logits[ids], dim=-1)


class LlamaTreeForward:
    """Rows of a verified tree: their logits, read from llama.cpp on demand (valid until the next decode)."""

    def __init__(self, model: GGUFModel):
        self.model = model

    def logits(self, rows: list[int]) -> torch.Tensor:
        return self.model.logits_rows(rows)


def _leaves_below(parent: list[int]) -> list[list[int]]:
    """For each row, the leaves of the subtree below it (rows in parent-first order)."""
    n = len(parent)
    has_child = [False] * n
    for p in parent:
        if p >= 0:
            has_child[p] = True
    below: list[list[int]] = [[] for _ in range(n)]
    for row in range(n - 1, -1, -1):
        if not has_child[row]:
            below[row].insert(0, row)
        if parent[row] >= 0:
            below[parent[row]][:0] = below[row]
    return below


class LlamaCppTarget:
    """:class:`~treegraft.engines.protocols.TargetEngine` over a :class:`~.model.GGUFModel`."""

    device = head_device = torch.device("cpu")
    clock = Clock()  # llama.cpp runs on the host: its clock waits for nothing
    reserve = 128  # cells kept free for a tree: the context window is n_ctx minus this
    fast_prompt = True  # the prompt through the stock kernels (see prefill)

    def __init__(self, model: GGUFModel, frequent=None):
        """``frequent(k, vocab_size)``: the ``k`` most frequent token ids (the prefill's restricted vocabulary)."""
        self.model = model
        self._frequent = frequent
        self.tokens: list[int] = []  # the committed context, in the cache's seq 0
        self._prompt_len = 0  # its first tokens, encoded by prefill
        self._leaf_seqs: list[int] = []
        self._first_seq: list[int] = []
        self._tree_tokens: list[int] = []
        self._prefill_bases: dict[int, torch.Tensor] = {}  # vocab K -> the K most frequent tokens
        self.prefill_charge_s = 0.0  # seconds the last prefill adds to its own (PromptReuse)

    def context_window(self) -> int | None:
        return self.model.n_ctx - self.reserve

    def prefill(self, prompt_ids: list[int], top_m: int, vocab: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """With ``vocab`` = K the scores are a log-softmax over the K most frequent tokens plus the
        prompt's own, as on the PyTorch engine (llama.cpp computes the full head; the subset is read from it).

        The prompt is encoded with the stock fast kernels even on an exact model (``fast_prompt``): its
        KV is then a deterministic function of the prompt, the same for ``ar`` and for every method, and
        exactness is needed only from the first decoded token on. (Batch-invariant kernels run a
        512-token prompt through the slow reference path: on a Zen 3 EPYC that was half of a 64-token
        generation's time.) That also lets decoders share one encoding of a prompt
        (:class:`PromptReuse`); ``prefill_charge_s`` then says how many seconds to add to this call's own
        so that it counts what encoding the prompt cost (0 without reuse)."""
        start = now()
        m = self.model
        self._leaf_seqs = []
        self.tokens = list(prompt_ids[:-1])
        self._prompt_len = len(self.tokens)
        self.prefill_charge_s = 0.0
        m.clear()
        if not self.tokens:
            return torch.zeros(0, top_m, dtype=torch.long), torch.zeros(0, top_m)
        empty = torch.zeros(len(self.tokens), 0, dtype=torch.long), torch.zeros(len(self.tokens), 0)
        # top_m 0 (``ar``): no scores, so no row's logits (the LM head over every row of a 190-token prompt is
        # a sixth of its multiply work)
        key = (int(top_m), int(vocab) if vocab and self._frequent is not None else None) if top_m > 0 else None
        base = None
        if key is not None and key[1] is not None:
            if key[1] not in self._prefill_bases:
                self._prefill_bases[key[1]] = self._frequent(key[1], m.n_vocab)
            base = self._prefill_bases[key[1]]
        reuse = m.prompt_reuse
        if reuse is None:
            scores = self._encode_and_score(prompt_ids, {key: base} if key else {})
            return scores[key] if key else empty
        if key is not None:
            reuse.requests.setdefault(key, base)
        saved = reuse.saved
        # a saved encoding serves only a prefill that asks for what it computed: one made with scores cost more,
        # and restoring it for ``ar`` would charge ``ar`` for the scores a tree method needs
        if saved is not None and saved.tokens == tuple(self.tokens) and (key in saved.scores if key else not saved.scores):
            m.load_seq0(saved.state, len(self.tokens))
        else:
            t0 = now()
            scores = self._encode_and_score(prompt_ids, dict(reuse.requests) if key else {})
            saved = reuse.saved = SavedPrompt(tuple(self.tokens), None, now() - t0, scores)
            saved.state = m.save_seq0()
        self.prefill_charge_s = saved.seconds - (now() - start)
        return saved.scores[key] if key else empty

    def _encode_and_score(self, prompt_ids: list[int], requests: dict) -> dict:
        """Encode the prompt's rows into the cleared cache; the top-m ids and log-probs at every row for each
        request ``(top_m, vocab) -> base``: over the full vocabulary (no base) or over the base plus the
        prompt's own tokens. No request: the rows are encoded without logits, and the answer is ``{}``."""
        m = self.model
        subsets = {key: None if base is None else torch.unique(torch.cat([base, torch.tensor(prompt_ids, dtype=torch.long)]))
                   for key, base in requests.items()}
        out = {key: ([], []) for key in requests}
        for rows in self._encode_prompt(logits=bool(requests)):
            for i in range(rows if requests else 0):  # rows without logits have none to read
                logits = m.logits(i)
                for key, ids in subsets.items():
                    logp = _subset_log_softmax(logits, ids)
                    v, j = logp.topk(min(key[0], logp.shape[-1]))
                    out[key][0].append(j if ids is None else ids[j])
                    out[key][1].append(v)
        return {key: (torch.stack(i), torch.stack(v)) for key, (i, v) in out.items()}

    def _encode_prompt(self, logits: bool = True):
        """Decode the prompt part of the context into a cleared cache, ``n_batch`` rows at a time, every
        row's logits requested (``logits``) or none; yields each batch's row count (its logits are readable
        until the next). :meth:`_make_room` replays exactly these batches, so the prompt's KV comes out the same
        bits (which rows have logits does not change the KV: llama.cpp drops the other rows only after the
        last layer's attention)."""
        m = self.model
        for start in range(0, self._prompt_len, m.n_batch):
            chunk = self.tokens[start:min(start + m.n_batch, self._prompt_len)]
            m.decode(chunk, list(range(start, start + len(chunk))), [[0]] * len(chunk), [logits] * len(chunk),
                     fast=self.fast_prompt)
            yield len(chunk)

    def context_len(self) -> int:
        return len(self.tokens)

    def _make_room(self, n: int) -> None:
        """Re-encode the committed context into a cleared cache when fewer than ``n`` cells are free
        (buried cells are reclaimed only this way): the prompt's batches replayed as they were, the rest
        in exact batches, so nothing changes but the cost."""
        m = self.model
        if m.free_cells() >= n:
            return
        m.clear()
        for _ in self._encode_prompt(logits=False):
            pass
        for start in range(self._prompt_len, len(self.tokens), m.n_batch):
            chunk = self.tokens[start:start + m.n_batch]
            m.decode(chunk, list(range(start, start + len(chunk))), [[0]] * len(chunk), [False] * len(chunk))

    def forward_tree(self, inputs: TreeInputs) -> LlamaTreeForward:
        n = inputs.size
        self._make_room(n)
        below = _leaves_below(inputs.parent_row)
        leaves = [r for r in range(n) if below[r] == [r]]
        if len(leaves) + 2 > self.model.n_seq:
            raise LlamaCppError(f"tree of {len(leaves)} leaves exceeds the engine's {self.model.n_seq - 2} path seqs")
        seq_of_leaf = {leaf: 1 + i for i, leaf in enumerate(leaves)}
        for s in seq_of_leaf.values():  # each path starts from the committed context
            self.model.seq_cp(0, s)
        seqs = [[seq_of_leaf[leaf] for leaf in below[r]] for r in range(n)]
        self._leaf_seqs = list(seq_of_leaf.values())
        self._first_seq = [s[0] for s in seqs]
        self._tree_tokens = list(inputs.token_ids)
        self.model.decode(self._tree_tokens, list(inputs.positions), seqs, [True] * n)
        return LlamaTreeForward(self.model)

    def keep(self, context_len: int, rows: list[int]) -> None:
        """The accepted path (root first) joins seq 0: its cells are the path's positions in the seq of a
        leaf below its last row; every tree cell is then buried under the leaf seqs."""
        self.model.seq_cp(self._first_seq[rows[-1]], 0, context_len, context_len + len(rows))
        self._drop_tree(context_len)
        self.tokens = self.tokens[:context_len] + [self._tree_tokens[r] for r in rows]

    def rollback(self, context_len: int) -> None:
        self._drop_tree(context_len)
        if context_len < len(self.tokens):
            self.model.bury(0, context_len)
        self.tokens = self.tokens[:context_len]

    def _drop_tree(self, context_len: int) -> None:
        for s in self._leaf_seqs:
            self.model.bury(s, context_len)
        self._leaf_seqs = []

    def start(self, prompt_ids: list[int]) -> torch.Tensor:
        """The prompt's rows without logits (shared through :class:`~.model.PromptReuse` with other scoreless
        prefills), then its last token alone: the next token's logits [vocab]."""
        self.prefill(prompt_ids, 0, None)
        return self.step(prompt_ids[-1])

    def step(self, token: int) -> torch.Tensor:
        """One-token decode of ``token`` at the end of the context (``ar``); its logits [vocab]."""
        self._make_room(1)
        self.model.decode([token], [len(self.tokens)], [[0]], [True])
        self.tokens.append(token)
        return self.model.logits(0)

    def verify_curve(self, cache_dir: str | Path | None, max_size: int) -> dict[int, float]:
        return cached_engine_curve(self.model, cache_dir, max_size)

    def release(self) -> None:
        """Nothing to free: the KV cells live in the model's context, sized once and reused."""
