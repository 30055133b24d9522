"""Evaluation records: one Spec-Bench / FastChat-style answer per prompt and method, and the summary
table every report and notebook is rebuilt from (no model needed)."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import pandas as pd

from ..data import spec_bench_category

__all__ = ["make_record", "read_records", "summarize_records"]


def make_record(pair: str, benchmark: str, method: str, question_id: int, result, text: str,
                context: dict | None = None, category: str = "") -> dict:
    """One Spec-Bench/FastChat answer record; ``context``: what it was measured on (runtime, tree
    shape, CPU line), copied into the record; ``category``: the question file's own category.

    ``accept_lengths`` (tokens per target forward, bonus included) come from the turns of the tree
    methods and of the HF peers, and are 1 per token for ``ar``; the field is left out where a
    method reports no steps.

    ``grafting`` (tree methods; None for ``ar`` and the HF peers): ``accepted_tokens`` (draft tokens
    accepted, bonus excluded), ``accepted_on_kept`` (those on branches only non-destructive grafting
    kept), ``turns``, ``grafting_turns`` (turns with a non-destructive graft that kept a branch) and
    ``kept_turns`` (turns whose accepted path used a kept branch); ``grafting_examples``: up to two such
    turns traced as text pieces (:meth:`~treegraft.decoding.TreeGraftDecoder.generate`)."""
    turns = result.turns
    choice = {"index": 0, "turns": [text], "new_tokens": [result.new_tokens], "wall_time": [result.wall_time_s]}
    if turns:
        lengths = [t["accepted"] + 1 for t in turns]
        lengths[-1] -= max(0, sum(lengths) - result.new_tokens)  # the last turn may be cut at EOS / max_new_tokens
        choice["accept_lengths"] = lengths
    elif method == "ar":
        choice["accept_lengths"] = [1] * result.new_tokens
    split = {k: sum(t.get(k, 0.0) for t in turns) for k in ("small_s", "middle_s", "verify_s", "other_s")}
    budgets = [t["budget"] for t in turns if "budget" in t]
    model_id = f"{pair}/{method}"
    return {
        "question_id": question_id,
        "answer_id": hashlib.sha256(f"{model_id}/{benchmark}/{question_id}".encode()).hexdigest()[:22],
        "model_id": model_id,
        "category": spec_bench_category(benchmark, category),
        "method": method,
        "pair": pair,
        "benchmark": benchmark,
        "choices": [choice],
        "tokens": result.tokens,
        "prompt_tokens": result.prompt_tokens,
        "stop_reason": result.stop_reason,
        "turns": len(turns),
        "accepted": [t["accepted"] for t in turns],
        "middle_calls": sum(t.get("middle_calls", 0) for t in turns),
        "steps": sum(len(t.get("schedule", ())) for t in turns),
        "backed_off_turns": sum(bool(t.get("backed_off")) for t in turns),  # learned methods: calls held back
        "time_split": split,
        "mean_budget": sum(budgets) / len(budgets) if budgets else None,  # B_ver verified per turn
        "prefill_s": result.prefill_time_s,
        "grafting": getattr(result, "grafting", None),
        "grafting_examples": getattr(result, "grafting_examples", None),
        **(context or {}),
        "tstamp": time.time(),
    }


def read_records(eval_dir: Path) -> pd.DataFrame:
    """Every record under ``eval_dir`` as a flat frame (one row per prompt x method: the newest where several
    record files of a method hold one, as a sharded run's prompt ranges beside a whole-range run). The grafting counts
    are columns ``grafting_accepted_tokens``, ``grafting_accepted_on_kept``, ``grafting_turns`` and
    ``grafting_kept_turns`` (NaN where a record has none: ``ar``, the HF peers, older records); the traced
    turns stay in ``grafting_examples`` (the record's list, or None)."""
    nan = float("nan")
    rows = []
    for path in sorted(Path(eval_dir).glob("*/*/*.jsonl")):
        for line in path.read_text().splitlines():
            r = json.loads(line)
            c = r["choices"][0]
            grafting = r.get("grafting") or {}
            rows.append({
                "pair": r["pair"], "benchmark": r["benchmark"], "method": r["method"], "question_id": r["question_id"],
                "new_tokens": c["new_tokens"][0], "wall_time": c["wall_time"][0], "turns": r["turns"],
                "accepted_sum": sum(r["accepted"]), "middle_calls": r["middle_calls"], "steps": r["steps"],
                **{f"t_{k}": v for k, v in r["time_split"].items()},
                "matches_ar": r.get("matches_ar"), "mismatch_explained": r.get("mismatch_explained"),
                "mismatch_unchecked": str(r.get("mismatch_check", "")).startswith("unchecked"),
                "mean_budget": r.get("mean_budget"), "runtime": r.get("runtime"), "tree_shape": r.get("tree_shape"),
                "cpu": r.get("cpu"), "cpu_capability": r.get("cpu_capability"),
                "bf16_onednn_above": r.get("bf16_onednn_above"),
                # the engine (records before it existed ran on PyTorch)
                "engine": r.get("engine", "torch"), "engine_build": r.get("engine_build"),
                "engine_exact": r.get("engine_exact"),
                "grafting_accepted_tokens": grafting.get("accepted_tokens", nan),
                "grafting_accepted_on_kept": grafting.get("accepted_on_kept", nan),
                "grafting_turns": grafting.get("grafting_turns", nan),
                "grafting_kept_turns": grafting.get("kept_turns", nan),
                "grafting_examples": r.get("grafting_examples"),
                "tstamp": r.get("tstamp", 0.0),
            })
    if not rows:
        raise FileNotFoundError(f"no evaluation records under {eval_dir}")
    # a prompt recorded in several files of a method (a sharded run's prompt ranges beside a whole-range run's
    # file): its newest record counts, once
    df = pd.DataFrame(rows).sort_values("tstamp", kind="stable")
    df = df.drop_duplicates(["pair", "benchmark", "method", "question_id"], keep="last")
    return df.sort_index().reset_index(drop=True)


def summarize_records(records: pd.DataFrame) -> pd.DataFrame:
    """One row per pair x benchmark x method: speedup vs ar (ratio of total wall times on the same
    prompts), tokens/s, mean AL, tau (tokens per turn), call rate, time split, mismatch counts."""
    out = []
    for (pair, bench), g in records.groupby(["pair", "benchmark"], sort=False):
        ar = g[g["method"] == "ar"].set_index("question_id")["wall_time"]
        for method, m in g.groupby("method", sort=False):
            # ar's time on the same prompts (an ablation may run on a subset)
            same = m["question_id"].isin(ar.index)
            ar_wall = float(ar.loc[m.loc[same, "question_id"]].sum()) if same.all() and len(ar) else float("nan")
            turns = m["turns"].sum()
            spent = sum(m[f"t_{k}"].sum() for k in ("small_s", "middle_s", "verify_s", "other_s"))
            row = {
                "pair": pair, "benchmark": bench, "method": method, "prompts": len(m),
                "new_tokens": int(m["new_tokens"].sum()), "wall_s": float(m["wall_time"].sum()),
                "tokens_per_s": float(m["new_tokens"].sum() / m["wall_time"].sum()),
                "speedup": float(ar_wall / m["wall_time"].sum()) if ar_wall == ar_wall else float("nan"),
                "mean_al": float(m["accepted_sum"].sum() / turns) if turns else float("nan"),
                "tau": float(m["new_tokens"].sum() / turns) if turns else float("nan"),
                "call_rate": float(m["middle_calls"].sum() / m["steps"].sum()) if m["steps"].sum() else float("nan"),
                "mean_budget": float(m["mean_budget"].mean()) if m["mean_budget"].notna().any() else float("nan"),
                "runtime": m["runtime"].iloc[0], "tree_shape": m["tree_shape"].iloc[0], "cpu": m["cpu"].iloc[0],
                "cpu_capability": m["cpu_capability"].iloc[0],
                "mismatches": int((m["matches_ar"] == False).sum()),  # noqa: E712 (None = not compared)
                "mismatches_unexplained": int(((m["matches_ar"] == False) & (m["mismatch_explained"] != True)).sum()),  # noqa: E712
                # differing outputs whose near-tie check could not run (no room for a float32 copy): among the unexplained
                "mismatches_unchecked": int(((m["matches_ar"] == False) & m["mismatch_unchecked"]).sum()),  # noqa: E712
            }
            for k in ("small_s", "middle_s", "verify_s", "other_s"):
                row[f"share_{k[:-2]}"] = float(m[f"t_{k}"].sum() / spent) if spent else float("nan")
            out.append(row)
    return pd.DataFrame(out)


# evaluation settings that choose which prompts and methods run, not what one prompt's record holds
