"""Collect's rows: one prompt decoded with every sampled turn's 2^D schedules enumerated
(:func:`run_prompt`), one row per (turn, schedule, step) (:func:`enumeration_rows`), and the per-report
summary of those rows (:func:`collect_summary`)."""

from __future__ import annotations

from typing import Callable, Sequence

import pandas as pd

from ..decoding.tree_decoder import TreeGraftDecoder
from ..scheduling.features import ALL_FEATURES, state_names, state_vector, suffix_names, suffix_vector
from .enumeration import TurnEnumeration, enumerate_turn

__all__ = ["decode_with_enumeration", "enumeration_rows", "run_prompt", "collect_summary"]


def decode_with_enumeration(
    decoder: TreeGraftDecoder,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    should_enumerate: Callable[[int], bool] = lambda turn: True,
) -> tuple[list[int], list[tuple[int, TurnEnumeration]]]:
    """Decode greedily; before every turn with ``should_enumerate(turn)``, enumerate all schedules.

    Returns (new tokens, [(turn index, enumeration)]). The output equals the decoder's own.
    """
    enumerations = []

    def before_turn(turn: int, root: int) -> None:
        if should_enumerate(turn):
            enumerations.append((turn, enumerate_turn(decoder, root)))

    result = decoder.generate(prompt_ids, max_new_tokens, before_turn=before_turn)
    return result.tokens, enumerations


def enumeration_rows(en: TurnEnumeration, depth: int, meta: dict) -> list[dict]:
    """One row per (schedule, step) of one enumerated turn; ``meta`` (pair, benchmark, ...) is copied in."""
    names = state_names(depth, ALL_FEATURES)
    features = {prefix: dict(zip(names, state_vector(state, ALL_FEATURES).tolist())) for prefix, state in en.states.items()}
    sfx_names = suffix_names(depth)
    rows = []
    for schedule, out in en.outcomes.items():
        for step in range(1, depth + 1):
            prefix, suffix = schedule[: step - 1], schedule[step:]
            rows.append({
                **meta,
                "schedule": schedule,
                "step": step,
                "action": int(schedule[step - 1]),
                "prefix": prefix,
                "suffix": suffix,
                **features[prefix],
                **dict(zip(sfx_names, suffix_vector(step, suffix, depth).tolist())),
                "accepted": out.accepted,
                "latency_measured_s": out.latency_s,
                "small_s": out.small_s,
                "middle_s": out.middle_s,
                "verify_s": out.verify_s,
                "small_calls": out.small_calls,
                "middle_calls": out.middle_calls,
                "middle_tokens": out.middle_tokens,
                "tree_nodes": out.tree_nodes,
                "verified_nodes": out.verified_nodes,
            })
    return rows


def run_prompt(decoder: TreeGraftDecoder, prompt_ids: list[int], cfg, meta: dict) -> list[dict]:
    """Decode one prompt, enumerating the sampled turns; the rows of every enumerated turn. ``cfg``: the
    pair's ``pipeline`` settings (``enumerate_every``, ``max_enumerated_turns``, ``max_new_tokens``)."""
    every, cap = int(cfg.enumerate_every), cfg.max_enumerated_turns

    def should(turn: int) -> bool:
        return turn % every == 0 and (cap is None or turn // every < int(cap))

    _, enumerations = decode_with_enumeration(decoder, prompt_ids, int(cfg.max_new_tokens), should)
    rows = []
    for turn, en in enumerations:
        # the turn's enumeration cost, for the prefix-sharing figures: the walk's wall time and what
        # 2^D separate constructions and verifications would have cost
        cost = {"enum_wall_s": en.wall_s, "enum_verifications": en.verifications,
                "enum_independent_s": sum(o.latency_s for o in en.outcomes.values())}
        rows += enumeration_rows(en, decoder.cfg.depth, {**meta, "turn": turn, **cost})
    return rows


def collect_summary(rows: pd.DataFrame, depth: int) -> list[dict]:
    """Per report: prompts, turns, rows, enumeration cost, prefix-sharing saving, verifications per
    turn, mean oracle / all-skip / all-call throughput (tokens/s per turn, measured latencies)."""
    out = []
    for (pair_name, bench), g in rows.groupby(["pair", "benchmark"], sort=False):
        first = g[g["step"] == 1].assign(tau=lambda d: (d["accepted"] + 1) / d["latency_measured_s"])
        per_turn = first.groupby(["question_id", "turn"])
        enum = g.drop_duplicates(["question_id", "turn"])
        out.append({
            "pair": pair_name, "benchmark": bench, "prompts": g["question_id"].nunique(),
            "turns": len(per_turn), "rows": len(g),
            "enum_wall_s": float(enum["enum_wall_s"].sum()),
            # what 2^D separate constructions and verifications would have cost / what the walk cost
            "sharing_saving": float(enum["enum_independent_s"].sum() / max(enum["enum_wall_s"].sum(), 1e-9)),
            "verifications_per_turn": float(enum["enum_verifications"].mean()),
            "oracle_tau": float(per_turn["tau"].max().mean()),
            "all_skip_tau": float(first[first["schedule"] == "0" * depth]["tau"].mean()),
            "all_call_tau": float(first[first["schedule"] == "1" * depth]["tau"].mean()),
        })
    return out

