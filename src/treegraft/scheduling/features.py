"""Feature vectors of the scheduler (SPEC 5.1, 5.3): the state and the future-suffix encoding.

state   = runtime context (4) + history (2 + D) + the selected tree signals (k)
suffix  = D bits aligned to absolute steps: bit s is 1 iff s > t and step s is a call

One function builds the state vector from a live :class:`StepState` (online) and the same order is
used for the collected rows (offline), so a fitted model and the runtime policy agree by construction.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .policy import StepState, history_features, runtime_features
from .signals import SIGNAL_NAMES

__all__ = [
    "RUNTIME_NAMES",
    "history_names",
    "state_names",
    "state_vector",
    "suffix_names",
    "suffix_vector",
    "signal_column",
]

RUNTIME_NAMES = ("log_prompt_len", "t_tgt_ms", "t_mid_ms", "log_tgt_mid_ratio")


def history_names(depth: int) -> list[str]:
    return ["step_frac", "calls_frac", *[f"hist_{s}" for s in range(1, depth + 1)]]


def signal_column(name: str) -> str:
    return f"sig_{name}"


def state_names(depth: int, signals: Sequence[str]) -> list[str]:
    """Column names of the state vector with the tree signals ``signals`` (in that order)."""
    unknown = [s for s in signals if s not in SIGNAL_NAMES]
    if unknown:
        raise ValueError(f"unknown tree signal(s) {unknown}; expected names from {list(SIGNAL_NAMES)}")
    return [*RUNTIME_NAMES, *history_names(depth), *[signal_column(s) for s in signals]]


def state_vector(state: StepState, signals: Sequence[str]) -> np.ndarray:
    """The state of ``state`` as float64 [len(state_names)]; signals missing from the state count as 0."""
    values = runtime_features(state) + history_features(state)
    sig = state.signals or {}
    values += [float(sig.get(s, 0.0)) for s in signals]
    return np.asarray(values, dtype=np.float64)


def suffix_names(depth: int) -> list[str]:
    return [f"suffix_{s}" for s in range(1, depth + 1)]


def suffix_vector(step: int, suffix: str | Sequence[int], depth: int) -> np.ndarray:
    """Actions of steps step+1..D (``suffix`` has D - step entries) as D absolute-step bits."""
    suffix = [int(a) for a in suffix]
    if len(suffix) != depth - step:
        raise ValueError(f"suffix after step {step} of {depth} must have {depth - step} actions, got {suffix}")
    bits = np.zeros(depth)
    bits[step:] = suffix
    return bits
