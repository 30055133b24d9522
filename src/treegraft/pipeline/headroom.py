"""N-gram headroom: how much any n-gram drafter could gain on a run's own outputs, at its engine's
measured verification costs (``scripts/ngram_headroom.py`` prints it).

The ``ar`` records of a run are replayed against three model-free drafters, each step verified at the
target's t(n):

* ``hindsight_any``: at each depth the true token counts as drafted when it followed *any* earlier
  occurrence of the context's last n tokens (n = 1..max_n), and each step verifies exactly the
  accepted path: a bound on every n-gram tree, however wide;
* ``hindsight_chain``: one chain (the longest match's most frequent continuation, the most recent on
  ties), verifying exactly its accepted prefix: a bound on that chain;
* ``calibrated_chain``: the same chain cut where (1 + E[accepted]) / t(k + 1) is best, with E from
  per-kind acceptance rates (order, depth, unanimous continuation) fitted on these very outputs
  (in-sample, so optimistic): what a sizing rule that sees no future reaches (the chain is the one the
  library's ``tree.ngram.mode=chain`` drafts, :meth:`~treegraft.drafters.NGramDrafter.chain_kinds`, which learns
  its rates online and lets the budget planner cut it);
* ``calibrated_chain_crossfit``: the same with each prompt's rates fitted on the other half of the prompts
  (every other prompt of each benchmark): what rates learned ahead of time reach on prompts they never saw.

Drafting and bookkeeping cost nothing here, so every figure is above what a decoder gets. Speedups are
over ``ar``'s own time on the same prompts, decode only and end to end (``ar``'s measured prefill kept:
every method pays it), ratio of sums with a paired bootstrap CI over prompts within benchmarks.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pandas as pd

from ..models.runtime import curve_at
from ..stats import bootstrap_weights, interval, ratio_of_sums

__all__ = ["POLICIES", "NGramIndex", "curve_cost", "relative_costs", "chain_rows", "Replayed", "replay", "replay_all",
           "fit_rates", "load_ar_records", "load_bench_records", "headroom", "step_table"]

POLICIES = ("hindsight_any", "hindsight_chain", "calibrated_chain", "calibrated_chain_crossfit")


class NGramIndex:
    """Continuations of every n-gram (n = 1..max_n) of a growing sequence: n-gram -> Counter of the
    tokens that followed it, plus the position each was last seen at (for ties)."""

    def __init__(self, max_n: int, tokens: list[int] = ()):
        self.max_n = max_n
        self.seq: list[int] = []
        self.next: dict[tuple, Counter] = {}
        self.last: dict[tuple, dict[int, int]] = {}
        for token in tokens:
            self.append(token)

    def append(self, token: int) -> None:
        seq = self.seq
        for n in range(1, min(self.max_n, len(seq)) + 1):  # n-grams ending at the old last token gain a follower
            key = tuple(seq[-n:])
            self.next.setdefault(key, Counter())[token] += 1
            self.last.setdefault(key, {})[token] = len(seq)
        seq.append(token)

    def followers(self, tail: list[int], orders) -> set[int]:
        """Every token that followed the last n tokens of ``tail`` for any n in ``orders``."""
        out: set[int] = set()
        for n in orders:
            if len(tail) >= n and (c := self.next.get(tuple(tail[-n:]))):
                out.update(c)
        return out

    def top(self, tail: list[int]) -> tuple[int, int, bool] | None:
        """(token, matched order, unanimous) for the longest matching n-gram's most frequent
        continuation (the most recent among equals); None when nothing matches."""
        for n in range(min(self.max_n, len(tail)), 0, -1):
            c = self.next.get(tuple(tail[-n:]))
            if c:
                last = self.last[tuple(tail[-n:])]
                token = max(c, key=lambda t: (c[t], last[t]))
                return token, n, len(c) == 1
        return None

    def chain(self, depth: int) -> list[tuple[int, tuple]]:
        """Up to ``depth`` drafted (token, kind) pairs from the current end, each extending the last."""
        tail, out = list(self.seq[-self.max_n:]), []
        for d in range(depth):
            hit = self.top(tail)
            if hit is None:
                break
            token, order, unanimous = hit
            out.append((token, (order, min(d, 2), unanimous)))
            tail = (tail + [token])[-self.max_n:]
        return out


def curve_cost(curve: dict[int, float], n: int) -> float:
    """t(n) from a measured curve: the planner's :func:`curve_at` within it, extrapolated from the last two
    sizes past it (a curve measured to fewer rows than the deepest draft must not price them flat)."""
    sizes = sorted(curve)
    if n <= sizes[-1] or len(sizes) < 2:
        return curve_at(curve, n)
    lo, hi = sizes[-2], sizes[-1]
    return curve[lo] + (curve[hi] - curve[lo]) * (n - lo) / (hi - lo)


def relative_costs(curve: dict[int, float], max_depth: int) -> list[float]:
    """``costs[k]`` = t(k + 1) / t(1): a step verifying k drafted rows, in units of a plain step."""
    return [curve_cost(curve, k + 1) / curve_cost(curve, 1) for k in range(max_depth + 1)]


def chain_rows(chain: list[tuple[int, tuple]], rates: dict, costs: list[float]) -> int:
    """How many of ``chain``'s (token, kind) rows to verify: the k with the best (1 + E[accepted]) / t(k + 1),
    E from each kind's acceptance rate (0 for a kind never seen); 0 = the root alone."""
    best, rows, expected, p = 1.0 / costs[0], 0, 0.0, 1.0
    for k, (_, kind) in enumerate(chain, start=1):
        p *= rates.get(kind, 0.0)
        expected += p
        if (1 + expected) / costs[k] > best:
            best, rows = (1 + expected) / costs[k], k
    return rows


