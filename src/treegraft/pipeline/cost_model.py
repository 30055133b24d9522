"""Collect's cost model: per-call costs fitted by least squares on the measured latencies of the enumerated
schedules (``cost_model.json`` per pair), and the latencies it predicts (``latency_label=cost_model``)."""

from __future__ import annotations

import numpy as np
import pandas as pd

__all__ = ["COST_FEATURES", "CURVE_SCALE", "fit_cost_model", "cost_model_latency", "apply_cost_model"]

COST_FEATURES = ("small_calls", "middle_calls", "middle_tokens", "verified_nodes")


def _cost_matrix(rows: pd.DataFrame, curve: dict | None) -> tuple[np.ndarray, list[str]]:
    """The cost model's features: per-call counts, plus the target's measured verification time for
    the schedule's tree size (``curve`` seconds per row count: verification is not linear in nodes)."""
    names = list(COST_FEATURES)
    x = rows[names].to_numpy(np.float64)
    if curve:
        from ..models.runtime import curve_at

        points = {int(k): float(v) for k, v in curve.items()}
        verify = np.array([curve_at(points, int(n) + 1) for n in rows["verified_nodes"]], dtype=np.float64)
        x = np.concatenate([x, verify[:, None]], axis=1)
        names.append("verify_curve")
    return x, names


# the verification curve's coefficient in the cost model: the measured curve, up to context length and drift
CURVE_SCALE = (0.5, 2.0)


def fit_cost_model(rows: pd.DataFrame, curve: dict | None = None) -> dict:
    """Per-call costs: latency = c0 + sum_k c_k * feature_k, fitted over schedules by bounded least squares
    on *relative* errors; with ``curve`` (the target's measured verification curve: verification is not
    linear in nodes) one more term is the curve at the schedule's tree size, times a scale.

    * Every coefficient >= 0, c0 included: a negative c0 (a free intercept takes one when the curve grows
      faster than the latencies) prices small trees at zero and makes their tokens/s label unbounded.
    * Relative errors (each schedule weighted by 1 / its latency): downstream a schedule's label is
      tokens/s = AL / latency, so a latency's relative error is its label's. Absolute squares let a few
      slow schedules (a middle drafter's first call of a prompt encodes the whole prompt: seconds) set
      every coefficient; on a llama.cpp `make all` they priced verification and every call at 0, each
      all-skip schedule at 1e-6 s (tokens/s 1.5e6), and every offline policy came out at 100% of the oracle.
    * The curve's scale within ``CURVE_SCALE``: so no schedule costs less than half its tree's measured
      verification.
    """
    from scipy.optimize import lsq_linear

    per_schedule = rows[rows["step"] == 1]  # one row per (turn, schedule)
    x, names = _cost_matrix(per_schedule, curve)
    y = per_schedule["latency_measured_s"].to_numpy(np.float64)
    if len(y) == 0 or np.any(y <= 0):
        raise ValueError(f"fit_cost_model needs positive measured latencies, got {len(y)} schedules "
                         f"with minimum {y.min() if len(y) else float('nan')}")
    a = np.concatenate([np.ones((len(x), 1)), x], axis=1)
    low, high = np.zeros(a.shape[1]), np.full(a.shape[1], np.inf)
    if curve:
        low[-1], high[-1] = CURVE_SCALE
    fit = lsq_linear(a / y[:, None], np.ones_like(y), bounds=(low, high), method="bvls")
    intercept, coef = float(fit.x[0]), fit.x[1:]
    pred = intercept + x @ coef
    r2 = 1 - np.sum((y - pred) ** 2) / max(np.sum((y - y.mean()) ** 2), 1e-18)
    return {"intercept_s": intercept, **{f"{k}_s": float(c) for k, c in zip(names, coef)},
            "r2": float(r2), "median_relative_error": float(np.median(np.abs(pred / y - 1))),
            "schedules": int(len(per_schedule)),
            "verify_curve": {str(k): float(v) for k, v in curve.items()} if curve else None}


# the cost model's terms that scale with a target forward and with a middle-drafter forward
TARGET_TERMS = ("verified_nodes", "verify_curve")
MIDDLE_TERMS = ("middle_calls", "middle_tokens")


def cost_model_latency(rows: pd.DataFrame, model: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(latency, its target part, its middle part), seconds [len(rows)] each, from one cost matrix (the
    verification curve is read row by row: build it once)."""
    if model["intercept_s"] < 0:
        raise ValueError(f"cost_model.json has a negative intercept_s ({model['intercept_s']:.4f} s; expected >= 0): "
                         "it was fitted before the intercept was constrained; rerun collect to refit it")
    x, names = _cost_matrix(rows, model.get("verify_curve"))
    coef = np.array([model[f"{k}_s"] for k in names])
    part = lambda terms: x @ np.where([k in terms for k in names], coef, 0.0)
    lat = np.maximum(np.full(len(rows), model["intercept_s"]) + x @ coef, 1e-6)
    return lat, part(TARGET_TERMS), part(MIDDLE_TERMS)


def apply_cost_model(rows: pd.DataFrame, model: dict) -> np.ndarray:
    """The cost model's latency of every row, in seconds [len(rows)]."""
    return cost_model_latency(rows, model)[0]
