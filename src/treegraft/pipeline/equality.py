"""Comparing a method's greedy output with `ar`'s, and telling numeric ties from real mismatches.

In float32 every method must emit exactly `ar`'s tokens. In lower precision a tree forward and a
one-token forward round differently, so a near-tie between the two best tokens can flip. At the
first differing position we therefore look at the float32 target's top-2 logit gap given the shared
prefix: a gap within ``tie_tolerance`` explains the mismatch as a tie, which the greedy-equality check tolerates.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..devices import input_device

__all__ = ["MismatchReport", "compare_outputs"]


@dataclass
class MismatchReport:
    equal: bool
    position: int | None = None  # first differing index into the new tokens
    top2_gap: float | None = None  # float32 target's logit gap there
    explained_by_tie: bool = True


def compare_outputs(
    reference: list[int],
    tokens: list[int],
    prompt_ids: list[int] | None = None,
    target_fp32: nn.Module | None = None,
    tie_tolerance: float = 0.5,
) -> MismatchReport:
    """Whether ``tokens`` equal ``reference``; if not, whether a float32 near-tie explains the first difference.

    Without ``target_fp32`` a mismatch counts as unexplained.
    """
    if tokens == reference:
        return MismatchReport(equal=True)
    n = min(len(tokens), len(reference))
    position = next((i for i in range(n) if tokens[i] != reference[i]), n)
    if target_fp32 is None or prompt_ids is None or position >= n:
        return MismatchReport(equal=False, position=position, explained_by_tie=False)
    device = input_device(target_fp32)
    context = torch.tensor([list(prompt_ids) + list(reference[:position])], device=device)
    with torch.inference_mode():
        logits = target_fp32(context, logits_to_keep=1).logits[0, -1].float()
    top2 = logits.topk(2).values
    gap = float(top2[0] - top2[1])
    return MismatchReport(equal=False, position=position, top2_gap=gap, explained_by_tie=gap <= tie_tolerance)