def _accepted(drafts: list[int], truth: list[int]) -> int:
    a = 0
    while a < len(drafts) and a < len(truth) and drafts[a] == truth[a]:
        a += 1
    return a


class Replayed(NamedTuple):
    steps: int  # verification steps
    cost: float  # their cost in units of t(1)
    rows: int  # drafted rows verified, over every step


def replay(prompt: list[int], output: list[int], policy: str, costs: list[float], max_n: int, max_depth: int,
           rates: dict | None = None) -> Replayed:
    """Decoding ``output`` after ``prompt`` under ``policy``; ``costs[k]`` = t(k + 1) / t(1) for k drafted rows."""
    index = NGramIndex(max_n, prompt)
    steps, cost, i, verified = 0, 0.0, 0, 0
    while i < len(output):
        if policy == "hindsight_any":
            a = 0
            while a < max_depth and i + a < len(output) and output[i + a] in index.followers(
                    index.seq[-max_n:], range(1, max_n + 1)):
                index.append(output[i + a])
                a += 1
            rows = a
        else:
            chain = index.chain(max_depth)
            if policy.startswith("calibrated_chain"):
                rows = chain_rows(chain, rates, costs)
                chain = chain[:rows]
            a = _accepted([t for t, _ in chain], output[i:])
            rows = rows if policy.startswith("calibrated_chain") else a
            for token in output[i:i + a]:
                index.append(token)
        steps += 1
        cost += costs[rows]
        verified += rows
        if i + a < len(output):
            index.append(output[i + a])  # the bonus token
        i += a + 1
    return Replayed(steps, cost, verified)


def fit_rates(examples: list[tuple[list[int], list[int]]], max_n: int, max_depth: int) -> dict:
    """P(a chain token of this kind is accepted | its parent was), counted at every position of every output."""
    hits, seen = Counter(), Counter()
    for prompt, output in examples:
        index = NGramIndex(max_n, prompt)
        for i, token in enumerate(output):
            chain = index.chain(max_depth)
            a = _accepted([t for t, _ in chain], output[i:])
            for d, (_, kind) in enumerate(chain[:a + 1]):
                seen[kind] += 1
                hits[kind] += d < a
            index.append(token)
    return {kind: hits[kind] / seen[kind] for kind in seen}


