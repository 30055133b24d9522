"""The per-prompt back-off of middle-drafter calls: when the gate closes and reopens, and that a decoder
whose learned policy would call at every step stops calling on a prompt where calls do not pay, with
the output still equal to `ar`'s."""

from __future__ import annotations

import pytest

from treegraft.decoding import TreeConfig
from treegraft.decoding.backoff import CallGate
from treegraft.scheduling import FixedScheduler
from .conftest import ar_decoder, tree_decoder

PLAIN_S = 0.1  # a plain step: 10 tokens/s


def feed(gate: CallGate, turns: list[tuple[int, float, int]]) -> list[bool]:
    """Whether the gate was open before each (emitted, seconds, calls) turn."""
    seen = []
    for emitted, seconds, calls in turns:
        seen.append(gate.is_open)
        gate.observe(emitted, seconds, calls if gate.is_open else 0, PLAIN_S)
    return seen


def test_gate_stays_open_while_call_turns_beat_plain_decoding():
    gate = CallGate()
    assert all(feed(gate, [(3, 0.2, 2)] * 20))  # 15 tokens/s against 10
    assert gate.closures == 0 and gate.call_rate_ratio(PLAIN_S) == pytest.approx(1.5)


def test_gate_closes_after_losing_call_turns_and_doubles_its_cooldown():
    gate = CallGate(min_call_turns=3, first_cooldown=4, max_cooldown=8)
    # the first call turn (the prompt's catch-up) is not counted; three losing turns close the gate
    opened = feed(gate, [(1, 0.3, 2)] * 4)
    assert opened == [True] * 4 and not gate.is_open and gate.closures == 1
    opened = feed(gate, [(1, 0.3, 2)] * 4)  # four closed turns, the scheduler is never asked
    assert opened == [False] * 4 and gate.is_open
    feed(gate, [(1, 0.3, 2)])  # the probe loses too: closed again, twice as long
    assert not gate.is_open and gate.closed_for == 8 and gate.closures == 2
    feed(gate, [(1, 0.3, 0)] * 8)
    feed(gate, [(1, 0.3, 2)])
    assert gate.closed_for == 8  # capped at max_cooldown


def test_a_winning_probe_reopens_for_good():
    gate = CallGate(min_call_turns=2, first_cooldown=2)
    feed(gate, [(1, 0.3, 1)] * 3)
    assert not gate.is_open
    feed(gate, [(1, 0.1, 0)] * 2)
    feed(gate, [(6, 0.2, 1)] * 3)  # 30 tokens/s: the decayed history no longer holds it shut
    assert gate.is_open and gate.closures == 1 and gate.cooldown == 2


def test_turns_without_calls_do_not_move_an_open_gate():
    gate = CallGate(min_call_turns=1)
    feed(gate, [(1, 5.0, 0)] * 10)
    assert gate.is_open and gate.call_turns == 0


@pytest.mark.parametrize("bad", [dict(decay=1.0), dict(min_call_turns=0), dict(first_cooldown=8, max_cooldown=4)])
def test_gate_rejects_bad_settings(bad):
    with pytest.raises(ValueError, match="backoff"):
        CallGate(**bad)


def test_decoder_backs_off_a_losing_policy_and_stays_lossless(tiny_pair):
    """A random middle drafter is (almost) never accepted, so a policy calling at every step loses to
    plain decoding; with the back-off the decoder stops calling, without it it keeps calling."""
    tok, target, middle = tiny_pair.tokenizer, tiny_pair.target, tiny_pair.middle
    ids = tok("def f(x):\n    return x + 1\n\ndef g(x):\n    return").input_ids
    want = ar_decoder(target, set()).generate(ids, 80).tokens
    calls = {}
    for backoff in (True, False):
        cfg = TreeConfig(method="fixed", budget="auto", call_backoff=backoff)
        dec = tree_decoder(target, middle, tok, cfg, eos_ids=set(), scheduler=FixedScheduler([1] * cfg.depth))
        # price a plain step as cheap as a turn's whole verification: a call turn then never pays
        dec._planner().curve = {n: 1e-9 for n in dec._planner().curve}
        out = dec.generate(ids, 80)
        assert out.tokens == want
        calls[backoff] = [t["middle_calls"] for t in out.turns]
        backed = [bool(t.get("backed_off")) for t in out.turns]
        assert any(backed) == backoff
    assert sum(calls[True]) < sum(calls[False]) / 2
    assert all(c > 0 for c in calls[False])


def test_fixed_schedules_and_the_warm_up_never_back_off(tiny_pair):
    tok, target, middle = tiny_pair.tokenizer, tiny_pair.target, tiny_pair.middle
    assert tree_decoder(target, middle, tok, TreeConfig(method="fixed")).gate is None
    dec = tree_decoder(target, middle, tok, TreeConfig(method="fixed", budget="auto"), eos_ids=set(),
                           scheduler=FixedScheduler([1] * 5))
    dec._planner().curve = {n: 1e-9 for n in dec._planner().curve}
    gate = dec.gate
    dec.warm_up(tok("abab abab abab ab").input_ids, 40)
    assert dec.gate is gate and gate.closures == 0  # the warm-up ran with the gate off


def test_gate_stays_shut_for_a_prompt_whose_catch_up_costs_more_than_calls_could_save():
    gate = CallGate(catch_up_share=0.5)
    gate.reset(catch_up_s=6.0, plain_answer_s=10.0)  # the drafter's prefill alone: 60% of plain decoding
    assert feed(gate, [(1, 0.1, 0)] * 5) == [False] * 5 and gate.closures == 0
    gate.reset(catch_up_s=4.0, plain_answer_s=10.0)
    assert gate.is_open
    gate.reset()  # no estimate (no measured runtime context): open
    assert gate.is_open


def test_decoder_never_calls_where_the_prompt_catch_up_is_too_dear(tiny_pair):
    """The catch-up is priced from the target's per-row verification cost times t_mid / t_tgt: with rows
    a step's worth each (a CPU like a Zen 1's), a call-at-every-step policy never calls on this prompt and
    its output is still `ar`'s; with nearly free rows (a GPU's curve) it calls."""
    tok, target, middle = tiny_pair.tokenizer, tiny_pair.target, tiny_pair.middle
    ids = tok(" ".join(["the quick brown fox jumps over the lazy dog"] * 6)).input_ids
    want = ar_decoder(target, set()).generate(ids, 16).tokens
    calls = {}
    for name, per_row in (("linear", 1.0), ("flat", 1e-6)):
        cfg = TreeConfig(method="fixed", budget="auto")
        dec = tree_decoder(target, middle, tok, cfg, eos_ids=set(), scheduler=FixedScheduler([1] * cfg.depth))
        dec._planner().curve = {n: 1.0 + per_row * (n - 1) for n in dec._planner().curve}
        dec.t_tgt_ms, dec.t_mid_ms = 10.0, 5.0
        out = dec.generate(ids, 16)
        assert out.tokens == want
        calls[name] = sum(t["middle_calls"] for t in out.turns)
    assert calls["linear"] == 0 and calls["flat"] > 0
