"""What one turn did and what it cost: a typed record, written by the decoder and its tree builders."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

__all__ = ["TurnStats"]


@dataclass
class TurnStats:
    """One turn's time split (seconds) and counts. :meth:`record` is the JSON-ready dict a
    :class:`~treegraft.decoding.GenerationResult` keeps per turn.

    The four parts of ``turn_s``: ``small_s`` (the small drafter: n-gram lookups and its cache update, or a
    neural small drafter's forwards, proposals and cache upkeep),
    ``middle_s`` (middle-drafter steps: forwards and grafting), ``verify_s`` (pruning, the target's
    forward, acceptance, cache compaction) and ``other_s`` (everything else: scheduling, bookkeeping).
    """

    small_s: float = 0.0
    middle_s: float = 0.0
    verify_s: float = 0.0
    other_s: float = 0.0
    turn_s: float = 0.0
    target_forward_s: float = 0.0  # inside the target's forward and LM-head rows
    middle_forward_s: float = 0.0  # inside the middle drafter's forwards and LM-head rows
    small_forward_s: float = 0.0  # inside a neural small drafter's forwards and LM-head rows (0 for the n-gram drafter)
    outside_forward_s: float = 0.0  # turn_s minus every model's forwards
    small_propose_s: float = 0.0  # the small drafter's proposals only (the per-call cost of the small drafter)
    schedule_s: float = 0.0  # the scheduler's state and decisions
    small_calls: int = 0  # nodes the small drafter expanded
    middle_calls: int = 0  # middle-drafter steps that ran a forward
    skipped_steps: int = 0  # steps left out because they could not change the pruned tree
    backed_off: bool = False  # the call gate held the middle drafter back this turn
    schedule: list[int] = field(default_factory=list)  # the actions taken (1 = call)
    accepted: int = 0  # AL: accepted draft tokens, the bonus token not counted
    tree_nodes: int = 0
    verified_nodes: int = 0
    budget: int = 0  # B_ver verified this turn
    grafts_kept: int = 0  # non-destructive grafts that kept a historical branch (DraftTree.grafts)
    accepted_on_kept: int = 0  # accepted draft tokens on a branch only non-destructive grafting kept

    def record(self) -> dict:
        return asdict(self)
