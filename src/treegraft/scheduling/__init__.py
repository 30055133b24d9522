"""Scheduling: when to call the middle drafter (interface, fixed policy, tree signals)."""

from .policy import FixedScheduler, Scheduler, StepState, history_features, runtime_features
from .signals import REFERENCE_SIGNALS, SIGNAL_NAMES, frontier_of, preview_picks, tree_signals

__all__ = [
    "FixedScheduler",
    "REFERENCE_SIGNALS",
    "SIGNAL_NAMES",
    "Scheduler",
    "StepState",
    "frontier_of",
    "history_features",
    "preview_picks",
    "runtime_features",
    "tree_signals",
]
