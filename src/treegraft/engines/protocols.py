"""The engine protocols: what a decoder needs from the models behind it, and nothing more.

A decoder talks to the target through :class:`TargetEngine` (prefill the prompt, verify a tree in one
forward and read per-row logits, keep the accepted path, roll back, or run one token at a time) and to
a drafter LM through :class:`DraftModel` (encode tree nodes incrementally and read their
log-probabilities, commit the accepted path, snapshot and restore within a turn). A loaded pair hands
its engines out through :class:`PairEngines`. The engine owns its KV cache; the decoding loop is a thin
client of these protocols and imports no implementation (``engines.torch``, ``engines.llama_cpp``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Protocol

import torch

from ..devices import Clock
from ..tree import DraftTree, TreeInputs
from .logprobs import TokenLogProbs

__all__ = ["TreeForward", "TargetEngine", "DraftModel", "PairEngines", "FrequentTokens"]

# ``frequent(k, vocab_size)``: the k most frequent token ids (LongTensor [k], host), the restricted
# vocabularies' base (the target's prefill scores, the drafters' heads)
FrequentTokens = Callable[[int, int], torch.Tensor]


class TreeForward(Protocol):
    """A verified tree's rows: ``logits(rows)`` gives the float32 target logits [len(rows), vocab] of the
    given rows (row 0 = the root) on the engine's ``head_device``, computed on demand (an engine may
    compute them all up front)."""

    def logits(self, rows: list[int]) -> torch.Tensor: ...


class TargetEngine(Protocol):
    """The target model behind a decoder, with its KV cache of the context."""

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

    def start(self, prompt_ids: list[int]) -> torch.Tensor:
        """Encode the whole prompt into a fresh cache; the next token's logits [vocab] (``ar``'s prefill)."""

    def step(self, token: int) -> torch.Tensor:
        """Append ``token`` to the context in one forward; the next token's logits [vocab] (``ar``)."""

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
    """A drafter LM with its own cache over the context and this turn's draft tree (the middle drafter,
    or a neural small drafter)."""

    logprobs: dict[int, TokenLogProbs]  # node id -> log q(. | node), this turn
    forward_s: float  # seconds inside the model so far
    tokens_encoded: int  # tokens through its forwards so far
    committed: int
    charged_s: float  # seconds of a shared prompt encoding charged since reset (included in forward_s)
    clock: Clock  # waits for the drafter's devices

    def reset(self, prompt_ids: list[int], encode: bool = False) -> None:
        """A new context: ``prompt_ids[:-1]``, encoded now with ``encode``, else at the first call."""

    def start_turn(self) -> None:
        """Forget the last turn's tree nodes (the committed context stays)."""

    def encode(self, tree: DraftTree, nodes: list[int], need_logprobs: list[int] | None = None) -> None:
        """Encode ``nodes`` of ``tree`` (and their unencoded ancestors) with tree attention; fills
        ``logprobs`` for ``need_logprobs`` (default: ``nodes``)."""

    def commit(self, path_nodes: list[int], path_tokens: list[int]) -> None:
        """Keep the accepted path (its encoded prefix cached, the rest pending)."""

    def snapshot(self) -> tuple:
        """The drafter's state within a turn (schedule enumeration branches here)."""

    def restore(self, snap: tuple) -> None: ...

    def release(self) -> None:
        """Drop the cache; the next reset starts anew."""


class PairEngines(Protocol):
    """A loaded pair's engines, handed out per decoder (each decoder owns its caches)."""

    name: str  # "torch" or "llama_cpp"
    tokenizer: object
    has_middle: bool  # a middle drafter model is loaded

    def target(self, frequent: FrequentTokens) -> TargetEngine:
        """A fresh target engine (``frequent``: the prefill's restricted vocabulary)."""

    def middle(self, frequent: FrequentTokens, draft_vocab: int | None) -> DraftModel:
        """A fresh middle drafter, its head restricted to the ``draft_vocab`` most frequent tokens plus
        the context's (None: the full vocabulary)."""

    def small(self, settings, frequent: FrequentTokens, draft_vocab: int | None, model=None) -> DraftModel:
        """A fresh neural small drafter for ``settings`` (a SmallDrafterConfig), or a one-line error where
        the engine runs the n-gram small drafter only."""

    def eos_ids(self) -> set[int]:
        """Every id that ends generation."""

    def verify_curve(self, cache_dir: str | Path | None, max_size: int) -> dict[int, float]:
        """The target's verification curve on this engine (seconds by rows), cached per machine."""

    def info(self) -> dict:
        """What a record says about the engine (engine, version, build, exactness, choice)."""

    def workers(self, requested: int) -> int:
        """Forked workers a stage may use on this pair."""
