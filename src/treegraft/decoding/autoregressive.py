"""Target-only autoregressive decoding (`ar`): the reference for speed and for output equality."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

import torch
from ..devices import device_tensor
from ..engines.protocols import TargetEngine
from .sampling import SamplingConfig, sample_from_logits

__all__ = ["GenerationResult", "AutoregressiveDecoder", "validate_prompt", "PromptError", "hold_eos", "hold_eos_rows"]


class PromptError(ValueError):
    """The prompt cannot be decoded (empty, or too long for the model's context window)."""


@dataclass
class GenerationResult:
    """What one decode produced and what it cost.

    ``tokens`` are the new tokens only (the prompt excluded). ``stop_reason`` is ``"eos"`` or
    ``"max_new_tokens"``. ``turns`` holds per-turn records for speculative methods (empty for ``ar``).
    The tree decoder also sets ``grafting`` (accepted draft tokens, those on branches only non-destructive
    grafting kept, turns, turns with such a graft, turns that accepted such a branch) and
    ``grafting_examples`` (up to two traced turns that accepted a kept branch, as text pieces); None
    for the other decoders.
    """

    tokens: list[int]
    prompt_tokens: int
    wall_time_s: float
    prefill_time_s: float
    stop_reason: str
    turns: list[dict] = field(default_factory=list)
    grafting: dict | None = None
    grafting_examples: list[dict] | None = None

    @property
    def new_tokens(self) -> int:
        return len(self.tokens)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_time_s if self.wall_time_s > 0 else float("nan")

    def record(self) -> dict:
        out = asdict(self)
        out.update(new_tokens=self.new_tokens, tokens_per_s=self.tokens_per_s)
        return out


def hold_eos(logits: torch.Tensor, eos_ids: set[int], position: int, min_new_tokens: int) -> torch.Tensor:
    """``logits`` [vocab] of the new token at 0-based ``position``, with every EOS id at -inf while
    ``position < min_new_tokens`` (transformers' ``min_new_tokens``: the target's distribution conditioned
    on not stopping yet, so decoding stays exactly the target's). Returns a copy only when it masks."""
    return hold_eos_rows(logits[None], eos_ids, [position], min_new_tokens)[0]


def hold_eos_rows(logits: torch.Tensor, eos_ids: set[int], positions: list[int], min_new_tokens: int) -> torch.Tensor:
    """:func:`hold_eos` for a batch: ``logits`` [n, vocab], row i predicting the new token at ``positions[i]``."""
    rows = [i for i, position in enumerate(positions) if position < min_new_tokens]
    eos = sorted(i for i in eos_ids if i < logits.shape[-1])
    if not rows or not eos:
        return logits
    held = logits.clone()
    held[device_tensor(rows, held.device)[:, None], device_tensor(eos, held.device)[None, :]] = float("-inf")
    return held


def validate_prompt(prompt_ids: Sequence[int], max_new_tokens: int, context_window: int | None) -> None:
    if len(prompt_ids) == 0:
        raise PromptError("empty prompt: the prompt must hold at least one token")
    if max_new_tokens < 1:
        raise PromptError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if context_window is not None and len(prompt_ids) + max_new_tokens > context_window:
        raise PromptError(
            f"prompt of {len(prompt_ids)} tokens + max_new_tokens {max_new_tokens} exceeds the model's "
            f"context window of {context_window} tokens; shorten the prompt or lower max_new_tokens"
        )


def prepare_prompt(prompt_ids: Sequence[int] | torch.Tensor, max_new_tokens: int, window: int | None) -> list[int]:
    """The prompt as a list of ints, checked against the engine's context ``window`` (:class:`PromptError`)."""
    if isinstance(prompt_ids, torch.Tensor):
        prompt_ids = prompt_ids.flatten().tolist()
    prompt_ids = [int(t) for t in prompt_ids]
    validate_prompt(prompt_ids, max_new_tokens, window)
    return prompt_ids


def extend_until_stop(tokens: list[int], new: Sequence[int], eos_ids: set[int], max_new_tokens: int) -> str | None:
    """Append ``new`` to ``tokens`` up to and including the first EOS, never past ``max_new_tokens``.

    Returns ``"eos"`` or ``"max_new_tokens"`` when generation must stop, else None.
    """
    for token in new:
        tokens.append(token)
        if token in eos_ids:
            return "eos"
        if len(tokens) >= max_new_tokens:
            return "max_new_tokens"
    return None


def make_generator(sampling: SamplingConfig, device: torch.device) -> torch.Generator | None:
    """A seeded generator on ``device`` for sampling; None for greedy decoding."""
    if sampling.greedy:
        return None
    return torch.Generator(device=device).manual_seed(sampling.seed)


class AutoregressiveDecoder:
    """``ar``: greedy or sampled decoding with the target engine's one-token step, one forward per token
    (the reference for speed and output equality on every engine).

    Usage::

        dec = decoder_for("ar", engines)  # treegraft.front
        result = dec.generate(prompt_ids, max_new_tokens=256)
    """

    def __init__(self, engine: TargetEngine, eos_ids: set[int], sampling: SamplingConfig | None = None):
        self.engine = engine
        self.eos_ids = set(eos_ids)
        self.sampling = sampling or SamplingConfig()

    @torch.inference_mode()
    def generate(self, prompt_ids: Sequence[int] | torch.Tensor, max_new_tokens: int,
                 on_tokens: Callable[[list[int]], None] | None = None, min_new_tokens: int = 0) -> GenerationResult:
        """Decode ``prompt_ids``; ``on_tokens(new)``, if given, receives each emitted token as it arrives;
        no EOS among the first ``min_new_tokens`` tokens (:func:`hold_eos`)."""
        engine = self.engine
        prompt_ids = prepare_prompt(prompt_ids, max_new_tokens, engine.context_window())
        clock = engine.clock
        start = clock.now()
        logits = engine.start(prompt_ids)
        start -= engine.prefill_charge_s  # a shared prompt encoding counts in full (llama.cpp's PromptReuse)
        prefill_time = clock.now() - start
        generator = make_generator(self.sampling, engine.head_device)
        tokens: list[int] = []
        try:
            while True:
                token = sample_from_logits(hold_eos(logits, self.eos_ids, len(tokens), min_new_tokens), self.sampling,
                                           generator)
                stop_reason = extend_until_stop(tokens, [token], self.eos_ids, max_new_tokens)
                if on_tokens is not None:
                    on_tokens([token])
                if stop_reason:
                    break
                logits = engine.step(token)
            wall = clock.now() - start
        finally:
            engine.release()
        return GenerationResult(tokens=tokens, prompt_tokens=len(prompt_ids), wall_time_s=wall,
                                prefill_time_s=prefill_time, stop_reason=stop_reason)
