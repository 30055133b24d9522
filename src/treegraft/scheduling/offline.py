"""Offline evaluation of schedulers on enumerated turns (paper B.5/B.6).

A policy is followed through a turn's enumeration: before step t it sees the recorded state after
its own prefix of actions (every prefix was recorded), decides, and at the end the turn's
throughput is the recorded one of the schedule it produced. Compared: the distilled scheduler, the
direct value-system planner, all-skip (All-Small), all-call, the best fixed schedule (best mean
throughput on the training turns), a uniformly random policy (its exact expectation: the mean over
all schedules) and the per-turn oracle (the best enumerated schedule).

Two measures per policy: ``mean_tau``, the mean over turns of each turn's throughput (the paper's, and
what the oracle maximises turn by turn), and ``total_tau`` = all its tokens / all its seconds (what a
decode's tokens/s is; ``tokens`` and ``seconds`` are kept so that folds pool exactly). The random
policy's totals are over every schedule of every turn.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import pandas as pd

from .features import state_names

__all__ = ["TURN_KEYS", "turn_outcomes", "turn_throughputs", "best_fixed_schedule", "best_fixed_by_middle_cost", "MIDDLE_COST_GRID", "repriced_latency", "state_rows", "follow_policy", "policy_turns",
           "summarize_policies", "evaluate_policies"]

TURN_KEYS = ["report", "question_id", "turn"]

# a policy sees (state vectors [N, F] for its own feature order, step t) and returns actions [N]
BatchPolicy = Callable[[np.ndarray, int], np.ndarray]


def repriced_latency(latency, target_part, middle_part, target_cost: float = 1.0, middle_cost: float = 1.0):
    """``latency`` with its target-forward part costing ``target_cost`` times and its middle-forward part
    ``middle_cost`` times what they cost when measured (floored at 1 us); unchanged at (1, 1). Arrays or frames."""
    if target_cost == 1.0 and middle_cost == 1.0:
        return latency
    return np.maximum(latency + (target_cost - 1.0) * target_part + (middle_cost - 1.0) * middle_part, 1e-6)


def turn_outcomes(rows: pd.DataFrame, middle_cost: float = 1.0) -> tuple[pd.DataFrame, pd.DataFrame]:
    """([turns x schedules] tokens AL + 1, the same of latencies), indexed by TURN_KEYS; with ``middle_cost``,
    each latency's middle-forward part (``latency_middle_s``) costs that many times what it cost."""
    first = rows[rows["step"] == 1].assign(tokens=lambda d: d["accepted"] + 1)
    if middle_cost != 1.0:
        first = first.assign(latency_s=repriced_latency(first["latency_s"], 0.0, first["latency_middle_s"], 1.0, middle_cost))
    table = first.pivot_table(index=TURN_KEYS, columns="schedule", values=["tokens", "latency_s"])
    return table["tokens"], table["latency_s"]


def turn_throughputs(rows: pd.DataFrame, middle_cost: float = 1.0) -> pd.DataFrame:
    """[turns x schedules] throughput (AL + 1) / latency, indexed by TURN_KEYS (``middle_cost``: :func:`turn_outcomes`)."""
    tokens, seconds = turn_outcomes(rows, middle_cost)
    return tokens / seconds


def best_fixed_schedule(rows: pd.DataFrame, middle_cost: float = 1.0) -> str:
    """The one schedule with the best mean throughput over the turns of ``rows`` (``middle_cost``: :func:`turn_outcomes`)."""
    return str(turn_throughputs(rows, middle_cost).mean(axis=0).idxmax())


MIDDLE_COST_GRID = (0.25, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0)


def best_fixed_by_middle_cost(rows: pd.DataFrame, grid: Sequence[float] = MIDDLE_COST_GRID) -> dict[str, str]:
    """{b: :func:`best_fixed_schedule` with middle forwards b times dearer than collected}: the fixed fallback
    re-picked for a pair whose middle drafter is dearer or cheaper against its target than the fitted pair's."""
    return {f"{b:g}": best_fixed_schedule(rows, b) for b in grid}


def state_rows(rows: pd.DataFrame) -> pd.DataFrame:
    """One row per (turn, prefix): the pre-action state at step len(prefix) + 1."""
    return rows.drop_duplicates(TURN_KEYS + ["prefix"]).set_index(TURN_KEYS + ["prefix"]).sort_index()


