"""Schedule enumeration: every schedule exactly once per turn, each outcome equal to a
fresh decode of that schedule, prefix sharing, and the decoder state left untouched."""

from __future__ import annotations

import itertools

import pytest
import torch

from treegraft.decoding import TreeConfig
from treegraft.pipeline.collect import decode_with_enumeration, enumeration_rows
from treegraft.pipeline.enumeration import enumerate_turn, schedule_key
from .conftest import ar_decoder, tree_decoder

PROMPT = "abcabc abcabc abcabc abc"
ALL = sorted(schedule_key(s) for s in itertools.product((0, 1), repeat=5))


def make(tiny_pair, middle, schedule=(1, 0, 1, 0, 1), budget=10):
    cfg = TreeConfig.paper(method="fixed", schedule=list(schedule), budget=budget, width=4, top_m=4)
    return tree_decoder(tiny_pair.target, middle, tiny_pair.tokenizer, cfg, eos_ids={2})


@torch.inference_mode()
def run_turns(dec, ids, n_turns):
    """Prefill and decode ``n_turns`` ordinary turns; the root of the next turn."""
    dec.budget()
    dec.prompt_len = len(ids)
    dec._prefill(ids)
    root = ids[-1]
    for _ in range(n_turns):
        emitted, _ = dec._turn(root, None, actions=[1, 0, 1, 0, 1])  # the same history for every schedule
        root = emitted[-1]
    return root


@torch.inference_mode()
def fresh_turn(dec, root):
    return dec._turn(root, None)


@pytest.mark.parametrize("middle_kind", ["same", "random"])
@pytest.mark.parametrize("turns_before", [0, 2])
def test_every_schedule_once_and_each_equals_a_fresh_turn(tiny_pair, middle_kind, turns_before):
    middle = tiny_pair.target if middle_kind == "same" else tiny_pair.middle
    ids = tiny_pair.tokenizer(PROMPT).input_ids
    dec = make(tiny_pair, middle)
    root = run_turns(dec, ids, turns_before)
    en = enumerate_turn(dec, root)
    assert sorted(en.outcomes) == ALL
    assert sorted(en.states) == sorted({s[:k] for s in ALL for k in range(5)})
    assert en.steps_run == 2 ** 6 - 2  # prefix sharing: 62 drafting steps, not 5 * 32
    assert 1 <= en.verifications <= 32
    accepted = set()
    for schedule, out in en.outcomes.items():
        fresh = make(tiny_pair, middle, [int(a) for a in schedule])
        fresh_root = run_turns(fresh, ids, turns_before)
        assert fresh_root == root
        _, stats = fresh_turn(fresh, fresh_root)
        assert (out.accepted, out.tree_nodes, out.verified_nodes, out.middle_calls) == (
            stats.accepted, stats.tree_nodes, stats.verified_nodes, stats.middle_calls), schedule
        assert out.latency_s > 0
        accepted.add(out.accepted)
    if middle_kind == "same":
        assert max(accepted) > 0, "with the target as middle drafter some schedule must be accepted"


def test_decoding_with_enumeration_equals_ar_and_rows_are_complete(tiny_pair):
    ids = tiny_pair.tokenizer(PROMPT).input_ids
    dec = make(tiny_pair, tiny_pair.target)
    tokens, ens = decode_with_enumeration(dec, ids, 20, lambda t: t % 2 == 0)
    assert tokens == ar_decoder(tiny_pair.target, {2}).generate(ids, 20).tokens
    assert [t for t, _ in ens] == list(range(0, 2 * len(ens), 2))
    rows = enumeration_rows(ens[0][1], 5, {"report": "r", "turn": 0})
    assert len(rows) == 32 * 5
    by_key = {(r["schedule"], r["step"]) for r in rows}
    assert len(by_key) == 160
    # rows of schedules sharing a prefix share the pre-action state at the next step
    a = next(r for r in rows if r["schedule"] == "10110" and r["step"] == 3)
    b = next(r for r in rows if r["schedule"] == "10011" and r["step"] == 3)
    assert a["prefix"] == b["prefix"] == "10"
    assert a["sig_node_count"] == b["sig_node_count"] and a["hist_1"] == 1.0 and a["hist_2"] == 0.0
    assert a["suffix"] == "10" and (a["suffix_4"], a["suffix_5"], a["suffix_3"]) == (1.0, 0.0, 0.0)
