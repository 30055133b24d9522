"""The open-loop margin teacher, the distilled margin predictor and the two learned policies (the scheduler's distillation).

The default teacher is the closed-loop one (:mod:`treegraft.scheduling.closed_loop`); the paper's
open-loop teacher, kept as ``scheduler.teacher=open_loop`` and as the direct planner's rule:

teacher margin(state at step t) = max over the 2^(D-t) future suffixes of T(call now, suffix)
                                - max over the same suffixes of T(skip now, suffix),
with T the value system's predicted throughput (AL + 1) / latency. The distilled predictor learns
the margin from the state alone (no suffix); online, the step calls the middle drafter iff the
predicted margin > 0. The direct planner deploys the value system itself (the same max over
suffixes, computed at every decision): exact, but 2^(D-t+1) head evaluations per decision.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from .features import state_names, state_vector, suffix_vector, signals_among, with_spec_context
from .policy import StepState
from .value import MLPConfig, Standardized, ValueSystem, train_mlp

__all__ = ["plan_margins", "MarginPredictor", "LearnedScheduler", "DirectPlanner", "fixed_fallback", "fallback_key"]


def _suffixes(n: int) -> list[tuple[int, ...]]:
    return list(itertools.product((0, 1), repeat=n))


def plan_margins(vs: ValueSystem, states: np.ndarray, steps: np.ndarray) -> np.ndarray:
    """Teacher margins (the distillation target, and the direct planner's rule) for state vectors ``states`` [N, len(state_names)] at ``steps`` [N] (1..D),
    by exact enumeration of every future suffix."""
    depth = vs.depth
    margins = np.zeros(len(states))
    for t in np.unique(steps):
        idx = np.where(steps == t)[0]
        suffixes = _suffixes(depth - int(t))
        bits = np.stack([suffix_vector(int(t), s, depth) for s in suffixes])  # [S, D]
        x = np.concatenate([np.repeat(states[idx], len(suffixes), axis=0), np.tile(bits, (len(idx), 1))], axis=1)
        best = {}
        for branch in ("call", "skip"):
            tau = vs.throughput(x, branch).reshape(len(idx), len(suffixes))
            best[branch] = tau.max(axis=1)
        margins[idx] = best["call"] - best["skip"]
    return margins


class MarginPredictor:
    """A small MLP (state -> 64 -> 32 -> 1, z-scored inputs) predicting the teacher margin.

    Saved as ``<name>.pt`` (weights) + ``<name>.meta.json`` (feature order, signals, depth, hidden
    sizes). Decisions run in numpy: a 17-input MLP is a few microseconds there, while a torch call
    has a fixed overhead of tens of microseconds.
    """

    def __init__(self, model: Standardized, depth: int, signals: Sequence[str], meta: dict | None = None):
        self.model = model
        self.depth = depth
        self.signals = list(signals)
        self.meta = meta or {}
        self._cache_numpy()

    def _cache_numpy(self) -> None:
        m = self.model
        self._mu = m.x_mean.numpy().astype(np.float64)
        self._sd = m.x_std.numpy().astype(np.float64)
        self._layers = [(l.weight.detach().numpy().T.astype(np.float64), l.bias.detach().numpy().astype(np.float64))
                        for l in m.net if isinstance(l, torch.nn.Linear)]
        self._ym, self._ys = float(m.y_mean), float(m.y_std)

    @property
    def feature_names(self) -> list[str]:
        return state_names(self.depth, self.signals)

    @classmethod
    def untrained(cls, depth: int, signals: Sequence[str], hidden: Sequence[int] = (8,), seed: int = 0) -> "MarginPredictor":
        """Random weights, no fit: a policy that calls at some steps and not others, for checks that need a
        learned scheduler without fitted artifacts (the host-read budget, the GPU smoke check)."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return cls(Standardized(len(state_names(depth, signals)), list(hidden)), depth, signals)

    @classmethod
    def fit(cls, states: np.ndarray, margins: np.ndarray, depth: int, signals: Sequence[str], cfg: MLPConfig,
            hidden: Sequence[int] = (64, 32)) -> "MarginPredictor":
        return cls(train_mlp(states, margins, cfg, hidden=hidden), depth, signals, {"hidden": list(hidden)})

    def predict(self, states: np.ndarray) -> np.ndarray:
        """Margins for state vectors [N, F] (numpy, float64)."""
        h = (np.atleast_2d(states) - self._mu) / self._sd
        for i, (w, b) in enumerate(self._layers):
            h = h @ w + b
            if i < len(self._layers) - 1:
                h = np.maximum(h, 0.0)
        return h[:, 0] * self._ys + self._ym

    def save(self, path_stem: Path, extra_meta: dict | None = None) -> None:
        from ..atomic import atomic_torch_save, atomic_write_json

        atomic_torch_save(self.model.state_dict(), path_stem.with_suffix(".pt"))
        meta = {"depth": self.depth, "signals": self.signals, "feature_names": self.feature_names,
                "hidden": self.meta.get("hidden", [64, 32]), **(extra_meta or {})}
        atomic_write_json(meta, path_stem.with_suffix(".meta.json"))

    @classmethod
    def load(cls, path_stem: Path) -> "MarginPredictor":
        path_stem = Path(path_stem)
        meta = json.loads(path_stem.with_suffix(".meta.json").read_text())
        model = Standardized(len(meta["feature_names"]), meta["hidden"])
        model.load_state_dict(torch.load(path_stem.with_suffix(".pt"), weights_only=True))
        model.eval()
        return cls(model, meta["depth"], with_spec_context(meta["signals"], meta["feature_names"]), meta)


class LearnedScheduler:
    """Online policy: call the middle drafter iff the distilled margin is positive."""

    policy_name = "distilled"

    def __init__(self, predictor: MarginPredictor, threshold: float = 0.0):
        self.predictor = predictor
        self.threshold = threshold
        self.needs_signals = bool(signals_among(predictor.signals))

    def decide(self, state: StepState) -> int:
        x = state_vector(state, self.predictor.signals)
        return int(self.predictor.predict(x[None, :])[0] > self.threshold)


class DirectPlanner:
    """Online policy that deploys the value system itself (the ``direct_planner`` ablation)."""

    def __init__(self, value_system: ValueSystem):
        self.vs = value_system
        self.needs_signals = bool(signals_among(value_system.signals))

    def decide(self, state: StepState) -> int:
        x = state_vector(state, self.vs.signals)
        return int(plan_margins(self.vs, x[None, :], np.array([state.step]))[0] > 0)


def fallback_key(reference: str) -> str:
    """The key of a fallback's difference against ``reference``: ``distilled_minus_best_fixed_points``, ..."""
    return "distilled_minus_" + reference.replace(" ", "_").replace("-", "_") + "_points"


def fixed_fallback(distilled_minus_fixed: float | None, best_fixed: str, ci_low: float | None = None,
                   reference: str = "best fixed") -> dict | None:
    """What ``treegraft`` deploys instead of the distilled scheduler: ``best_fixed`` (run online by a
    :class:`~treegraft.scheduling.policy.FixedScheduler`) unless the distilled scheduler's cross-validated
    share of the oracle beats the best fixed schedule's with the prompt-resampled 95% CI of the difference
    above 0 (``ci_low`` > 0 points; without a CI, the point estimate ``distilled_minus_fixed`` > 0), else
    None. A learned policy deploys only by beating a constant one on held-out prompts: a tie, or a lead
    the CI does not carry, is no evidence for it, and online it can still call the middle drafter where
    the held-out turns never did (a fresh-clone run on a Xeon: distilled = best fixed = all-skip offline,
    0.00 points; deployed, it called the 0.5B on 3% of steps and ran 13.5% [7.8, 18.7] below all-skip;
    another: +0.7 [-3.8, +5.4] points on 10 prompts, deployed, 85 middle calls where calls do not pay,
    1.01x against a rerun's 1.09x). ``reference``: the constant policy compared against (``best fixed``, or
    ``all-skip``: distill also asks the scheduler to beat making no calls at all), named in the keys."""
    if distilled_minus_fixed is None:
        return None
    evidence = distilled_minus_fixed if ci_low is None else ci_low
    if evidence > 0:  # NaN (too few prompts for a CI) is no evidence either
        return None
    key = fallback_key(reference)
    out = {"policy": "fixed", "schedule": str(best_fixed), key: float(distilled_minus_fixed)}
    if reference != "best fixed":
        out["reference"] = reference
    if ci_low is not None:
        out[f"{key}_lo"] = None if np.isnan(ci_low) else float(ci_low)
    return out
