"""Accepting draft tokens against the target: greedy walk and lossless multi-candidate sampling.

Both walk the kept tree from the root. Target logits are produced lazily, in batches of rows the walk
is likely to visit (``row_logits(row)`` / ``row_argmax(row)``: the caller batches, computes and reads); the walk
itself reads the device once per visited row at most (sampling) or not at all (greedy: the argmaxes of a
batch come back in one read).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..devices import device_tensor
from ..tree import TreeInputs
from .sampling import SamplingConfig, target_distribution

__all__ = ["Acceptance", "accept_greedy", "accept_sampling"]


@dataclass
class Acceptance:
    """``rows``: input rows of the root and every accepted node, in path order; ``bonus``: the extra token."""

    rows: list[int]
    bonus: int
    logits: list[torch.Tensor]  # the target's logits at each of ``rows`` (float32 [V], on the head's device)

    @property
    def accepted(self) -> int:
        return len(self.rows) - 1


def accept_greedy(inputs: TreeInputs, row_argmax: Callable[[int], int],
                  row_logits: Callable[[int], torch.Tensor]) -> Acceptance:
    """Follow the child whose token is the target's argmax; the bonus is the argmax where that fails.
    ``row_argmax(row)``: the target's argmax at a row (host int); ``row_logits(row)``: its logits."""
    rows = [0]
    while True:
        best = row_argmax(rows[-1])
        child = inputs.child_rows[rows[-1]].get(best)
        if child is None:
            return Acceptance(rows=rows, bonus=best, logits=[row_logits(r) for r in rows])
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

    With distinct child tokens x_1..x_k, ``r`` at the j-th try is ``p`` over the untried tokens divided by
    ``1 - (p(x_1) + ... + p(x_{j-1}))``; so one read of ``p`` at the children and k uniform draws decides a
    node, and one more read draws the bonus from ``p`` with the rejected tokens removed.
    """
    rows, logits = [0], []
    while True:
        row = rows[-1]
        lg = row_logits(row)
        logits.append(lg)
        probs = target_distribution(lg, cfg)
        kids = child_order(row)
        rejected: list[int] = []
        if kids:
            tokens = device_tensor([inputs.token_ids[c] for c in kids], probs.device)
            draws = torch.rand(len(kids), generator=generator, device=probs.device)
            mass, uniform = torch.stack([probs[tokens].double(), draws.double()]).tolist()  # one read
            left = 1.0  # the probability mass not yet rejected
            moved = False
            for child, p, u in zip(kids, mass, uniform):
                if left <= 0:  # cannot happen with a proper distribution, but never divide by zero
                    break
                if p > 0 and u < p / left:
                    rows.append(child)
                    moved = True
                    break
                rejected.append(inputs.token_ids[child])
                left -= p
            if moved:
                continue
        if rejected:
            probs = probs.clone()
            probs[device_tensor(rejected, probs.device)] = 0.0
        bonus = int(torch.multinomial(probs, 1, generator=generator))
        return Acceptance(rows=rows, bonus=bonus, logits=logits)
