"""The closed-loop margin teacher: backward induction on the enumerated turns' realized throughput.

The open-loop teacher (:func:`~treegraft.scheduling.learned.plan_margins`) asks the value heads for
the best *fixed* suffix after each action, from the state before it: it plans as if the rest of the
turn were decided now, and inherits the heads' errors on every one of the 2^(D-t) suffixes it
maximises over. On the PyTorch full experiment (394 turns) its student tied the best fixed schedule
offline (-0.1 points of the oracle). This teacher instead learns each step's margin the way the
policy will meet it: the rest of the turn is decided step by step by the later steps' own fitted
rules, from the recorded states those decisions lead to, and scored by what the enumeration
measured.

For t = D, ..., 1 and every recorded pre-action state at step t (a turn and an action prefix):

    target = tau(prefix + call + rest) - tau(prefix + skip + rest), divided by the turn's best tau,

where ``rest`` follows the already-fitted rules of steps t+1..D (each calls iff its predicted margin
> 0) through the recorded states, and tau = (AL + 1) / latency is the enumerated outcome. A gradient
boosted regressor per step smooths these targets over the state features (the realized margins are
noisy: an MLP fitted on them per step lost 5 points of the oracle where trees gained 2); the
student MLP is then distilled from the smoothed margins (:func:`treegraft.pipeline.distill.distill_predictor`).
Dividing by the turn's best throughput makes every turn count by its share of the oracle, the
measure the offline table reports.

With ``timing_scales`` every turn is also relabelled as if the target step cost ``a`` times and a
middle forward ``b`` times what was measured (the latency parts that scale with each, see
:func:`treegraft.pipeline.collected.load_rows`), with the state's warm-up timings rescaled to match:
one fitted pair then still teaches how the margin moves with the cost of a call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import pandas as pd
from sklearn.ensemble import HistGradientBoostingRegressor

from .features import state_names
from .offline import TURN_KEYS, repriced_latency, turn_outcomes, state_rows

__all__ = ["ClosedLoopConfig", "ClosedLoopTeacher", "fit_closed_loop_teacher", "rescale_timings", "timing_pairs"]


@dataclass
class ClosedLoopConfig:
    """Per-step gradient boosted regressors (sklearn ``HistGradientBoostingRegressor``): shallow, strongly
    regularised trees, no early stopping (its random validation split would make the fit nondeterministic)."""

    max_iter: int = 150
    learning_rate: float = 0.05
    max_leaf_nodes: int = 15
    min_samples_leaf: int = 40
    l2_regularization: float = 1.0
    seed: int = 0


def timing_pairs(scales: Sequence[float]) -> list[tuple[float, float]]:
    """(target scale, middle scale) for every pair of ``scales``, the unscaled pair first."""
    return [(1.0, 1.0)] + [(a, b) for a in scales for b in scales if (a, b) != (1.0, 1.0)]


def rescale_timings(x: np.ndarray, names: Sequence[str], a: float, b: float) -> np.ndarray:
    """A copy of states ``x`` [N, F] with the warm-up t_tgt scaled by ``a`` and t_mid by ``b`` (the log
    ratio moved to match; features absent from ``names`` are left alone)."""
    col = {n: i for i, n in enumerate(names)}
    out = x.copy()
    if "t_tgt_ms" in col:
        out[:, col["t_tgt_ms"]] *= a
    if "t_mid_ms" in col:
        out[:, col["t_mid_ms"]] *= b
    if "log_tgt_mid_ratio" in col:
        out[:, col["log_tgt_mid_ratio"]] += np.log(a / b)
    return out


class ClosedLoopTeacher:
    """One margin regressor per step (1..D) over the state vector of the selected ``signals`` (the
    scheduler's feature names: runtime context and tree signals; history always)."""

    def __init__(self, models: dict[int, HistGradientBoostingRegressor], depth: int, signals: Sequence[str]):
        self.models = models
        self.depth = depth
        self.signals = list(signals)
        self.names = state_names(depth, self.signals)

    def margins(self, x: np.ndarray, steps: np.ndarray) -> np.ndarray:
        """Teacher margins [N] for states ``x`` [N, len(names)] at ``steps`` [N] (1..D)."""
        out = np.zeros(len(x))
        steps = np.asarray(steps)
        for t in np.unique(steps):
            idx = np.where(steps == t)[0]
            out[idx] = self.models[int(t)].predict(x[idx])
        return out


def _prefixes(length: int) -> list[str]:
    return [format(i, f"0{length}b") if length else "" for i in range(2 ** length)]


def fit_closed_loop_teacher(rows: pd.DataFrame, depth: int, signals: Sequence[str], cfg: ClosedLoopConfig,
                            timing_scales: Sequence[float] = ()) -> ClosedLoopTeacher:
    """Fit the per-step margin regressors on the enumerated turns of ``rows`` over the state vector of
    ``signals`` (module docstring).

    ``rows`` need ``latency_s`` and, for ``timing_scales``, its parts ``latency_target_s`` and
    ``latency_middle_s``; every turn must have all 2^D schedules and every prefix's state recorded."""
    names = state_names(depth, signals)
    tokens, seconds = turn_outcomes(rows)
    schedules = [str(s) for s in tokens.columns]
    if len(schedules) != 2 ** depth or tokens.isna().any().any():
        raise ValueError(f"the closed-loop teacher needs all {2 ** depth} schedules of every turn; "
                         f"got {len(schedules)} schedule columns with {int(tokens.isna().sum().sum())} missing outcomes")
    col = {s: i for i, s in enumerate(schedules)}
    turns = tokens.index
    states = state_rows(rows)
    base_x = {p: states.loc[[(*t, p) for t in turns], list(names)].to_numpy(np.float64)
              for n in range(depth) for p in _prefixes(n)}
    tok = tokens.to_numpy(np.float64)
    lat = seconds.to_numpy(np.float64)
    scaled, parts = [(1.0, 1.0)], {}
    if timing_scales:
        first = rows[rows["step"] == 1]
        parts = {k: first.pivot_table(index=TURN_KEYS, columns="schedule", values=k).reindex(index=turns, columns=tokens.columns)
                 .to_numpy(np.float64) for k in ("latency_target_s", "latency_middle_s")}
        scaled = timing_pairs(timing_scales)
    # per copy: states per prefix, tau [turns, schedules] normalised by each turn's best, and for every
    # prefix the column of the schedule each turn ends with when the rules fitted so far decide the rest
    # (a whole schedule ends with itself); backward induction extends the table one step at a time
    copies = []
    for a, b in scaled:
        tau = tok / repriced_latency(lat, parts.get("latency_target_s"), parts.get("latency_middle_s"), a, b)
        x = {p: rescale_timings(v, names, a, b) for p, v in base_x.items()}
        ends = {p: np.full(len(turns), col[p]) for p in _prefixes(depth)}
        copies.append((x, tau / tau.max(axis=1, keepdims=True), ends))

    models: dict[int, HistGradientBoostingRegressor] = {}
    n = np.arange(len(turns))
    for t in range(depth, 0, -1):
        xs, ys = [], []
        for x, tau, ends in copies:
            for prefix in _prefixes(t - 1):
                xs.append(x[prefix])
                ys.append(tau[n, ends[prefix + "1"]] - tau[n, ends[prefix + "0"]])
        model = HistGradientBoostingRegressor(
            max_iter=cfg.max_iter, learning_rate=cfg.learning_rate, max_leaf_nodes=cfg.max_leaf_nodes,
            min_samples_leaf=cfg.min_samples_leaf, l2_regularization=cfg.l2_regularization,
            early_stopping=False, random_state=cfg.seed)
        models[t] = model.fit(np.vstack(xs), np.concatenate(ys))
        for x, _, ends in copies:
            for prefix in _prefixes(t - 1):
                call = models[t].predict(x[prefix]) > 0
                ends[prefix] = np.where(call, ends[prefix + "1"], ends[prefix + "0"])
    return ClosedLoopTeacher(models, depth, signals)
