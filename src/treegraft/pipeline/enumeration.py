"""Exhaustive schedule enumeration for one decoding turn (the scheduler's training data).

From one starting state (target cache, n-gram index, middle drafter cache), build the shared tree
under every one of the 2^D schedules, verify each with the target and record, per schedule, the
accepted length and the latency split; per step, the pre-action state. Schedules that share a
prefix share its work: the construction is a depth-first walk over the binary schedule tree, each
branch continuing from a copy of the tree and a snapshot of the middle drafter, so a turn costs
2 + 4 + ... + 2^D = 2^(D+1) - 2 drafting steps instead of D * 2^D (62 instead of 160 for D = 5),
plus one verification per distinct pruned tree (at most 2^D).

Latency of a schedule = the measured wall times of its steps (each step measured once, where the
walk ran it) + the measured time of its own verification. The state computation (signals) is not
part of the latency: it is the scheduler's own overhead, measured separately.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..decoding.builders import BuildState
from ..decoding.tree_decoder import TreeGraftDecoder
from ..decoding.turn_stats import TurnStats
from ..tree import DraftTree, prune_to_budget
from ..scheduling.policy import StepState

__all__ = ["ScheduleOutcome", "TurnEnumeration", "enumerate_turn", "schedule_key"]


def schedule_key(actions) -> str:
    """A schedule (or prefix) as a string of 0/1, e.g. ``"10101"``."""
    return "".join(str(int(a)) for a in actions)


@dataclass
class ScheduleOutcome:
    """One complete schedule of one turn."""

    schedule: str
    accepted: int  # AL: accepted draft tokens (the bonus token not counted)
    latency_s: float  # steps + verification, measured
    small_s: float
    middle_s: float
    verify_s: float
    small_calls: int
    middle_calls: int  # middle-drafter forwards actually run (steps past the budget are skipped)
    middle_tokens: int  # tokens through the middle drafter's forwards (for the cost model)
    tree_nodes: int
    verified_nodes: int


@dataclass
class TurnEnumeration:
    """Every schedule's outcome and the pre-action state after every prefix (``""`` = before step 1)."""

    outcomes: dict[str, ScheduleOutcome] = field(default_factory=dict)
    states: dict[str, StepState] = field(default_factory=dict)
    steps_run: int = 0  # drafting steps executed by the shared walk
    verifications: int = 0  # target forwards run (schedules whose pruned trees coincide share one)
    wall_s: float = 0.0  # wall time of the whole enumeration (walk + verifications + states)

    def throughput(self, schedule: str) -> float:
        """Tokens per second of the turn under ``schedule``: (AL + 1) / latency."""
        o = self.outcomes[schedule]
        return (o.accepted + 1) / o.latency_s


@torch.inference_mode()
def enumerate_turn(decoder: TreeGraftDecoder, root: int, with_signals: bool = True) -> TurnEnumeration:
    """Enumerate all 2^D schedules of the turn whose root is ``root``, leaving the decoder's state as it was.

    The decoder must be a shared-tree method (``fixed`` or an ablation) with a middle drafter. It works
    through the engine protocols only: the target rolls every verified tree back (``engine.rollback``) and the
    drafters (middle, and a neural small one) restore a snapshot at every branch, so the caller continues
    with an ordinary turn.
    """
    if not decoder.cfg.preset.shared or decoder.middle is None:
        raise ValueError(f"schedule enumeration needs a shared-tree method with a middle drafter, got {decoder.cfg.method}")
    depth = decoder.cfg.depth
    mid = decoder.middle
    # every drafter with a per-turn cache (the middle drafter, a neural small drafter): its slots name this
    # construction's nodes, and a branch built on a copy of the tree gives other nodes the same ids, so each
    # branch restores the drafters' state its parent left
    drafters = [d for d in (mid, decoder.small) if d is not None]

    def snapshot() -> tuple:
        return tuple(d.snapshot() for d in drafters)

    def restore(snap: tuple) -> None:
        for d, s in zip(drafters, snap):
            d.restore(s)

    result = TurnEnumeration()
    clock = decoder.clock  # waits for the models' devices: a step's time is its GPU work, not its launch
    t_start = clock.now()
    tree, build = decoder.start_tree(root)
    base = snapshot()
    context_len = decoder.engine.context_len()
    verified: dict[tuple, tuple[int, float, int]] = {}
    if not decoder.sampling.greedy:
        raise ValueError("schedule enumeration labels turns by greedy acceptance; use temperature 0")

    def walk(tree: DraftTree, build: BuildState, prefix: str, spent: dict, snap: tuple) -> None:
        step = len(prefix) + 1
        if step > depth:
            kept = prune_to_budget(tree, decoder.budget_for(tree))
            # greedy acceptance depends only on the pruned tree's token structure: schedules whose
            # pruned trees coincide (common when B_ver is small) share one verification
            signature = tuple(sorted(tuple(tree.path_tokens(n)) for n in kept))
            if signature not in verified:
                stats = TurnStats()
                inputs, acc = decoder.verify_tree(tree, stats)
                decoder.engine.rollback(context_len)
                verified[signature] = (acc.accepted, stats.verify_s, inputs.size - 1)
                result.verifications += 1
            accepted, verify_s, n_verified = verified[signature]
            result.outcomes[prefix] = ScheduleOutcome(
                schedule=prefix,
                accepted=accepted,
                latency_s=spent["small_s"] + spent["middle_s"] + spent["other_s"] + verify_s,
                small_s=spent["small_s"],
                middle_s=spent["middle_s"],
                verify_s=verify_s,
                small_calls=spent["small_calls"],
                middle_calls=spent["middle_calls"],
                middle_tokens=spent["middle_tokens"],
                tree_nodes=len(tree),
                verified_nodes=n_verified,
            )
            return
        result.states[prefix] = decoder.step_state(tree, step, [int(a) for a in prefix], with_signals)
        for action in (0, 1):
            restore(snap)
            branch_tree = tree.copy() if action == 0 else tree  # the call branch reuses the original
            branch_build = build.copy() if action == 0 else build
            stats = TurnStats()
            tokens_before = mid.tokens_encoded
            t0 = clock.now()
            decoder.apply_step(branch_tree, branch_build, step, action, stats)
            elapsed = clock.now() - t0
            result.steps_run += 1
            child = {
                "small_s": spent["small_s"] + stats.small_s,
                "middle_s": spent["middle_s"] + stats.middle_s,
                # step time outside both drafters (selection, bookkeeping)
                "other_s": spent["other_s"] + max(0.0, elapsed - stats.small_s - stats.middle_s),
                "small_calls": spent["small_calls"] + stats.small_calls,
                "middle_calls": spent["middle_calls"] + stats.middle_calls,
                "middle_tokens": spent["middle_tokens"] + mid.tokens_encoded - tokens_before,
            }
            walk(branch_tree, branch_build, prefix + str(action), child, snapshot())

    # the skip branch runs first on a copy, so the call branch may consume the parent's tree
    walk(tree, build, "", {"small_s": 0.0, "middle_s": 0.0, "other_s": 0.0, "small_calls": 0, "middle_calls": 0,
                           "middle_tokens": 0}, base)
    restore(base)
    result.wall_s = clock.now() - t_start
    return result