def follow_policy(states: pd.DataFrame, turns: pd.Index, depth: int, features: Sequence[str],
                  policy: BatchPolicy) -> list[str]:
    """The schedule ``policy`` produces on each turn of ``turns`` (all turns advance in lockstep)."""
    prefixes = [""] * len(turns)
    for step in range(1, depth + 1):
        keys = [(*t, p) for t, p in zip(turns, prefixes)]
        x = states.loc[keys, list(features)].to_numpy(np.float64)
        actions = np.asarray(policy(x, step)).astype(int)
        prefixes = [p + str(a) for p, a in zip(prefixes, actions)]
    return prefixes


def policy_turns(
    rows: pd.DataFrame,
    depth: int,
    policies: dict[str, tuple[Sequence[str], BatchPolicy]],
    train_rows: pd.DataFrame | None = None,
) -> pd.DataFrame:
    """One row per (turn, policy): TURN_KEYS, ``policy``, the turn's ``tau`` under the schedule the policy
    produced, ``oracle_tau``, ``tokens``, ``seconds`` and ``calls`` (for the random policy: the mean over
    every schedule of the turn). Policies: the given ones, all-skip, all-call, the best fixed schedule,
    random and the oracle.

    ``policies``: name -> (signal names of its state vector, batch policy). ``train_rows`` picks the
    best fixed schedule (default: ``rows`` themselves, i.e. an in-sample best fixed schedule).
    """
    tokens_table, seconds_table = turn_outcomes(rows)
    tau = tokens_table / seconds_table
    states = state_rows(rows)
    turns = tau.index
    values = tau.to_numpy()
    oracle = np.nanmax(values, axis=1)
    best_fixed = best_fixed_schedule(train_rows if train_rows is not None else rows)
    chosen: dict[str, list[str]] = {
        "all-skip (All-Small)": ["0" * depth] * len(turns),
        "all-call": ["1" * depth] * len(turns),
        f"best fixed [{best_fixed}]": [best_fixed] * len(turns),
    }
    for name, (signals, policy) in policies.items():
        chosen[name] = follow_policy(states, turns, depth, state_names(depth, signals), policy)
    best = np.nanargmax(values, axis=1)
    chosen["oracle"] = [str(tau.columns[i]) for i in best]
    tokens, seconds = tokens_table.to_numpy(np.float64), seconds_table.to_numpy(np.float64)
    col = {s: i for i, s in enumerate(tau.columns)}
    keys = turns.to_frame(index=False)
    frames = []
    for name, scheds in chosen.items():
        pick = (np.arange(len(turns)), [col[s] for s in scheds])
        frames.append(keys.assign(policy=name, tau=values[pick], oracle_tau=oracle, tokens=tokens[pick],
                                  seconds=seconds[pick], calls=[s.count("1") / depth for s in scheds]))
    frames.insert(-1, keys.assign(policy="random (p=0.5)", tau=np.nanmean(values, axis=1), oracle_tau=oracle,
                                  tokens=np.nanmean(tokens, axis=1), seconds=np.nanmean(seconds, axis=1), calls=0.5))
    return pd.concat(frames, ignore_index=True)


def summarize_policies(per_turn: pd.DataFrame) -> pd.DataFrame:
    """Per policy (in order of appearance): mean throughput, mean gap to the oracle, share of turns at the
    oracle, call rate, all tokens / all seconds, from :func:`policy_turns`' rows."""
    out = []
    for name, g in per_turn.groupby("policy", sort=False):
        got, oracle = g["tau"].to_numpy(), g["oracle_tau"].to_numpy()
        out.append(_row(name, got, oracle, float(g["calls"].mean()), g["tokens"].sum(), g["seconds"].sum()))
    return pd.DataFrame(out)


def evaluate_policies(
    rows: pd.DataFrame,
    depth: int,
    policies: dict[str, tuple[Sequence[str], BatchPolicy]],
    train_rows: pd.DataFrame | None = None,
) -> pd.DataFrame:
    """Per-policy mean throughput, mean gap to the oracle, share of turns at the oracle, call rate
    (:func:`policy_turns`, summarised)."""
    return summarize_policies(policy_turns(rows, depth, policies, train_rows))


def _row(name: str, got: np.ndarray, oracle: np.ndarray, call_rate: float, tokens: float, seconds: float) -> dict:
    return {
        "policy": name,
        "mean_tau": float(np.mean(got)),
        "gap_to_oracle": float(np.mean(oracle - got)),
        "gap_pct": float(100 * np.mean((oracle - got) / oracle)),
        "at_oracle": float(np.mean(np.isclose(got, oracle))),
        "call_rate": float(call_rate),
        "total_tau": float(tokens / seconds),
        "tokens": float(tokens),
        "seconds": float(seconds),
        "turns": int(len(got)),
    }
