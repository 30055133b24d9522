"""The offline value system of the scheduler: four action-conditioned MLP heads and signal selection.

Heads: AL | call, log-latency | call, AL | skip, log-latency | skip. Each maps the pre-action state
plus the future-suffix encoding to the *complete-turn* outcome of that schedule. Throughput of a
schedule = (AL + 1) / latency (the bonus token counts).

With ``latency_prior`` the log-latency heads learn the residual over an analytic latency from the
pair's own warm-up timings, ``t_tgt + (calls of the whole schedule) * t_mid`` (one verification plus
one middle forward per call). The prior carries what one fitted pair cannot teach: a pair whose
middle forward costs more of a target step (a self-draft) gets dearer calls, by construction; the
heads keep the tree-dependent part (verification size, rows per call). ``t_tgt_ms`` and ``t_mid_ms``
are then required state features (the selection keeps them).

Signal selection scores a tree-signal subset by five-fold *grouped* out-of-fold validation (a
report, i.e. pair x benchmark, never straddles folds): the normalized mean absolute errors of AL,
log-latency and throughput on both branches (each error divided by the target's standard
deviation), averaged. ``search='auto'`` is exhaustive over all subsets when that is at most
``max_exhaustive`` subsets, otherwise stepwise selection: start from the candidates' runtime
context (the paper's state), add the feature that lowers the score most until nothing does, then drop
any feature whose removal lowers it -- documented in docs/pipeline.md.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import pandas as pd
import torch
from sklearn.model_selection import GroupKFold
from torch import nn

from .features import RUNTIME_NAMES, feature_column, state_names, suffix_names, with_spec_context

__all__ = [
    "MLPConfig",
    "Standardized",
    "train_mlp",
    "ValueSystem",
    "fit_value_system",
    "oof_score",
    "oof_summary",
    "select_signals",
    "grouped_folds",
    "BRANCHES",
    "PRIOR_FEATURES",
    "latency_prior_s",
]

BRANCHES = {"call": 1, "skip": 0}


@dataclass
class MLPConfig:
    hidden: tuple[int, ...] = (64, 64)
    epochs: int = 300
    lr: float = 3e-3
    weight_decay: float = 1e-5
    seed: int = 0


def _mlp(n_in: int, hidden: Sequence[int]) -> nn.Sequential:
    layers: list[nn.Module] = []
    for h in hidden:
        layers += [nn.Linear(n_in, h), nn.ReLU()]
        n_in = h
    layers.append(nn.Linear(n_in, 1))
    return nn.Sequential(*layers)


class Standardized(nn.Module):
    """An MLP with its input z-scoring and output scaling built in: ``y = mlp((x - mu) / sd) * ys + ym``."""

    def __init__(self, n_in: int, hidden: Sequence[int]):
        super().__init__()
        self.net = _mlp(n_in, hidden)
        self.register_buffer("x_mean", torch.zeros(n_in))
        self.register_buffer("x_std", torch.ones(n_in))
        self.register_buffer("y_mean", torch.zeros(()))
        self.register_buffer("y_std", torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net((x - self.x_mean) / self.x_std).squeeze(-1) * self.y_std + self.y_mean

    @torch.inference_mode()
    def predict(self, x: np.ndarray) -> np.ndarray:
        return self(torch.tensor(np.asarray(x), dtype=torch.float32)).numpy().astype(np.float64)


def train_mlp(x: np.ndarray, y: np.ndarray, cfg: MLPConfig, hidden: Sequence[int] | None = None) -> Standardized:
    """Full-batch Adam on the mean squared error of z-scored targets (deterministic for a seed)."""
    torch.manual_seed(cfg.seed)
    model = Standardized(x.shape[1], hidden or cfg.hidden)
    xt = torch.tensor(np.asarray(x), dtype=torch.float32)
    yt = torch.tensor(np.asarray(y), dtype=torch.float32)
    sd = xt.std(0)
    model.x_mean.copy_(xt.mean(0))
    model.x_std.copy_(torch.where(sd > 1e-8, sd, torch.ones_like(sd)))
    ysd = float(yt.std()) if len(yt) > 1 else 1.0
    model.y_mean.fill_(float(yt.mean()))
    model.y_std.fill_(ysd if ysd > 1e-8 else 1.0)
    opt = torch.optim.Adam(model.net.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    xz = (xt - model.x_mean) / model.x_std
    yz = (yt - model.y_mean) / model.y_std
    for _ in range(cfg.epochs):
        opt.zero_grad()
        loss = torch.mean((model.net(xz).squeeze(-1) - yz) ** 2)
        loss.backward()
        opt.step()
    # An input that was constant in training (e.g. the warm-up t_tgt of a one-pair fit) got no gradient:
    # its first-layer weights are still the random init, so a slightly different value online (another
    # warm-up measurement) would shift every hidden unit arbitrarily. It carried no information: drop it.
    with torch.no_grad():
        model.net[0].weight[:, sd <= 1e-8] = 0.0
    model.eval()
    return model


PRIOR_FEATURES = ("t_tgt_ms", "t_mid_ms")  # the state features the latency prior reads


def latency_prior_s(x: np.ndarray, names: Sequence[str], depth: int, action: int) -> np.ndarray:
    """The analytic latency [N] (seconds) of each input's whole schedule: ``t_tgt + calls * t_mid`` with
    calls = those so far + ``action`` + the suffix's, from inputs ``x`` [N, len(names)]."""
    col = {n: i for i, n in enumerate(names)}
    missing = [f for f in PRIOR_FEATURES if f not in col]
    if missing:
        raise ValueError(f"the latency prior needs the state features {missing}; got inputs {list(names)}")
    calls = x[:, col["calls_frac"]] * depth + action + x[:, [col[n] for n in suffix_names(depth)]].sum(axis=1)
    ms = x[:, col["t_tgt_ms"]] + calls * x[:, col["t_mid_ms"]]
    return np.maximum(ms, 1e-3) / 1000.0


