"""The scheduler interface: per drafting step, call the middle drafter (1) or skip it (0).

A policy sees a :class:`StepState` measured before the step's action (the scheduler state): runtime context,
scheduling history and, if it asks for them (``needs_signals``), the tree signals.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol, Sequence

__all__ = ["StepState", "Scheduler", "FixedScheduler", "CostAwareFixedScheduler", "runtime_features", "history_features"]


@dataclass
class StepState:
    step: int  # 1..depth
    depth: int  # D
    history: list[int]  # actions of steps 1..step-1
    prompt_len: int
    t_tgt_ms: float  # ms per verification forward (measured at warm-up)
    t_mid_ms: float  # ms per middle-drafter forward (measured at warm-up)
    signals: dict[str, float] | None = None


def runtime_features(state: StepState) -> list[float]:
    """log(1 + prompt length), t_tgt, t_mid, log(t_tgt / t_mid) (0 where undefined)."""
    ratio = math.log(state.t_tgt_ms / state.t_mid_ms) if state.t_tgt_ms > 0 and state.t_mid_ms > 0 else 0.0
    return [math.log1p(state.prompt_len), state.t_tgt_ms, state.t_mid_ms, ratio]


def history_features(state: StepState) -> list[float]:
    """t / D, calls so far / D, and one bit per step 1..D (1 where that earlier step was a call)."""
    bits = [float(state.history[i]) if i < len(state.history) else 0.0 for i in range(state.depth)]
    return [state.step / state.depth, sum(state.history) / state.depth, *bits]


class Scheduler(Protocol):
    needs_signals: bool

    def decide(self, state: StepState) -> int: ...


class FixedScheduler:
    """Always the same schedule, e.g. ``[1, 0, 1, 0, 1]``."""

    needs_signals = False

    def __init__(self, actions: Sequence[int] | str):
        if not len(actions) or any(str(a) not in ("0", "1") for a in actions):
            raise ValueError(f"a fixed schedule is 0/1 actions, one per step; got {actions!r}")
        self.actions = [int(a) for a in actions]
        self.schedule = "".join(map(str, self.actions))
        self.policy_name = "fixed:" + self.schedule

    def decide(self, state: StepState) -> int:
        return self.actions[state.step - 1]


class CostAwareFixedScheduler:
    """The fixed fallback, re-picked for the pair it decodes: ``by_middle_cost`` maps b (how many times dearer a
    middle forward is, against a target step, than on the fitted pair, whose t_mid / t_tgt is ``ref_mid_over_tgt``)
    to the best fixed schedule on the fitted turns with their middle-forward latency scaled by b; the first state's
    measured t_mid / t_tgt gives b, rounded *up* to the grid, once per measured context.

    Why up, not to the nearest grid point: the table prices another pair's turns, and a call is where a transfer
    error costs (a skipped call leaves the n-gram tree, which does not depend on the middle drafter). On the
    held-out self-draft pair, measured at b = 2.4-2.6 against a table whose calling and non-calling schedules
    cross at 2.55, the nearest point called in half the benchmarks and ran 20% behind the n-gram tree."""

    needs_signals = False

    def __init__(self, by_middle_cost: dict[str, str], ref_mid_over_tgt: float, default: str):
        if not by_middle_cost or ref_mid_over_tgt <= 0:
            raise ValueError(f"a cost-aware fallback needs schedules by middle cost and a positive reference ratio, "
                             f"got {by_middle_cost!r}, {ref_mid_over_tgt!r}")
        self.grid = sorted((float(b), s) for b, s in by_middle_cost.items())
        self.ref = float(ref_mid_over_tgt)
        self.default = FixedScheduler(default)  # (validates it) where a state carries no timings
        self.chosen: dict[tuple[float, float], FixedScheduler] = {}  # per measured context: one object may serve two pairs
        self.policy_name = self.default.policy_name

    def schedule_for(self, t_tgt_ms: float, t_mid_ms: float) -> str:
        if not (t_tgt_ms > 0 and t_mid_ms > 0):
            return self.default.schedule
        b = (t_mid_ms / t_tgt_ms) / self.ref
        return next((schedule for g, schedule in self.grid if g >= b * (1 - 1e-9)), self.grid[-1][1])

    def for_context(self, t_tgt_ms: float, t_mid_ms: float) -> FixedScheduler:
        """The fixed schedule this measured context decodes with (what :meth:`decide` follows)."""
        key = (t_tgt_ms, t_mid_ms)
        if key not in self.chosen:
            self.chosen[key] = FixedScheduler(self.schedule_for(*key))
        return self.chosen[key]

    def decide(self, state: StepState) -> int:
        chosen = self.for_context(state.t_tgt_ms, state.t_mid_ms)
        self.policy_name = chosen.policy_name
        return chosen.decide(state)