def load_bench_records(out_dir: Path, method: str = "llama:ar") -> pd.DataFrame:
    """``method``'s records from a ``scripts/bench_llama_engine.py`` output folder (``<out_dir>/runs``), in
    :func:`load_ar_records`' columns (the pair is the folder's name unless the bench wrote it)."""
    rows = []
    for path in sorted((out_dir / "runs").glob("prompt_*.json")):
        r = json.loads(path.read_text())
        if "prompt_ids" not in r or method not in r["results"]:
            raise SystemExit(f"error: {path} has no prompt_ids or no {method} record: rerun the bench at this commit")
        res = r["results"][method]
        rows.append({"pair": r.get("pair", out_dir.name), "benchmark": r["benchmark"], "question_id": r["question_id"],
                     "prompt": r["prompt_ids"], "output": res["tokens"], "prefill_s": res["prefill_time_s"],
                     "wall_s": res["wall_time_s"], "cpu": r["key"]["cpu"], "runtime": method,
                     "turns": res.get("turns") or []})
    if not rows:
        raise SystemExit(f"error: no prompt records under {out_dir / 'runs'}: expected a bench_llama_engine.py --out-dir")
    return pd.DataFrame(rows)


def load_ar_records(run: Path, pair: str | None) -> pd.DataFrame:
    """The ``ar`` records of an evaluate run (``outputs/pipeline/<experiment>``) or of a bench folder
    (:func:`load_bench_records`)."""
    if (run / "runs").is_dir():
        return load_bench_records(run)
    rows = []
    for path in sorted((run / "evaluate").glob("*/*/ar.jsonl")):
        for line in path.read_text().splitlines():
            r = json.loads(line)
            if pair and r["pair"] != pair:
                continue
            if "prompt_ids" not in r:
                raise SystemExit(f"error: {path} has no prompt_ids: records from before they were kept cannot be replayed")
            rows.append({"pair": r["pair"], "benchmark": r["benchmark"], "question_id": r["question_id"],
                         "prompt": r["prompt_ids"], "output": r["tokens"], "prefill_s": r.get("prefill_s") or 0.0,
                         "wall_s": r["choices"][0]["wall_time"][0], "cpu": r.get("cpu"), "runtime": r.get("runtime")})
    if not rows:
        raise SystemExit(f"error: no ar records under {run / 'evaluate'}: expected outputs/pipeline/<experiment>")
    return pd.DataFrame(rows)


def replay_all(records: pd.DataFrame, curve: dict[int, float], max_n: int = 5,
               max_depth: int = 8) -> dict[str, list[Replayed]]:
    """Every policy's :func:`replay` of every record, in order (calibrated rates in sample, or cross-fitted)."""
    costs = relative_costs(curve, max_depth)
    examples = list(zip(records["prompt"], records["output"]))
    rates = fit_rates(examples, max_n, max_depth)
    fold = records.groupby("benchmark").cumcount().to_numpy() % 2  # every other prompt of each benchmark
    fold_rates = [fit_rates([e for e, f in zip(examples, fold) if f == k], max_n, max_depth) for k in (0, 1)]
    return {policy: [replay(p, o, policy, costs, max_n, max_depth,
                            fold_rates[1 - f] if policy == "calibrated_chain_crossfit" else rates)
                     for (p, o), f in zip(examples, fold)] for policy in POLICIES}


def step_table(records: pd.DataFrame, replays: dict[str, list[Replayed]],
               decoders: dict[str, pd.DataFrame] | None = None) -> pd.DataFrame:
    """Where a decoder's gap to a replay goes, one row per policy (``replays``: :func:`replay_all` of ``records``) or
    decoder over every prompt: tokens per step, drafted rows verified per step, and decode milliseconds per step
    split into the target's verification forward and the rest (drafting, middle-drafter forwards, bookkeeping;
    0 in a replay, and in ``ar``'s row, whose whole per-token time counts as its step). A decoder's row comes from
    its records' ``turns``; a replay's milliseconds are ``ar``'s per token times its t(1) units, as in
    :func:`headroom`. Fewer tokens per step at as many rows is the drafts' or the cut's fault; more milliseconds
    per step, the turn's."""
    tokens = records["output"].map(len).sum()
    ar_ms = 1000 * float((records["wall_s"] - records["prefill_s"]).sum() / tokens)
    rows = [{"policy": "ar (measured)", "tokens / step": 1.0, "rows / step": 0.0, "ms / step": ar_ms,
             "verify ms / step": ar_ms, "other ms / step": 0.0}]
    for policy, runs in replays.items():
        steps = sum(r.steps for r in runs)
        ms = ar_ms * sum(r.cost for r in runs) / steps
        rows.append({"policy": policy, "tokens / step": tokens / steps,
                     "rows / step": sum(r.rows for r in runs) / steps, "ms / step": ms, "verify ms / step": ms,
                     "other ms / step": 0.0})
    for name, rec in (decoders or {}).items():
        turns = [t for ts in rec["turns"] for t in ts]
        if not turns:
            continue  # a method without turn records (stock tools)
        decode = 1000 * float((rec["wall_s"] - rec["prefill_s"]).sum())
        verify = 1000 * sum(t["target_forward_s"] for t in turns)
        # tokens by output length: a last turn cut at EOS or max_new_tokens counts what it kept
        rows.append({"policy": name, "tokens / step": rec["output"].map(len).sum() / len(turns),
                     "rows / step": sum(t["verified_nodes"] for t in turns) / len(turns), "ms / step": decode / len(turns),
                     "verify ms / step": verify / len(turns), "other ms / step": (decode - verify) / len(turns)})
    return pd.DataFrame(rows).round(2)


