"""The Hugging Face peers, on the same models: assisted generation and prompt lookup decoding.

Both are transformers' own `generate` features, wrapped to return a :class:`GenerationResult`
so they can be timed and compared with our methods side by side. Greedy only (transformers'
assisted generation is exact under greedy decoding; with sampling it follows its own rule).

Their tokens per verification step (Spec-Bench's ``accept_lengths``) are read off the target's
forwards: a pre-hook records where each forward starts (its first position id); a step emits the
tokens between the start of its forward and the start of the next (the last step: up to the end).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import nn

from ..devices import Clock, device_tensor, input_device
from .autoregressive import GenerationResult, prepare_prompt
from .sampling import SamplingConfig

__all__ = ["HFAssistedDecoder", "HFPromptLookupDecoder", "steps_from_starts"]


class _HFGenerate:
    method = "hf"

    def __init__(self, target: nn.Module, eos_ids: set[int], sampling: SamplingConfig | None = None):
        self.target = target
        self.eos_ids = sorted(eos_ids)
        self.sampling = sampling or SamplingConfig()

    def _kwargs(self) -> dict:
        raise NotImplementedError

    @torch.inference_mode()
    def generate(self, prompt_ids: Sequence[int] | torch.Tensor, max_new_tokens: int,
                 on_tokens: Callable[[list[int]], None] | None = None) -> GenerationResult:
        """``on_tokens(new)`` receives the tokens of each step as transformers' streamer interface sees them."""
        prompt_ids = prepare_prompt(prompt_ids, max_new_tokens, getattr(self.target.config, "max_position_embeddings", None))
        device = input_device(self.target)
        clock = Clock.of(self.target, getattr(self, "assistant", None))
        ids = device_tensor([prompt_ids], device)
        sampling = {"do_sample": False}
        if not self.sampling.greedy:
            torch.manual_seed(self.sampling.seed)
            sampling = {"do_sample": True, "temperature": self.sampling.temperature, "top_p": self.sampling.top_p}
        starts: list[int] = []

        def record(_module, _args, kwargs):
            pos = kwargs.get("position_ids")
            if pos is not None:
                starts.append(int(pos.reshape(-1)[0]))

        hook = self.target.register_forward_pre_hook(record, with_kwargs=True)
        start = clock.now()
        try:
            out = self.target.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                eos_token_id=self.eos_ids or None,
                pad_token_id=self.eos_ids[0] if self.eos_ids else 0,
                **sampling,
                **self._kwargs(),
                streamer=_CallbackStreamer(on_tokens) if on_tokens is not None else None,
            )
        finally:
            hook.remove()
        wall = clock.now() - start
        tokens = out[0, len(prompt_ids):].tolist()
        stop = "eos" if tokens and tokens[-1] in self.eos_ids else "max_new_tokens"
        return GenerationResult(tokens=tokens, prompt_tokens=len(prompt_ids), wall_time_s=wall,
                                prefill_time_s=float("nan"), stop_reason=stop,
                                turns=steps_from_starts(starts, len(prompt_ids), len(tokens)))


class _CallbackStreamer:
    """transformers' streamer protocol (``put`` the prompt, then new tokens; ``end``) onto a callback."""

    def __init__(self, on_tokens: Callable[[list[int]], None]):
        self.on_tokens, self.prompt_seen = on_tokens, False

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        self.on_tokens(value.reshape(-1).tolist())

    def end(self) -> None:
        pass


def steps_from_starts(starts: list[int], prompt_len: int, new_tokens: int) -> list[dict]:
    """Per verification step ``{"accepted": k}`` (tokens emitted minus the bonus) from the first position
    of every target forward: the first forward (the prompt, plus candidates) starts at 0 and its step's
    tokens begin at the prompt's end; the others start where the accepted text ends."""
    if not starts or new_tokens == 0:
        return []
    bounds = [prompt_len - 1] + starts[1:] + [prompt_len + new_tokens - 1]
    return [{"accepted": max(b - a, 1) - 1} for a, b in zip(bounds, bounds[1:])]


class HFAssistedDecoder(_HFGenerate):
    """`generate(assistant_model=middle)`: transformers' speculative decoding with the middle drafter."""

    method = "hf_assisted"

    def __init__(self, target: nn.Module, assistant: nn.Module, eos_ids: set[int], sampling=None):
        super().__init__(target, eos_ids, sampling)
        self.assistant = assistant

    def _kwargs(self) -> dict:
        return {"assistant_model": self.assistant}


class HFPromptLookupDecoder(_HFGenerate):
    """`generate(prompt_lookup_num_tokens=k)`: transformers' n-gram prompt lookup decoding."""

    method = "hf_prompt_lookup"

    def __init__(self, target: nn.Module, eos_ids: set[int], sampling=None, num_tokens: int = 10, max_ngram: int = 2):
        super().__init__(target, eos_ids, sampling)
        self.num_tokens, self.max_ngram = num_tokens, max_ngram

    def _kwargs(self) -> dict:
        return {"prompt_lookup_num_tokens": self.num_tokens, "max_matching_ngram_size": self.max_ngram}
