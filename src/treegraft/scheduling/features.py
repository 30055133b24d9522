"""Feature vectors of the scheduler and its value heads: the state and the future-suffix encoding.

state   = the selected runtime context (of 4) + history (2 + D) + the selected tree signals (k)
suffix  = D bits aligned to absolute steps: bit s is 1 iff s > t and step s is a call

The selected features are one list of names from :data:`RUNTIME_NAMES` and the tree signals: the
paper's state has all four runtime-context features, and the signal selection (``fit``) starts from
them but may drop one where the grouped out-of-fold score says it hurts (with one pair,
log(1 + prompt length) mostly tells the fitted benchmarks apart and misleads on a held-out one).

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
    "feature_column",
    "signals_among",
    "ALL_FEATURES",
]

RUNTIME_NAMES = ("log_prompt_len", "t_tgt_ms", "t_mid_ms", "log_tgt_mid_ratio")


def history_names(depth: int) -> list[str]:
    return ["step_frac", "calls_frac", *[f"hist_{s}" for s in range(1, depth + 1)]]


ALL_FEATURES = (*RUNTIME_NAMES, *SIGNAL_NAMES)  # every selectable feature (the rows collect records)


def signal_column(name: str) -> str:
    return f"sig_{name}"


def feature_column(name: str) -> str:
    """The collected rows' column of a selectable feature (runtime context as is, signals ``sig_*``)."""
    return name if name in RUNTIME_NAMES else signal_column(name)


def signals_among(features: Sequence[str]) -> list[str]:
    """The tree signals among ``features`` (what the decoder has to compute for the policy)."""
    return [f for f in features if f not in RUNTIME_NAMES]


def _check(features: Sequence[str]) -> None:
    unknown = [f for f in features if f not in ALL_FEATURES]
    if unknown:
        raise ValueError(f"unknown scheduler feature(s) {unknown}; expected names from {list(ALL_FEATURES)}")


def state_names(depth: int, features: Sequence[str]) -> list[str]:
    """Column names of the state vector with the selected ``features``: their runtime context (in
    :data:`RUNTIME_NAMES` order), the history, then their tree signals (in the given order)."""
    _check(features)
    context = [r for r in RUNTIME_NAMES if r in features]
    return [*context, *history_names(depth), *[signal_column(s) for s in signals_among(features)]]


def state_vector(state: StepState, features: Sequence[str]) -> np.ndarray:
    """The state of ``state`` as float64 [len(state_names)]; signals missing from the state count as 0.

    Runs at every online decision: the names were checked where the policy's feature order was made
    (:func:`state_names`), so they are not checked again here."""
    values = [v for r, v in zip(RUNTIME_NAMES, runtime_features(state)) if r in features] + history_features(state)
    sig = state.signals or {}
    values += [float(sig.get(s, 0.0)) for s in signals_among(features)]
    return np.asarray(values, dtype=np.float64)


def with_spec_context(features: Sequence[str], stored_names: Sequence[str]) -> list[str]:
    """Selected features of an artifact saved before the runtime context was selectable (its
    ``signals`` listed tree signals only, and its state always had the four runtime features)."""
    missing = [r for r in RUNTIME_NAMES if r in stored_names and r not in features]
    return [*missing, *features]


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
