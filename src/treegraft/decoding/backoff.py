"""Backing off middle-drafter calls within a prompt when they cost more than they return.

A learned scheduler prices a call with value heads fitted on other prompts. On a prompt where the
middle drafter's proposals keep being rejected (an open-ended answer with little to copy or
predict), every call adds ``t_mid`` to a turn that still emits about one token, and the method runs
slower than plain decoding. :class:`CallGate` watches this prompt's own turns: the throughput of the
turns that called the middle drafter (tokens over seconds, decayed so recent turns count most),
against what a plain decoding step would have produced in that time (one token per one-row
verification forward, from the budget planner's rescaled verification curve). When the call turns
fall below that rate, the gate closes for a cooldown of a few turns (the n-gram drafter alone builds
the tree, and ``budget=auto`` already shrinks it to what its scores justify), then opens for a probe;
each failure in a row doubles the cooldown.

Before any call, the first call of a prompt also pays for the middle drafter encoding the prompt (its
lazy catch-up): on a CPU that is a prefill of the whole prompt by the drafter (15 s for a 612-token
article on a Zen 1 EPYC, where plain decoding of the whole 96-token answer takes 11 s). Calls can at
best save a share of plain decoding's time, so where the catch-up alone would cost more than
``catch_up_share`` of it, the gate stays shut for the prompt (on a GPU the catch-up is milliseconds).

The gate changes only which drafter proposes; verification is untouched, so the output stays the
target's own (greedy-equal, distribution-equal when sampling).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CallGate"]


@dataclass
class CallGate:
    """Per-prompt back-off of middle-drafter calls (see the module docstring).

    min_call_turns: call turns observed before the gate may first close (the prompt's first call turn,
        which also encodes the prompt into the middle drafter's cache, is not counted).
    decay: weight of the history at each new call turn (tokens and seconds decay alike).
    margin: call turns must reach ``margin`` x the plain decoding rate to keep the gate open.
    first_cooldown / max_cooldown: turns the gate stays closed after the first failure / at most.
    catch_up_share: the gate stays shut for a prompt whose catch-up would cost more than this share of
        plain decoding's time for the whole answer (see the module docstring).
    """

    min_call_turns: int = 3
    decay: float = 0.7
    margin: float = 1.0
    first_cooldown: int = 4
    max_cooldown: int = 32
    catch_up_share: float = 0.5

    def __post_init__(self) -> None:
        if not 0.0 <= self.decay < 1.0:
            raise ValueError(f"backoff decay must be in [0, 1), got {self.decay}")
        if self.min_call_turns < 1 or self.first_cooldown < 1 or self.max_cooldown < self.first_cooldown:
            raise ValueError("backoff needs min_call_turns >= 1 and 1 <= first_cooldown <= max_cooldown, got "
                             f"{self.min_call_turns}, {self.first_cooldown}, {self.max_cooldown}")
        self.reset()

    def reset(self, catch_up_s: float = 0.0, plain_answer_s: float = float("inf")) -> None:
        """Forget everything (a new prompt). ``catch_up_s``: what encoding the prompt into the middle
        drafter would add to the first call; ``plain_answer_s``: plain decoding's time for the whole answer."""
        self.shut = catch_up_s > self.catch_up_share * plain_answer_s  # for the whole prompt
        self.tokens = 0.0  # decayed sums over call turns
        self.seconds = 0.0
        self.call_turns = 0
        self.closed_for = 0  # turns left before the next probe
        self.cooldown = self.first_cooldown
        self.closures = 0  # times the gate closed on this prompt
        self.first_seen = False

    @property
    def is_open(self) -> bool:
        """Whether this turn's scheduler may call the middle drafter."""
        return self.closed_for == 0 and not self.shut

    def call_rate_ratio(self, plain_step_s: float) -> float | None:
        """The call turns' throughput over plain decoding's (1 token per ``plain_step_s``); None before any."""
        if self.seconds <= 0 or plain_step_s <= 0:
            return None
        return (self.tokens / self.seconds) * plain_step_s

    def observe(self, emitted: int, turn_s: float, calls: int, plain_step_s: float) -> None:
        """Fold in one finished turn: ``emitted`` tokens in ``turn_s`` seconds with ``calls`` middle calls;
        ``plain_step_s``: the seconds a plain decoding step would take now."""
        if self.shut:
            return
        if not self.is_open:  # time passes: the turns before the back-off weigh less at the probe
            self.closed_for -= 1
            self.tokens *= self.decay
            self.seconds *= self.decay
            return
        if calls <= 0:
            return
        if not self.first_seen:  # the prompt's first call turn also encodes the prompt (lazy catch-up)
            self.first_seen = True
            return
        self.tokens = self.decay * self.tokens + float(emitted)
        self.seconds = self.decay * self.seconds + float(turn_s)
        self.call_turns += 1
        ratio = self.call_rate_ratio(plain_step_s)
        if ratio is None or self.call_turns < self.min_call_turns:
            return
        if ratio < self.margin:
            self.closed_for = self.cooldown
            self.cooldown = min(2 * self.cooldown, self.max_cooldown)
            self.closures += 1
        else:
            self.cooldown = self.first_cooldown
