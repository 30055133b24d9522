"""The engine seam: what the tree decoder needs from its models, and today's PyTorch implementation.

The decoder never touches a model, a KV cache or a kernel itself. It talks to the target through
:class:`TargetEngine` (prefill the prompt, verify a tree in one forward and read per-row logits,
keep the accepted path, roll back) and to the middle drafter through :class:`DraftModel` (encode tree
nodes incrementally and read their log-probabilities, commit the accepted path, snapshot and restore
within a turn for schedule enumeration). :class:`TorchTarget` and
:class:`~treegraft.drafters.middle.MiddleDrafter` implement them over a stock transformers model and
its ``DynamicCache``; another engine (llama.cpp's multi-sequence batches) implements the same two.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Protocol

import torch
from torch import nn

from ..devices import Clock, device_tensor, input_device, output_device
from ..drafters.vocab import SubsetHead, VocabSubset
from ..model_io import (cache_length, check_attention, forward_hidden, head_weight, keep_cache_positions, lm_logits, logit_softcap,
                        new_cache, truncate_cache)
from ..tree import DraftTree, TreeInputs
from .budget import cached_verify_curve

__all__ = ["TreeForward", "TargetEngine", "DraftModel", "TorchTarget", "TorchTreeForward"]


class TreeForward(Protocol):
    """A verified tree's rows: ``logits(rows)`` gives the float32 target logits [len(rows), vocab] of the
    given rows (row 0 = the root) on the engine's ``head_device``, computed on demand (an engine may
    compute them all up front)."""

    def logits(self, rows: list[int]) -> torch.Tensor: ...


class TargetEngine(Protocol):
    """The target model behind the decoder, with its KV cache of the context."""

    device: torch.device  # where token and position ids go
    head_device: torch.device  # where logits come out (the sampling generator lives there)
    clock: Clock  # the one clock of every timed region: it waits for the engine's devices
    # seconds the last prefill adds to its own: an encoding of the prompt shared between decoders (llama.cpp's
    # PromptReuse) is charged to each in full; 0 where every prefill encodes its prompt
    prefill_charge_s: float

    def context_window(self) -> int | None:
        """Positions the model can attend over (prompt + new tokens), None when unbounded."""

    def prefill(self, prompt_ids: list[int], top_m: int, vocab: int | None) -> tuple:
        """Encode ``prompt_ids[:-1]`` into a fresh cache; return the target's top-``top_m`` token ids and
        log-probabilities at each of those positions ([P - 1, top_m] each: host tensors or nested lists),
        over the ``vocab`` most frequent tokens plus the prompt's own (None: the full vocabulary)."""

    def context_len(self) -> int:
        """Positions in the cache (the root of the next tree sits here)."""

    def forward_tree(self, inputs: TreeInputs) -> TreeForward:
        """One forward over the tree rows of ``inputs`` (ancestor mask, depth positions) on top of the
        cache; the rows stay cached until :meth:`keep` or :meth:`rollback`."""

    def keep(self, context_len: int, rows: list[int]) -> None:
        """Keep the cache up to ``context_len`` plus the given tree rows (the accepted path, in order)."""

    def rollback(self, context_len: int) -> None:
        """Drop every cached position from ``context_len`` on (a verified tree discarded whole)."""

    def verify_curve(self, cache_dir: str | Path | None, max_size: int) -> dict[int, float]:
        """Seconds of a tree verification by number of rows, measured on this machine (cached)."""

    def release(self) -> None:
        """Drop the KV cache (and whatever else only one generation needs); the next prefill starts anew."""


class DraftModel(Protocol):
    """The middle drafter's engine (:class:`~treegraft.drafters.middle.MiddleDrafter` is the PyTorch one)."""

    logprobs: dict  # node id -> TokenLogProbs of q_m(. | node), this turn
    forward_s: float  # seconds inside the model so far
    tokens_encoded: int  # tokens through its forwards so far
    committed: int
    charged_s: float  # seconds of a shared prompt encoding charged since reset (included in forward_s)
    clock: Clock  # waits for the drafter's devices

    def reset(self, prompt_ids: list[int], encode: bool = False) -> None: ...

    def start_turn(self) -> None: ...

    def encode(self, tree: DraftTree, nodes: list[int], need_logprobs: list[int] | None = None) -> None: ...

    def commit(self, path_nodes: list[int], path_tokens: list[int]) -> None: ...

    def snapshot(self) -> tuple: ...

    def restore(self, snap: tuple) -> None: ...

    def release(self) -> None: ...


