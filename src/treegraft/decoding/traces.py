"""Grafting traces: a turn whose accepted path runs through a branch only non-destructive grafting kept,
recorded in token ids during decoding and turned into text pieces once the generation is done (a
generation keeps its :data:`TRACES_KEPT` best such turns as ``GenerationResult.grafting_examples``)."""

from __future__ import annotations

from ..tree import CREATOR_NAMES, MIDDLE, DraftTree

__all__ = ["TRACE_CONTEXT", "TRACES_KEPT", "trace_of", "keep_trace", "decoded_trace", "grafting_counts"]

# a grafting trace shows this many context tokens before the root; a generation keeps this many traces
TRACE_CONTEXT = 12
TRACES_KEPT = 2
# a trace lists at most this many of the middle drafter's new children beside the kept branch
TRACE_NEW_CHILDREN = 5


def trace_of(tree: DraftTree, path_nodes: list[int], first: int, bonus: int) -> dict:
    """A turn's grafting trace in token ids: the accepted path runs through a kept branch from
    ``path_nodes[first]`` on (:meth:`DraftTree.first_kept`). :func:`keep_trace` adds the turn and context,
    :func:`decoded_trace` the text pieces."""
    under, step, _ = tree.grafts[tree.kept[path_nodes[first]] - 1]
    new = [n for n in tree.children[under].values() if tree.creator[n] == MIDDLE and tree.step[n] == step]
    new.sort(key=lambda n: (-tree.edge[n], n))  # the middle drafter's best first

    def nodes(ids: list[int]) -> list[list[int]]:
        return [[tree.token[n], tree.creator[n], tree.step[n]] for n in ids]

    return {
        "root": tree.token[0],
        "grafted_under": {"path": tree.path_tokens(under), "depth": tree.depth[under],
                          "creator": tree.creator[under], "step": tree.step[under]},
        "graft_step": step,
        "kept_branch": nodes(path_nodes[first:]),
        "new_children": [tree.token[n] for n in new[:TRACE_NEW_CHILDREN]],
        "accepted": nodes(path_nodes[1:]),
        "bonus": int(bonus),
        "accepted_on_kept": len(path_nodes) - first,
    }


def keep_trace(traces: list[dict], trace: dict, turn: int, prompt_ids: list[int], tokens: list[int]) -> list[dict]:
    """``traces`` with ``trace`` of turn ``turn`` added (its context: the last tokens before the root), the
    :data:`TRACES_KEPT` that accepted the most tokens on kept branches."""
    context = (prompt_ids[-TRACE_CONTEXT:] + tokens[-TRACE_CONTEXT:])[-TRACE_CONTEXT:]  # ends at the root
    traces = traces + [{**trace, "turn": turn, "context": context}]
    return sorted(traces, key=lambda t: (-t["accepted_on_kept"], t["turn"]))[:TRACES_KEPT]


def decoded_trace(raw: dict, tokenizer, small_drafter: str) -> dict:
    """``raw`` (:func:`keep_trace`'s) with every token as its text piece (``<id>`` without a tokenizer) and
    every drafter by name: a small JSON-able dict."""
    def piece(token: int) -> str:
        return tokenizer.decode([int(token)], skip_special_tokens=False) if tokenizer is not None else f"<{int(token)}>"

    def nodes(items: list[list[int]]) -> list[dict]:
        return [{"piece": piece(t), "drafter": CREATOR_NAMES[c], "step": s} for t, c, s in items]

    under = raw["grafted_under"]
    return {
        "turn": raw["turn"],
        "small_drafter": small_drafter,
        "context": [piece(t) for t in raw["context"]],
        "root": piece(raw["root"]),
        "grafted_under": {"path": [piece(t) for t in under["path"]], "depth": under["depth"],
                          "drafter": CREATOR_NAMES[under["creator"]], "step": under["step"]},
        "graft_step": raw["graft_step"],
        "kept_branch": nodes(raw["kept_branch"]),
        "new_children": [piece(t) for t in raw["new_children"]],
        "accepted": nodes(raw["accepted"]),
        "bonus": piece(raw["bonus"]),
        "accepted_on_kept": raw["accepted_on_kept"],
    }


def grafting_counts(turns: list[dict]) -> dict:
    """A generation's grafting statistic from its turn records."""
    return {
        "accepted_tokens": sum(t["accepted"] for t in turns),  # draft tokens, the bonus excluded
        "accepted_on_kept": sum(t["accepted_on_kept"] for t in turns),
        "turns": len(turns),
        "grafting_turns": sum(t["grafts_kept"] > 0 for t in turns),
        "kept_turns": sum(t["accepted_on_kept"] > 0 for t in turns),
    }
