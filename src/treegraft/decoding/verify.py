"""Accepting draft tokens against the target: greedy walk and lossless multi-candidate sampling.

Both walk the kept tree from the root. Target logits are produced lazily, one row per visited node
(``row_logits(row)``), since only the rows on the accepted path are ever needed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..tree import TreeInputs
from .sampling import SamplingConfig, target_distribution

__all__ = ["Acceptance", "accept_greedy", "accept_sampling"]


@dataclass
class Acceptance:
    """``rows``: input rows of the root and every accepted node, in path order; ``bonus``: the extra token."""

    rows: list[int]
    bonus: int
    logits: list[torch.Tensor]  # the target's logits at each of ``rows`` (float32 [V])

    @property
    def accepted(self) -> int:
        return len(self.rows) - 1


def accept_greedy(inputs: TreeInputs, row_logits: Callable[[int], torch.Tensor]) -> Acceptance:
    """Follow the child whose token is the target's argmax; the bonus is the argmax where that fails."""
    rows, logits = [0], []
    while True:
        row = rows[-1]
        lg = row_logits(row)
        logits.append(lg)
        best = int(torch.argmax(lg))
        child = inputs.child_rows[row].get(best)
        if child is None:
            return Acceptance(rows=rows, bonus=best, logits=logits)
        rows.append(child)


def accept_sampling(
    inputs: TreeInputs,
    row_logits: Callable[[int], torch.Tensor],
    child_order: Callable[[int], list[int]],
    cfg: SamplingConfig,
    generator: torch.Generator | None,
) -> Acceptance:
    """Lossless acceptance of deterministic candidates (sequential rejection sampling).

    At a node with target distribution ``p``, the residual ``r`` starts as ``p``; children are tried
    in ``child_order`` (best ``cum`` first): child token x is accepted with probability ``r(x)``; on
    rejection ``r(x) = 0`` and ``r`` is renormalised. If every child is rejected (or there is none),
    the bonus token is drawn from ``r``. For any candidate set chosen without looking at the target's
    randomness, the emitted token has exactly the distribution ``p``.
    """
    rows, logits = [0], []
    while True:
        row = rows[-1]
        lg = row_logits(row)
        logits.append(lg)
        residual = target_distribution(lg, cfg)
        moved = False
        for child in child_order(row):
            token = int(inputs.tokens[child])
            mass = float(residual[token])
            if mass > 0 and float(torch.rand((), generator=generator, device=residual.device)) < mass:
                rows.append(child)
                moved = True
                break
            residual[token] = 0.0
            total = residual.sum()
            if total <= 0:  # cannot happen with a proper distribution, but never divide by zero
                break
            residual = residual / total
        if not moved:
            bonus = int(torch.multinomial(residual, 1, generator=generator))
            return Acceptance(rows=rows, bonus=bonus, logits=logits)