def headroom(records: pd.DataFrame, curve: dict[int, float], max_n: int = 5, max_depth: int = 8,
             n_resamples: int = 2000, decoders: dict[str, pd.DataFrame] | None = None,
             replays: dict[str, list[Replayed]] | None = None) -> pd.DataFrame:
    """One row per (policy, benchmark or 'all'): decode-only and end-to-end speedup over ar with CIs.

    ``decoders``: name -> a decoder's measured records on the same prompts (``prefill_s``, ``wall_s``, in the
    order of ``records``, as :func:`load_bench_records` gives them): a row each with its measured speedups and
    the fraction of ``hindsight_any``'s end-to-end gain it reaches, (x - 1) / (bound - 1), CI paired with the
    bound's over the same resamples. ``replays``: :func:`replay_all`'s of ``records`` at ``curve``, if already made."""
    ar_decode = (records["wall_s"] - records["prefill_s"]).to_numpy(np.float64)
    prefill = records["prefill_s"].to_numpy(np.float64)
    tokens = records["output"].map(len).to_numpy(np.float64)
    # every policy's and decoder's per-prompt decode seconds and prefill seconds
    timed: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for policy, runs in (replays or replay_all(records, curve, max_n, max_depth)).items():
        units = np.array([r.cost for r in runs])
        timed[policy] = (ar_decode * units / tokens, prefill)  # ar's seconds per token times the policy's t(1) units
    for name, rec in (decoders or {}).items():
        if len(rec) != len(records) or list(rec["question_id"]) != list(records["question_id"]):
            raise ValueError(f"decoder {name!r}: its records are not the ar records' prompts in order")
        rec_prefill = rec["prefill_s"].to_numpy(np.float64)
        timed[name] = (rec["wall_s"].to_numpy(np.float64) - rec_prefill, rec_prefill)
    out = []
    for name, (decode, pre) in timed.items():
        for bench, mask in [("all", np.ones(len(records), bool)),
                            *((b, (records["benchmark"] == b).to_numpy()) for b in sorted(records["benchmark"].unique()))]:
            strata = records["benchmark"][mask].tolist()
            w = bootstrap_weights(strata, n_resamples)
            ar_total = ar_decode[mask] + prefill[mask]
            dec = interval(ratio_of_sums(ar_decode[mask], decode[mask]), w)
            e2e = interval(ratio_of_sums(ar_total, decode[mask] + pre[mask]), w)
            bound_decode = timed["hindsight_any"][0][mask]

            def fraction(wt, d=decode[mask] + pre[mask], bound=bound_decode + prefill[mask], a=ar_total):
                with np.errstate(invalid="ignore", divide="ignore"):  # a resample where the bound gains nothing: nan
                    return ((wt @ a) / (wt @ d) - 1) / ((wt @ a) / (wt @ bound) - 1)

            out.append({"policy": name, "benchmark": bench, "decode x ar": dec.format(),
                        "end to end x ar": e2e.format(), "of the bound's gain": interval(fraction, w).format("{:.0%}"),
                        "n": dec.n,
                        "prefill share of ar": f"{prefill[mask].sum() / (ar_decode[mask] + prefill[mask]).sum():.2f}"})
    return pd.DataFrame(out)