def _targets(rows: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    return rows["accepted"].to_numpy(np.float64), np.log(rows["latency_s"].to_numpy(np.float64))


def _log_prior(rows: pd.DataFrame, depth: int, action: int) -> np.ndarray:
    """log of the latency prior of collected rows (their raw columns: the prior needs no selection)."""
    names = ["calls_frac", *PRIOR_FEATURES, *suffix_names(depth)]
    return np.log(latency_prior_s(rows[names].to_numpy(np.float64), names, depth, action))


def _inputs(rows: pd.DataFrame, depth: int, signals: Sequence[str]) -> np.ndarray:
    return rows[state_names(depth, signals) + suffix_names(depth)].to_numpy(np.float64)


@dataclass
class ValueSystem:
    """Four heads over ``state_names(depth, signals) + suffix_names(depth)``."""

    depth: int
    signals: list[str]
    heads: dict[str, Standardized] = field(default_factory=dict)  # "al_call", "loglat_call", "al_skip", "loglat_skip"
    latency_prior: bool = False  # the log-latency heads are residuals over latency_prior_s

    @property
    def input_names(self) -> list[str]:
        return state_names(self.depth, self.signals) + suffix_names(self.depth)

    def predict(self, x: np.ndarray, branch: str) -> tuple[np.ndarray, np.ndarray]:
        """(AL, log-latency) for inputs ``x`` [N, len(input_names)] under ``branch`` ('call' or 'skip')."""
        loglat = self.heads[f"loglat_{branch}"].predict(x)
        if self.latency_prior:
            loglat = loglat + np.log(latency_prior_s(x, self.input_names, self.depth, BRANCHES[branch]))
        return self.heads[f"al_{branch}"].predict(x), loglat

    def throughput(self, x: np.ndarray, branch: str) -> np.ndarray:
        al, loglat = self.predict(x, branch)
        return (np.maximum(al, 0.0) + 1.0) / np.exp(loglat)

    def save(self, directory: Path, extra_meta: dict | None = None) -> None:
        from ..atomic import atomic_torch_save, atomic_write_json

        atomic_torch_save({k: h.state_dict() for k, h in self.heads.items()}, directory / "value_heads.pt")
        hidden = [m.out_features for m in next(iter(self.heads.values())).net if isinstance(m, nn.Linear)][:-1]
        meta = {"depth": self.depth, "signals": self.signals, "input_names": self.input_names, "hidden": hidden,
                "heads": sorted(self.heads), "latency_prior": self.latency_prior, **(extra_meta or {})}
        atomic_write_json(meta, directory / "value_heads.meta.json")

    @classmethod
    def load(cls, directory: Path) -> "ValueSystem":
        meta = json.loads((directory / "value_heads.meta.json").read_text())
        states = torch.load(directory / "value_heads.pt", weights_only=True)
        vs = cls(depth=meta["depth"], signals=with_spec_context(meta["signals"], meta["input_names"]),
                 latency_prior=bool(meta.get("latency_prior", False)))  # older artifacts: no prior
        for name, sd in states.items():
            head = Standardized(len(vs.input_names), meta["hidden"])
            head.load_state_dict(sd)
            head.eval()
            vs.heads[name] = head
        return vs


def _check_prior(signals: Sequence[str], latency_prior: bool) -> None:
    missing = [f for f in PRIOR_FEATURES if f not in signals]
    if latency_prior and missing:
        raise ValueError(f"latency_prior needs the state features {missing} among the selected ones, got {list(signals)}")


def fit_value_system(rows: pd.DataFrame, depth: int, signals: Sequence[str], cfg: MLPConfig,
                     latency_prior: bool = False) -> ValueSystem:
    """Fit the four heads on ``rows`` (one row per turn x schedule x step)."""
    _check_prior(signals, latency_prior)
    vs = ValueSystem(depth=depth, signals=list(signals), latency_prior=latency_prior)
    for branch, action in BRANCHES.items():
        part = rows[rows["action"] == action]
        if part.empty:
            raise ValueError(f"no rows with action {branch}: cannot fit the {branch} heads")
        x = _inputs(part, depth, signals)
        al, loglat = _targets(part)
        if latency_prior:
            loglat = loglat - _log_prior(part, depth, action)
        vs.heads[f"al_{branch}"] = train_mlp(x, al, cfg)
        vs.heads[f"loglat_{branch}"] = train_mlp(x, loglat, cfg)
    return vs


def grouped_folds(groups: np.ndarray, n_folds: int = 5) -> list[tuple[np.ndarray, np.ndarray]]:
    """(train index, test index) pairs; a group never appears on both sides. Needs >= 2 groups."""
    n_groups = len(np.unique(groups))
    if n_groups < 2:
        raise ValueError(f"grouped cross-validation needs at least 2 reports (pair x benchmark), got {n_groups}")
    splitter = GroupKFold(n_splits=min(n_folds, n_groups))
    return list(splitter.split(np.zeros(len(groups)), groups=groups))


def _nmae(pred: np.ndarray, true: np.ndarray) -> float:
    sd = float(np.std(true))
    return float(np.mean(np.abs(pred - true)) / (sd if sd > 1e-12 else 1.0))


def oof_score(rows: pd.DataFrame, depth: int, signals: Sequence[str], cfg: MLPConfig, n_folds: int = 5,
              folds: list | None = None, latency_prior: bool = False) -> dict[str, float]:
    """Grouped out-of-fold errors of the four heads with ``signals``; ``score`` = mean of the six."""
    _check_prior(signals, latency_prior)
    folds = folds or grouped_folds(rows["report"].to_numpy(), n_folds)
    out: dict[str, float] = {}
    for branch, action in BRANCHES.items():
        prior = _log_prior(rows, depth, action) if latency_prior else np.zeros(len(rows))
        mask = (rows["action"] == action).to_numpy()
        pred_al = np.full(len(rows), np.nan)
        pred_ll = np.full(len(rows), np.nan)
        for train_idx, test_idx in folds:
            tr = train_idx[mask[train_idx]]
            te = test_idx[mask[test_idx]]
            if len(tr) == 0 or len(te) == 0:
                continue
            x_tr = _inputs(rows.iloc[tr], depth, signals)
            al_tr, ll_tr = _targets(rows.iloc[tr])
            x_te = _inputs(rows.iloc[te], depth, signals)
            pred_al[te] = train_mlp(x_tr, al_tr, cfg).predict(x_te)
            pred_ll[te] = train_mlp(x_tr, ll_tr - prior[tr], cfg).predict(x_te) + prior[te]
        idx = np.where(mask & ~np.isnan(pred_al))[0]
        al, ll = _targets(rows.iloc[idx])
        tau = (al + 1) / np.exp(ll)
        tau_pred = (np.maximum(pred_al[idx], 0) + 1) / np.exp(pred_ll[idx])
        out[f"al_err_{branch}"] = _nmae(pred_al[idx], al)
        out[f"lat_err_{branch}"] = _nmae(pred_ll[idx], ll)
        out[f"tau_err_{branch}"] = _nmae(tau_pred, tau)
    out["score"] = float(np.mean(list(out.values())))
    return out


def select_signals(
    rows: pd.DataFrame,
    depth: int,
    candidates: Sequence[str],
    cfg: MLPConfig,
    search: str = "auto",
    max_exhaustive: int = 64,
    n_folds: int = 5,
    progress: Callable[[str], None] | None = None,
    latency_prior: bool = False,
) -> tuple[list[str], pd.DataFrame]:
    """Choose the signal subset with the lowest grouped OOF score; also score every single signal,
    no signal and all candidates. Returns (chosen subset, table of every evaluated subset).

    With ``latency_prior`` every subset holds :data:`PRIOR_FEATURES` (the prior reads them; they join
    the candidates if absent): they are never dropped, and ``n_signals`` counts the other features."""
    required = tuple(f for f in PRIOR_FEATURES if latency_prior)
    candidates = [*[f for f in required if f not in candidates], *candidates]
    missing = [c for c in candidates if feature_column(c) not in rows.columns]
    if missing:
        raise ValueError(f"candidate feature(s) {missing} are not columns of the collected rows (collect again)")
    folds = grouped_folds(rows["report"].to_numpy(), n_folds)
    scored: dict[tuple[str, ...], dict] = {}

    def score(subset: tuple[str, ...]) -> float:
        subset = tuple(sorted(set(subset) | set(required), key=candidates.index))
        if subset not in scored:
            scored[subset] = oof_score(rows, depth, list(subset), cfg, folds=folds, latency_prior=latency_prior)
            if progress:
                progress(f"{len(scored)} subsets scored; last {list(subset)}: {scored[subset]['score']:.4f}")
        return scored[subset]["score"]

    if search not in ("auto", "exhaustive", "greedy"):
        raise ValueError(f"search must be auto, exhaustive or greedy, got {search!r}")
    free = [c for c in candidates if c not in required]
    exhaustive = search == "exhaustive" or (search == "auto" and 2 ** len(free) <= max_exhaustive)
    if exhaustive:
        for k in range(len(free) + 1):
            for subset in itertools.combinations(free, k):
                score(subset)
    else:
        # start from the paper's state (its runtime context), add the feature that lowers the score most
        # until none does, then drop any feature whose removal lowers it (a runtime feature included)
        chosen: tuple[str, ...] = tuple(c for c in candidates if c in RUNTIME_NAMES)
        best = score(chosen)
        while len(chosen) < len(candidates):
            trial = {c: score(tuple(sorted(chosen + (c,), key=candidates.index))) for c in candidates if c not in chosen}
            c_best = min(trial, key=trial.get)
            if trial[c_best] >= best:
                break
            chosen = tuple(sorted(chosen + (c_best,), key=candidates.index))
            best = trial[c_best]
        while [c for c in chosen if c not in required]:
            trial = {c: score(tuple(x for x in chosen if x != c)) for c in chosen if c not in required}
            c_drop = min(trial, key=trial.get)
            if trial[c_drop] >= best:
                break
            chosen = tuple(x for x in chosen if x != c_drop)
            best = trial[c_drop]
        for c in candidates:  # every single feature and none at all, for the report table
            score((c,))
        score(())
        score(tuple(candidates))
    best_subset = min(scored, key=lambda s: (scored[s]["score"], len(s)))
    # n_signals counts the features beyond the required ones (so "single" and "none" keep their meaning)
    table = pd.DataFrame([{"subset": ",".join(s) or "(none)", "n_signals": len(s) - len(required), **v}
                          for s, v in scored.items()])
    table = table.sort_values("score").reset_index(drop=True)
    return list(best_subset), table


def oof_summary(table: pd.DataFrame, chosen: Sequence[str]) -> pd.DataFrame:
    """The paper's B.5 comparison: chosen subset vs the single best signal vs all candidates (vs none)."""
    singles = table[table["n_signals"] == 1]
    none = table[table["n_signals"] == 0]
    pick = {
        "chosen subset": ",".join(chosen) or "(none)",
        "single best signal": singles.sort_values("score")["subset"].iloc[0] if not singles.empty else None,
        "all candidates": table.loc[table["n_signals"].idxmax(), "subset"] if len(table) else None,
        "no signal": none["subset"].iloc[0] if not none.empty else None,
    }
    out = []
    for label, subset in pick.items():
        hit = table[table["subset"] == subset]
        if subset is None or hit.empty:
            continue
        out.append({"model": label, **hit.iloc[0].to_dict()})
    return pd.DataFrame(out)

