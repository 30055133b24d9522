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

from ..devices import Clock, device_tensor
from ..engines.protocols import TargetEngine
from ..tree import DraftTree, TreeInputs, build_tree_inputs
from .sampling import SamplingConfig, target_distribution
from .turn_stats import TurnStats

__all__ = ["Acceptance", "accept_greedy", "accept_sampling", "verify_tree", "LIKELY_ROW_P"]

# verification computes the LM head in one batch for a row and its best-scored descendants while the
# parent's acceptance probability is at least this: an extra row in a batch costs ~1/13 of a lone row
LIKELY_ROW_P = 0.08


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


def verify_tree(engine: TargetEngine, tree: DraftTree, kept: list[int], clock: Clock, stats: TurnStats,
                p_accept: Callable[[float], float], sampling: SamplingConfig, generator=None,
                hold: Callable[[torch.Tensor, list[int]], torch.Tensor] | None = None):
    """Verify the ``kept`` nodes of ``tree`` with one target forward on top of the engine's cache.

    Returns ``(inputs, acceptance)``. The target cache then holds the context plus every verified row;
    the caller keeps the accepted rows (``engine.keep``) or drops them all (``engine.rollback``). The LM
    head runs only on the rows acceptance visits, in batches: the root and the chain of its best-scored
    descendants likely to be accepted (``p_accept(path score) >= LIKELY_ROW_P``) at once, and where the
    walk leaves that chain, the row it reaches together with that row's own likely chain. ``hold(logits,
    depths)``: the rows' logits with EOS held back (``min_new_tokens``), None where nothing is held.
    """
    start = clock.now()
    L = engine.context_len()
    inputs = build_tree_inputs(tree, kept, L)
    fwd = clock.now()
    forward = engine.forward_tree(inputs)
    stats.target_forward_s += clock.now() - fwd
    logits_of: dict[int, torch.Tensor] = {}
    argmax_of: dict[int, int] = {}
    greedy = sampling.greedy

    def likely_chain(row: int) -> list[int]:
        chain = [row]
        while inputs.child_rows[chain[-1]]:
            best = max(inputs.child_rows[chain[-1]].values(), key=lambda r: (tree.cum[inputs.node_ids[r]], -r))
            if p_accept(tree.cum[inputs.node_ids[best]]) < LIKELY_ROW_P:
                break
            chain.append(best)
        return chain

    def fetch(row: int) -> None:
        """The LM head on ``row`` and its likely chain in one batch; greedy: their argmaxes in one host read."""
        t0 = clock.now()
        batch = [r for r in likely_chain(row) if r not in logits_of]
        logits = forward.logits(batch)
        if hold is not None:
            logits = hold(logits, [inputs.positions[r] - L for r in batch])
        if greedy:
            argmax_of.update(zip(batch, logits.argmax(dim=-1).tolist()))
        logits_of.update(zip(batch, logits))
        stats.target_forward_s += clock.now() - t0

    def row_logits(row: int) -> torch.Tensor:
        if row not in logits_of:
            fetch(row)
        return logits_of[row]

    def row_argmax(row: int) -> int:
        if row not in argmax_of:
            fetch(row)
        return argmax_of[row]

    if greedy:
        acc = accept_greedy(inputs, row_argmax, row_logits)
    else:
        def child_order(row: int) -> list[int]:
            kids = list(inputs.child_rows[row].values())
            return sorted(kids, key=lambda r: (-tree.cum[inputs.node_ids[r]], inputs.node_ids[r]))

        acc = accept_sampling(inputs, row_logits, child_order, sampling, generator)
    stats.verify_s += clock.now() - start
    return inputs, acc
