"""Appendix G: how often the target accepts a branch that only non-destructive grafting kept.

A middle step that grafts new children under a historical node that already had children keeps those
children and their subtrees (destructive grafting, the ``no_nondestructive`` ablation, deletes them).
The decoder traces, per turn, the accepted tokens that lie on such kept branches
(:meth:`~treegraft.tree.DraftTree.note_graft`); the records carry the per-prompt counts (``grafting``)
and up to two traced turns each (``grafting_examples``). This module turns them into the share of
accepted draft tokens that came from kept branches, with a bootstrap CI over prompts, and renders the
traced turns as text (the report holds no tokenizer: the traces already carry text pieces).
"""

from __future__ import annotations

import json

import numpy as np
import pandas as pd

from ..stats import DEFAULT_RESAMPLES, bootstrap_weights, interval, ratio_of_sums

__all__ = ["grafting_table", "render_trace", "grafting_examples", "GRAFTING_COLUMNS"]

# read_records' columns of the per-prompt grafting counts
GRAFTING_COLUMNS = ("grafting_accepted_tokens", "grafting_accepted_on_kept", "grafting_turns", "grafting_kept_turns")
SHARE = "accepted on kept share"


def grafting_table(records: pd.DataFrame, n_resamples: int = DEFAULT_RESAMPLES, seed: int = 0) -> pd.DataFrame:
    """One row per pair x method with grafting counts (the tree methods): ``accepted on kept share`` =
    accepted draft tokens on kept branches / all accepted draft tokens (a ratio of sums over prompts), with
    ``... lo`` / ``... hi``, its 95% percentile CI from a paired bootstrap over prompts resampled within
    benchmarks (one draw serves every method of a pair), and ``n prompts``, ``turns``, ``kept turns``
    (turns whose accepted path used a kept branch), ``grafting turns`` (turns with a graft that kept a
    branch), ``accepted tokens``, ``accepted on kept``. The share is NaN where nothing was accepted."""
    missing = [c for c in ("pair", "benchmark", "method", "question_id", "turns", *GRAFTING_COLUMNS)
               if c not in records.columns]
    if missing:
        raise ValueError(f"records lack column(s) {', '.join(missing)}; expected read_records' frame")
    have = records[records["grafting_accepted_tokens"].notna()]
    rows = []
    for pair, p in have.groupby("pair", sort=False):
        units = p[["benchmark", "question_id"]].drop_duplicates().reset_index(drop=True)
        unit_of = {(b, q): i for i, (b, q) in enumerate(zip(units["benchmark"], units["question_id"]))}
        weights = bootstrap_weights(units["benchmark"].tolist(), n_resamples, seed)  # paired: one draw per pair
        for method, m in p.groupby("method", sort=False):
            # per-prompt sums on the pair's units (a prompt this method did not run weighs nothing)
            on_kept, accepted = np.zeros(len(units)), np.zeros(len(units))
            idx = [unit_of[(b, q)] for b, q in zip(m["benchmark"], m["question_id"])]
            np.add.at(on_kept, idx, m["grafting_accepted_on_kept"].to_numpy(float))
            np.add.at(accepted, idx, m["grafting_accepted_tokens"].to_numpy(float))
            with np.errstate(invalid="ignore", divide="ignore"):
                ci = interval(ratio_of_sums(on_kept, accepted), weights, n=len(m))
            rows.append({
                "pair": pair, "method": method, SHARE: ci.value, f"{SHARE} lo": ci.low, f"{SHARE} hi": ci.high,
                "n prompts": len(m), "turns": int(m["turns"].sum()), "kept turns": int(m["grafting_kept_turns"].sum()),
                "grafting turns": int(m["grafting_turns"].sum()),
                "accepted tokens": int(m["grafting_accepted_tokens"].sum()),
                "accepted on kept": int(m["grafting_accepted_on_kept"].sum()),
            })
    return pd.DataFrame(rows, columns=["pair", "method", SHARE, f"{SHARE} lo", f"{SHARE} hi", "n prompts", "turns",
                                       "kept turns", "grafting turns", "accepted tokens", "accepted on kept"])


def _show(piece: str) -> str:
    """A text piece as it reads in a trace: escapes for line breaks and tabs, quotes where it has spaces."""
    text = json.dumps(piece, ensure_ascii=False)[1:-1]
    return f"'{text}'" if (text != text.strip() or not text) else text


def render_trace(example: dict) -> str:
    """A traced turn (one of a record's ``grafting_examples``) as text, in the paper's layout: the context,
    the historical node the middle drafter grafted under, the kept branch the target accepted (below that
    node: its old children's subtree, or what the same step grafted below an old child), the new children
    the step grafted under that node, and the accepted path."""
    under = example["grafted_under"]
    where = " ".join(_show(p) for p in under["path"])
    node = (f"the root {_show(example['root'])}" if not under["path"] else
            f"{_show(under['path'][-1])} (depth {under['depth']}, {under['drafter']} step {under['step']}; "
            f"path from the root: {where})")
    kept = " -> ".join(_show(n["piece"]) for n in example["kept_branch"])
    kept_by = ", ".join(f"{n['drafter']} step {n['step']}" for n in example["kept_branch"])
    accepted = " ".join(_show(n["piece"]) for n in example["accepted"])
    lines = [
        f"context:        ... {''.join(example['context'])!r}",
        f"grafted under:  {node}, middle step {example['graft_step']}",
        f"kept branch:    {kept}   (accepted; drafted by {kept_by})",
        f"new children that middle step grafted there: {' | '.join(_show(p) for p in example['new_children']) or '(none)'}",
        f"accepted path:  {accepted}  + bonus {_show(example['bonus'])}  "
        f"({example['accepted_on_kept']} of {len(example['accepted'])} on the kept branch)",
    ]
    return "\n".join(lines)


def grafting_examples(records: pd.DataFrame, k: int = 2) -> list[str]:
    """``k`` rendered traced turns over all records, the longest accepted kept branch first (ties: by pair,
    benchmark, method, question id, turn), each headed by where it comes from."""
    if "grafting_examples" not in records.columns:
        raise ValueError("records lack column grafting_examples; expected read_records' frame")
    found = []
    for row in records.itertuples(index=False):
        examples = row.grafting_examples if isinstance(row.grafting_examples, list) else ()  # None / NaN: none
        for example in examples:
            found.append(((-int(example["accepted_on_kept"]), str(row.pair), str(row.benchmark), str(row.method),
                           str(row.question_id), int(example["turn"])), row, example))
    found.sort(key=lambda item: item[0])
    out = []
    for _, row, example in found[: max(0, int(k))]:
        head = (f"{row.pair} | {row.benchmark} | {row.method} | question {row.question_id} | turn {example['turn']}"
                f" | small drafter {example.get('small_drafter', 'ngram')}")
        out.append(f"{head}\n{render_trace(example)}")
    return out
