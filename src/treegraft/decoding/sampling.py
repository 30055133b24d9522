"""Turning logits into a next-token distribution (temperature, top-k, top-p) and drawing from it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["SamplingConfig", "target_distribution", "sample_from_logits"]


@dataclass
class SamplingConfig:
    """``temperature == 0`` means greedy decoding; ``top_k > 0`` keeps the k most likely tokens, ``top_p < 1``
    the smallest nucleus of mass ``top_p`` (applied in that order, as transformers does)."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    top_k: int = 0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def target_distribution(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """Probabilities (float32, last dim = vocab) after temperature, top-k and top-p. Not for greedy."""
    scores = logits.float() / cfg.temperature
    if 0 < cfg.top_k < scores.shape[-1]:
        kth = scores.topk(cfg.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if cfg.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        # keep a token if the mass strictly before it is < top_p (so the top token is always kept)
        keep_sorted = (sorted_p.cumsum(-1) - sorted_p) < cfg.top_p
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        probs = torch.where(keep, probs, torch.zeros_like(probs))
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample_from_logits(logits: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator | None) -> int:
    """One token id from a 1-D logits vector: argmax when greedy, else a draw from the target distribution."""
    if cfg.greedy:
        return int(torch.argmax(logits))
    probs = target_distribution(logits, cfg)
    return int(torch.multinomial(probs, 1, generator=generator))
