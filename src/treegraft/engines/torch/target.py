"""The PyTorch engine's target: a stock transformers causal LM (any runtime of
:mod:`treegraft.models.runtime`, any device placement) and its ``DynamicCache`` behind
:class:`~treegraft.engines.protocols.TargetEngine`, and its measured verification curve."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from ...devices import Clock, device_tensor, input_device, model_devices, output_device
from ...drafters.vocab import SubsetHead, VocabSubset
from ...model_io import (cache_length, check_attention, forward_hidden, head_weight, keep_cache_positions, lm_logits,
                         logit_softcap, new_cache, truncate_cache)
from ...models.runtime import forward_curve, model_runtime, runtime_cache_key
from ...tree import TreeInputs
from ..curves import cached_curve

__all__ = ["TorchTarget", "TorchTreeForward", "cached_verify_curve"]


def _model_id(model: nn.Module) -> str:
    config = model.config
    ident = f"{getattr(config, '_name_or_path', '')}|{config.model_type}|{getattr(config, 'num_hidden_layers', '')}"
    ident += f"|{getattr(config, 'hidden_size', '')}|{config.vocab_size}"
    return hashlib.sha256(ident.encode()).hexdigest()[:12] + f" ({getattr(config, '_name_or_path', '') or config.model_type})"


def cached_verify_curve(model: nn.Module, cache_dir: str | Path | None, max_size: int = 64,
                        context: int = 256) -> dict[int, float]:
    """Median seconds of a verification forward (:func:`~treegraft.models.runtime.forward_curve`) by rows,
    cached per machine, devices, model and runtime (:func:`~treegraft.engines.curves.cached_curve`)."""
    key = f"{runtime_cache_key(_model_id(model), model_devices(model))} | {model_runtime(model)}"
    return cached_curve(key, lambda sizes: forward_curve(model, sizes=sizes, context=context, repeats=3), cache_dir,
                        max_size, context)


class TorchTreeForward:
    """The final hidden rows of a tree forward; the LM head runs on the rows asked for, in one batch."""

    def __init__(self, model: nn.Module, hidden: torch.Tensor):
        self.model, self.hidden = model, hidden

    def logits(self, rows: list[int]) -> torch.Tensor:
        return lm_logits(self.model, self.hidden.index_select(0, device_tensor(rows, self.hidden.device)))


class TorchTarget:
    """:class:`~treegraft.engines.protocols.TargetEngine` over a stock transformers causal LM and a
    ``DynamicCache``."""

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
        if top_m <= 0:  # no scores asked for: no LM head over the prompt
            return [[] for _ in ctx], [[] for _ in ctx]
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

    def start(self, prompt_ids: list[int]) -> torch.Tensor:
        """The whole prompt through the model's own forward (the reference every method's output equals)."""
        from transformers import DynamicCache

        self.cache = DynamicCache(config=self.model.config)
        out = self.model(input_ids=device_tensor([prompt_ids], self.device), cache=self.cache, use_cache=True,
                         logits_to_keep=1)
        return out.logits[0, -1]

    def step(self, token: int) -> torch.Tensor:
        out = self.model(input_ids=device_tensor([[token]], self.device), cache=self.cache, use_cache=True)
        return out.logits[0, -1]

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