class TorchTreeForward:
    """The final hidden rows of a tree forward; the LM head runs on the rows asked for, in one batch."""

    def __init__(self, model: nn.Module, hidden: torch.Tensor):
        self.model, self.hidden = model, hidden

    def logits(self, rows: list[int]) -> torch.Tensor:
        return lm_logits(self.model, self.hidden.index_select(0, device_tensor(rows, self.hidden.device)))


class TorchTarget:
    """:class:`TargetEngine` over a stock transformers causal LM (any runtime of
    :mod:`treegraft.models.runtime`) and a ``DynamicCache``."""

    prefill_charge_s = 0.0  # every prefill encodes its prompt

    def __init__(self, model: nn.Module, frequent: Callable[[int, int], torch.Tensor]):
        """``frequent(k, vocab_size)``: the ``k`` most frequent token ids (the prefill's restricted vocabulary)."""
        check_attention(model)
        self.model = model
        self.device = input_device(model)
        self.head_device = output_device(model)
        self.clock = Clock.of(model)
        self.cache = None
        self._frequent = frequent
        self._prefill_base: list[int] | None = None  # the prefill's frequent tokens
        self._prefill_head: SubsetHead | None = None  # the restricted head, gathered once per prompt

    def context_window(self) -> int | None:
        return getattr(self.model.config, "max_position_embeddings", None)

    def prefill(self, prompt_ids: list[int], top_m: int, vocab: int | None) -> tuple[list[list[int]], list[list[float]]]:
        """With ``vocab`` = K the scores are a log-softmax over the K most frequent tokens plus the
        prompt's own (every token a prompt position can propose): the LM head then costs K / V of a
        full-vocabulary head over the prompt, which keeps the time to first token near ``ar``'s."""
        self.cache = new_cache()
        ctx = prompt_ids[:-1]
        if not ctx:
            return [], []
        device = self.device
        toks = device_tensor(ctx, device)
        hidden = forward_hidden(self.model, self.cache, toks, torch.arange(len(ctx), device=device), None)
        head = None
        if vocab:
            weight = head_weight(self.model)
            if self._prefill_head is None:
                if self._prefill_base is None:  # the frequent tokens, read once per engine
                    self._prefill_base = self._frequent(int(vocab), weight.shape[0]).tolist()
                subset = VocabSubset(self._prefill_base, weight.shape[0], self.head_device)
                self._prefill_head = SubsetHead(weight, subset, logit_softcap(self.model))
            head = self._prefill_head
            head.truncate(min(int(vocab), weight.shape[0]))
            head.add(prompt_ids)
        parts, k = [], top_m
        for chunk in hidden.split(64):  # bounded memory: [64, V] logits at a time
            logp = torch.log_softmax(lm_logits(self.model, chunk), dim=-1) if head is None else head.log_softmax(chunk)
            k = min(top_m, logp.shape[-1])
            v, i = logp.topk(k, dim=-1)
            parts.append(torch.cat([(i if head is None else head.subset.ids[i]).double(), v.double()], dim=1))
        packed = torch.cat(parts).tolist()  # one host read per prompt: ids and log-probabilities (exact in float64)
        return [[int(t) for t in row[:k]] for row in packed], [row[k:] for row in packed]

    def context_len(self) -> int:
        return cache_length(self.cache)

    def forward_tree(self, inputs: TreeInputs) -> TorchTreeForward:
        L, n, device = self.context_len(), inputs.size, self.device
        # the may-attend matrix built on the device: the whole context, then the tree's ancestor mask
        allowed = torch.ones(n, L + n, dtype=torch.bool, device=device)
        allowed[:, L:] = device_tensor(inputs.ancestor_mask, device, torch.bool)
        hidden = forward_hidden(self.model, self.cache, device_tensor(inputs.token_ids, device),
                                device_tensor(inputs.positions, device), allowed)
        return TorchTreeForward(self.model, hidden)

    def keep(self, context_len: int, rows: list[int]) -> None:
        keep_cache_positions(self.cache, context_len, [context_len + row for row in rows])

    def rollback(self, context_len: int) -> None:
        truncate_cache(self.cache, context_len)

    def verify_curve(self, cache_dir: str | Path | None, max_size: int) -> dict[int, float]:
        return cached_verify_curve(self.model, cache_dir, max_size)

    def release(self) -> None:
        """Drop the KV cache and the prefill's restricted head (rebuilt by the next prefill: a gather of
        K rows, milliseconds, against holding K x H float32 per decoder on a GPU)."""
        self.cache = None
        self._prefill_head = None
