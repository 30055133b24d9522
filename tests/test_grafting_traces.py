"""Appendix G: grafting provenance and traces.

A scripted target (the next token is the current one + 1, :class:`ScriptedEngine`), the n-gram drafter
copying the count from the prompt, and a scripted middle drafter that proposes other tokens: the tree's
provenance, the accepted tokens counted on branches only non-destructive grafting kept, the traced
turns, their records, the table over prompts and the rendered traces."""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest
import torch

from treegraft.decoding import TreeConfig, TreeGraftDecoder
from treegraft.decoding.autoregressive import GenerationResult
from treegraft.decoding.turn_stats import TurnStats
from treegraft.devices import Clock
from treegraft.engines.logprobs import TokenLogProbs
from treegraft.pipeline.grafting import grafting_examples, grafting_table, render_trace
from treegraft.pipeline.records import make_record, read_records
from treegraft.tree import MIDDLE, SMALL, DraftTree

from .test_engine import VOCAB, ScriptedEngine
from .test_llama_cpp import PROMPT as LLAMA_PROMPT, chat, smol  # noqa: F401  (a module fixture)
from .conftest import ar_decoder, tree_decoder

PROMPT = list(range(VOCAB)) * 2 + [0, 1, 2]  # root 2; the target continues 3, 4, 5, ...
WORDS = {3: "L", 4: "umber", 5: " Liquid", 6: "ators", 7: " said", 9: "The", 10: " They", 11: " CBS", 12: "x", 13: "y"}


class Words:
    """A tokenizer that only decodes: one word per id."""

    def decode(self, ids, skip_special_tokens=False):
        return "".join(WORDS.get(int(t), f"#{int(t)}") for t in ids)


class ScriptedMiddle:
    """A middle drafter (DraftModel) whose three best tokens are ``at_root`` under the root and, under any
    other node of token t, t + 7, t + 9, t + 11 (never the target's t + 1), best first (or t + each of
    ``offsets``)."""

    clock = Clock()

    def __init__(self, at_root: list[int], offsets: tuple[int, ...] = (7, 9, 11)):
        self.at_root = at_root
        self.offsets = offsets
        self.logprobs: dict[int, TokenLogProbs] = {}
        self.forward_s, self.tokens_encoded, self.committed, self.charged_s = 0.0, 0, 0, 0.0

    def reset(self, prompt_ids, encode=False):
        self.logprobs = {}

    def start_turn(self):
        self.logprobs = {}

    def encode(self, tree, nodes, need_logprobs=None):
        for node in nodes if need_logprobs is None else need_logprobs:
            token = tree.token[node]
            best = self.at_root if node == 0 else [(token + k) % VOCAB for k in self.offsets]
            row = torch.full((VOCAB,), -30.0, device="cpu")
            for rank, token in enumerate(best):
                row[token] = -1.0 - rank
            self.logprobs[node] = TokenLogProbs(torch.log_softmax(row, dim=-1))

    def commit(self, path_nodes, path_tokens):
        self.logprobs = {}

    def snapshot(self):
        return dict(self.logprobs)

    def restore(self, snap):
        self.logprobs = dict(snap)

    def release(self):
        self.logprobs = {}


def scripted_decoder(grafting: str, schedule: list[int], middle: ScriptedMiddle, tokenizer=None) -> TreeGraftDecoder:
    cfg = TreeConfig.paper(method="fixed", depth=len(schedule), schedule=schedule, grafting=grafting, budget=40,
                           width=4, top_m=3)
    return TreeGraftDecoder(ScriptedEngine(), middle, tokenizer, cfg, eos_ids=set())


def path_of(tree: DraftTree, tokens: list[int]) -> list[int]:
    """The alive node ids along ``tokens`` from the root (as far as the tree has them)."""
    nodes, node = [0], 0
    for token in tokens:
        node = tree.children[node].get(token)
        if node is None or not tree.alive[node]:
            break
        nodes.append(node)
    return nodes


# ---------------------------------------------------------------- provenance
def test_provenance_of_a_hand_built_graft():
    tree = DraftTree.with_root(0)
    a = tree.add_child(0, 1, -0.5, SMALL, 1)
    b = tree.add_child(0, 2, -1.0, SMALL, 1)
    a1 = tree.add_child(a, 3, -0.2, SMALL, 2)
    b1 = tree.add_child(b, 4, -0.3, SMALL, 2)
    existing = dict(tree.children[0])
    for token in (5, 6):  # the middle drafter's new children; it also proposes b's token 2 again
        tree.add_child(0, token, -0.1, MIDDLE, 3)
    kept = tree.note_graft(0, 3, existing, [5, 6, 2])
    # a was not proposed: destructive grafting loses it for good; b would come back without b1
    assert kept == (a, b1) and tree.grafts == [(0, 3, (a, b1))]
    assert [tree.kept[n] for n in (0, a, b, a1, b1)] == [0, 1, 0, 0, 1]
    assert tree.first_kept([0, a, a1]) == 1  # both accepted tokens lie on the kept branch
    assert tree.first_kept([0, b, b1]) == 2  # only b1 does
    assert tree.first_kept([0, b]) is None
    c1 = tree.add_child(a1, 7, -0.1, SMALL, 4)  # grown later under a kept branch: it exists only because of it
    assert tree.first_kept([0, a, a1, c1]) == 1
    copy = tree.copy()
    assert copy.kept == tree.kept and copy.grafts == tree.grafts and copy.kept is not tree.kept
    assert tree.note_graft(b, 4, {4: b1}, [4]) == () and len(tree.grafts) == 1  # a childless re-proposal keeps nothing
    assert tree.creator[a] == SMALL and tree.step[a1] == 2 and tree.parent[b1] == b
    # later in step 3 the middle drafter grafts under b (destructive grafting deleted b with the root's subtree
    # and skips it): what it adds is kept by the root's graft; under a1 (on a kept branch) nothing new is noted
    b2 = tree.add_child(b, 8, -0.1, MIDDLE, 3)
    assert tree.note_graft_below(0, 3, b, [b2]) == (b2,) and tree.grafts == [(0, 3, (a, b1, b2))]
    assert tree.kept[b2] == 1 and tree.first_kept([0, b, b2]) == 2
    assert tree.note_graft_below(0, 3, a1, [tree.add_child(a1, 9, -0.1, MIDDLE, 3)]) == () and len(tree.grafts) == 1
    d = tree.add_child(b, 10, -0.1, MIDDLE, 4)
    assert tree.note_graft_below(b, 5, b2, [d]) == () and tree.note_graft_below(0, 5, b, [d]) == (d,)
    assert tree.grafts[-1] == (0, 5, (d,)) and tree.kept[d] == 2  # a new event: no graft under 0 at step 5 yet


@pytest.mark.parametrize("grafting", ["nondestructive", "destructive"])
def test_accepted_tokens_on_a_kept_branch_are_counted_exactly(grafting):
    """Steps 1-2 (n-gram) grow 3 -> 4, the target's own continuation; step 3's middle drafter grafts at
    the root, proposing 3 again (so 3 would be re-added by destructive grafting, without its child) and
    9, 10, and under 3 proposes 10, 12, 14 (not 4). Non-destructive: 3 -> 4 accepted, of which exactly 4
    lies on the kept branch. Destructive: the historical 4 is gone, 3 alone is accepted, none kept."""
    middle = ScriptedMiddle(at_root=[3, 9, 10])
    dec = scripted_decoder(grafting, [0, 0, 1], middle)
    dec._prefill(PROMPT)
    tree = dec.build_tree(PROMPT[-1], None, TurnStats())
    historical = [n for n in range(len(tree)) if tree.creator[n] == SMALL]
    three, four = historical[0], historical[1]
    assert tree.path_tokens(four) == [3, 4] and tree.step[four] == 2
    if grafting == "nondestructive":
        assert tree.alive[four] and tree.grafts and tree.grafts[0][0] == 0
        assert tree.kept[three] == 0 and tree.kept[four] > 0  # the re-proposed 3 is no kept branch; 4 is
        assert tree.creator[three] == SMALL  # it keeps its node (and its provenance), with the middle's score
        assert sorted(tree.token[c] for c in tree.children[0].values()) == [3, 9, 10]
    else:
        assert not tree.alive[four] and not tree.alive[three] and not tree.grafts
        assert path_of(tree, [3, 4]) == path_of(tree, [3])  # no alive 3 -> 4 anywhere
        assert all(k == 0 for k in tree.kept)
    dec = scripted_decoder(grafting, [0, 0, 1], middle)
    dec._prefill(PROMPT)
    emitted, stats = dec._turn(PROMPT[-1], None)
    if grafting == "nondestructive":
        assert emitted == [3, 4, 5] and stats.accepted == 2
        assert stats.accepted_on_kept == 1 and stats.grafts_kept >= 1
    else:
        assert emitted == [3, 4] and stats.accepted == 1
        assert stats.accepted_on_kept == 0 and stats.grafts_kept == 0


@pytest.mark.parametrize("grafting", ["nondestructive", "destructive"])
def test_a_graft_below_an_earlier_graft_of_the_same_step_is_counted(grafting):
    """Step 1 (middle) puts 3, 9, 10 under the root, step 2 (n-gram) grows 3 -> 4. Step 3's middle drafter
    proposes t + 1 first under every node and selects both 3 and 4, 3 first (a parent's score is at least
    its child's). Its graft under 3 re-proposes 4, which has no children yet: no kept branch by that graft
    alone. Non-destructive: 4 stays and its own graft adds 5, so 3 -> 4 -> 5 is accepted and 5 counts as
    kept. Destructive: the graft under 3 deletes 4 (re-adding it as a new, unselected node) and skips the
    graft under the old 4, so 5 never exists: 3 -> 4 is accepted, none kept."""
    middle = ScriptedMiddle(at_root=[3, 9, 10], offsets=(1, 7, 9))
    dec = scripted_decoder(grafting, [1, 0, 1], middle)
    dec._prefill(PROMPT)
    tree = dec.build_tree(PROMPT[-1], None, TurnStats())
    path = path_of(tree, [3, 4, 5])
    if grafting == "nondestructive":
        three, four, five = path[1:]
        assert (tree.creator[four], tree.step[four], tree.visited[four]) == (SMALL, 2, True)
        assert (tree.creator[five], tree.step[five]) == (MIDDLE, 3)
        assert tree.kept[three] == tree.kept[four] == 0 and tree.kept[five] > 0
        assert tree.grafts[tree.kept[five] - 1][:2] == (three, 3)  # kept by the graft under 3 at step 3
        assert tree.first_kept(path) == 3
    else:
        assert len(path) == 3 and tree.creator[path[2]] == MIDDLE and not tree.visited[path[2]]
        assert all(k == 0 for k in tree.kept) and not tree.grafts
    dec = scripted_decoder(grafting, [1, 0, 1], middle)
    dec._prefill(PROMPT)
    emitted, stats = dec._turn(PROMPT[-1], None)
    if grafting == "nondestructive":
        assert emitted == [3, 4, 5, 6] and stats.accepted == 3 and stats.accepted_on_kept == 1
    else:
        assert emitted == [3, 4, 5] and stats.accepted == 2 and stats.accepted_on_kept == 0


def test_a_generation_traces_the_turns_that_accepted_a_kept_branch():
    """Four n-gram steps grow L -> umber -> Liquid -> ators; the middle drafter then grafts The | They |
    CBS at the root, beside it. Every turn accepts the whole kept branch; two turns are traced."""
    middle = ScriptedMiddle(at_root=[9, 10, 11])
    dec = scripted_decoder("nondestructive", [0, 0, 0, 0, 1], middle, tokenizer=Words())
    out = dec.generate(PROMPT, 15)
    assert out.tokens == [(3 + i) % VOCAB for i in range(15)]  # the target's own decoding
    assert out.grafting == {"accepted_tokens": sum(t["accepted"] for t in out.turns),
                            "accepted_on_kept": sum(t["accepted"] for t in out.turns),
                            "turns": len(out.turns), "grafting_turns": len(out.turns), "kept_turns": len(out.turns)}
    assert all(t["accepted"] == 4 == t["accepted_on_kept"] for t in out.turns)
    assert [e["turn"] for e in out.grafting_examples] == [0, 1]  # ties: the earliest turns
    first = out.grafting_examples[0]
    json.dumps(first)  # JSON-able
    assert [n["piece"] for n in first["kept_branch"]] == ["L", "umber", " Liquid", "ators"]
    assert [(n["drafter"], n["step"]) for n in first["kept_branch"]] == [("small", 1), ("small", 2), ("small", 3),
                                                                          ("small", 4)]
    assert first["new_children"] == ["The", " They", " CBS"]
    assert first["grafted_under"] == {"path": [], "depth": 0, "drafter": "root", "step": 0}
    assert first["graft_step"] == 5 and first["root"] == "#2" and first["bonus"] == " said"
    assert first["accepted_on_kept"] == 4 and first["small_drafter"] == "ngram"
    assert first["context"] == [Words().decode([t]) for t in PROMPT[-12:]]
    text = render_trace(first)
    assert "L -> umber -> ' Liquid' -> ators" in text
    assert "The | ' They' | ' CBS'" in text and "#2" in text and "4 of 4 on the kept branch" in text
    destructive = scripted_decoder("destructive", [0, 0, 0, 0, 1], middle, tokenizer=Words()).generate(PROMPT, 15)
    assert destructive.tokens == out.tokens
    assert destructive.grafting["accepted_on_kept"] == 0 and destructive.grafting_examples == []
    assert destructive.grafting["accepted_tokens"] < out.grafting["accepted_tokens"]  # the branch was the win


def test_greedy_still_equals_ar_and_grafting_counts_add_up_on_the_tiny_pair(tiny_pair):
    tok, target, middle = tiny_pair.tokenizer, tiny_pair.target, tiny_pair.middle
    ids = tok("abcabc abcabc abcabc abc").input_ids
    ref = ar_decoder(target, {2}).generate(ids, 20).tokens
    for method in ("fixed", "no_nondestructive", "all_mid"):
        out = tree_decoder(target, middle, tok, TreeConfig.paper(method=method, budget=16)).generate(ids, 20)
        assert out.tokens == ref, method
        g = out.grafting
        assert g["turns"] == len(out.turns) and g["accepted_tokens"] == sum(t["accepted"] for t in out.turns)
        assert g["accepted_on_kept"] == sum(t["accepted_on_kept"] for t in out.turns) <= g["accepted_tokens"]
        assert g["kept_turns"] <= g["turns"] and len(out.grafting_examples) <= 2
        if method == "fixed":
            assert g["grafting_turns"] > 0  # expanded selection grafts under nodes that have children
        else:  # destructive grafting keeps nothing; a single drafter never grafts
            assert g["grafting_turns"] == g["accepted_on_kept"] == 0


def test_where_destructive_grafting_first_accepts_less_the_kept_branches_were_accepted(smollm2_self_pair):
    """A real decode (SmolLM2 drafting for itself): ``fixed`` and ``no_nondestructive`` emit the same tokens
    and see the same contexts until their acceptance first differs; at that turn ``fixed`` accepted more,
    so its accepted path holds tokens that only non-destructive grafting built. Before the same-step
    grafts were counted (a node below an earlier graft of the step, which destructive grafting deletes and
    skips), this turn counted 0 such tokens, as did every turn of the decode."""
    from treegraft.data.benchmarks import format_prompt
    from treegraft.front import decoder_for

    pair = smollm2_self_pair
    ids = pair.tokenizer(format_prompt(pair.tokenizer, "Explain why the sky is blue in two sentences."),
                         return_tensors="pt").input_ids[0].tolist()
    out = {m: decoder_for(m, pair, {"budget": 31}).generate(ids, 16) for m in ("fixed", "no_nondestructive")}
    fixed, destructive = out["fixed"], out["no_nondestructive"]
    assert fixed.tokens == destructive.tokens
    first = next(k for k, (a, b) in enumerate(zip(fixed.turns, destructive.turns)) if a["accepted"] != b["accepted"])
    assert fixed.turns[first]["accepted"] > destructive.turns[first]["accepted"]
    assert fixed.turns[first]["accepted_on_kept"] > 0
    assert fixed.grafting["accepted_on_kept"] > 0 == destructive.grafting["accepted_on_kept"]
    trace = fixed.grafting_examples[0]
    assert trace["accepted_on_kept"] > 0 and all(isinstance(n["piece"], str) for n in trace["kept_branch"])


def test_the_llama_cpp_engine_runs_the_same_provenance(smol):  # noqa: F811
    """llama.cpp runs the same builders: its tree methods carry the same grafting counts and traces."""
    from treegraft.front import decoder_for

    ids = chat(smol.tokenizer, LLAMA_PROMPT)
    ref = decoder_for("ar", smol).generate(ids, 24).tokens
    out = decoder_for("fixed", smol, {"budget": 15}).generate(ids, 24)
    assert out.tokens == ref
    g = out.grafting
    assert g["turns"] == len(out.turns) and g["accepted_tokens"] == sum(t["accepted"] for t in out.turns)
    assert g["accepted_on_kept"] == sum(t["accepted_on_kept"] for t in out.turns)
    assert g["grafting_turns"] == sum(t["grafts_kept"] > 0 for t in out.turns)
    for trace in out.grafting_examples:  # decoded with the pair's tokenizer
        assert all(isinstance(n["piece"], str) for n in trace["kept_branch"]) and trace["accepted_on_kept"] > 0


# ---------------------------------------------------------------- records
def test_records_carry_the_grafting_fields(tmp_path, tiny_pair):
    middle = ScriptedMiddle(at_root=[9, 10, 11])
    out = scripted_decoder("nondestructive", [0, 0, 0, 0, 1], middle, tokenizer=Words()).generate(PROMPT, 10)
    rec = make_record("p", "gsm8k", "fixed", 7, out, "text")
    assert rec["grafting"] == out.grafting and rec["grafting_examples"] == out.grafting_examples
    ar = ar_decoder(tiny_pair.target, {2}).generate([5, 6, 7], 4)
    ar_rec = make_record("p", "gsm8k", "ar", 7, ar, "text")
    assert ar_rec["grafting"] is None and ar_rec["grafting_examples"] is None
    folder = tmp_path / "p" / "gsm8k"
    folder.mkdir(parents=True)
    for name, r in (("fixed", rec), ("ar", ar_rec)):
        (folder / f"{name}.jsonl").write_text(json.dumps(r) + "\n")
    frame = read_records(tmp_path).set_index("method")
    assert frame.loc["fixed", "grafting_accepted_tokens"] == out.grafting["accepted_tokens"] == 8
    assert frame.loc["fixed", "grafting_accepted_on_kept"] == 8
    assert frame.loc["fixed", "grafting_turns"] == frame.loc["fixed", "grafting_kept_turns"] == 2
    assert frame.loc["fixed", "grafting_examples"][0]["kept_branch"][0]["piece"] == "L"
    assert all(math.isnan(frame.loc["ar", c]) for c in ("grafting_accepted_tokens", "grafting_accepted_on_kept",
                                                          "grafting_turns", "grafting_kept_turns"))
    assert frame.loc["ar", "grafting_examples"] is None
    shown = grafting_examples(frame.reset_index(), k=1)
    assert len(shown) == 1 and shown[0].startswith("p | gsm8k | fixed | question 7 | turn 0")


# ---------------------------------------------------------------- the table and the rendering
def synthetic_records() -> pd.DataFrame:
    rows = []
    for bench in ("b1", "b2"):
        for q in range(6):
            accepted = 10 + 2 * q
            rows.append({"pair": "p", "benchmark": bench, "method": "fixed", "question_id": q, "turns": 5,
                         "grafting_accepted_tokens": accepted, "grafting_accepted_on_kept": q + (bench == "b2"),
                         "grafting_turns": 3, "grafting_kept_turns": 1 if q else 0, "grafting_examples": []})
            rows.append({"pair": "p", "benchmark": bench, "method": "constant", "question_id": q, "turns": 4,
                         "grafting_accepted_tokens": 8 * (q + 1), "grafting_accepted_on_kept": 2 * (q + 1),
                         "grafting_turns": 2, "grafting_kept_turns": 2, "grafting_examples": []})
            rows.append({"pair": "p", "benchmark": bench, "method": "no_nondestructive", "question_id": q, "turns": 6,
                         "grafting_accepted_tokens": 9, "grafting_accepted_on_kept": 0, "grafting_turns": 0,
                         "grafting_kept_turns": 0, "grafting_examples": []})
            rows.append({"pair": "p", "benchmark": bench, "method": "ar", "question_id": q, "turns": 0,
                         "grafting_accepted_tokens": np.nan, "grafting_accepted_on_kept": np.nan,
                         "grafting_turns": np.nan, "grafting_kept_turns": np.nan, "grafting_examples": None})
    return pd.DataFrame(rows)


def test_grafting_table_gives_the_share_and_its_interval():
    records = synthetic_records()
    table = grafting_table(records, n_resamples=500).set_index("method")
    assert sorted(table.index) == ["constant", "fixed", "no_nondestructive"]  # ar has no grafting counts
    fixed = records[records["method"] == "fixed"]
    share = fixed["grafting_accepted_on_kept"].sum() / fixed["grafting_accepted_tokens"].sum()
    row = table.loc["fixed"]
    assert row["accepted on kept share"] == pytest.approx(share)
    assert row["accepted on kept share lo"] < share < row["accepted on kept share hi"]
    assert (row["n prompts"], row["turns"], row["kept turns"], row["grafting turns"]) == (12, 60, 10, 36)
    assert (row["accepted tokens"], row["accepted on kept"]) == (fixed["grafting_accepted_tokens"].sum(),
                                                                fixed["grafting_accepted_on_kept"].sum())
    # every prompt at a quarter: any resample gives a quarter; none kept: zero, exactly
    assert tuple(table.loc["constant", ["accepted on kept share", "accepted on kept share lo",
                                        "accepted on kept share hi"]]) == pytest.approx((0.25, 0.25, 0.25))
    assert tuple(table.loc["no_nondestructive", ["accepted on kept share", "accepted on kept share lo",
                                                 "accepted on kept share hi"]]) == (0.0, 0.0, 0.0)
    again = grafting_table(records, n_resamples=500).set_index("method")
    assert again.loc["fixed", "accepted on kept share lo"] == row["accepted on kept share lo"]  # a fixed seed
    with pytest.raises(ValueError, match="records lack column"):
        grafting_table(records.drop(columns=["grafting_turns"]))


def example(turn: int, on_kept: int) -> dict:
    """A traced turn as a record holds it: the first ``on_kept`` pieces of L umber Liquid ators accepted."""
    pieces = ["L", "umber", " Liquid", "ators"][:on_kept]
    kept = [{"piece": p, "drafter": "small", "step": i + 1} for i, p in enumerate(pieces)]
    return {"turn": turn, "small_drafter": "ngram", "context": [" the", " company"], "root": " is",
            "grafted_under": {"path": [], "depth": 0, "drafter": "root", "step": 0}, "graft_step": 5,
            "kept_branch": kept, "new_children": ["The", " They"], "accepted": kept, "bonus": " said",
            "accepted_on_kept": on_kept}


def test_render_trace_shows_the_kept_branch_in_order():
    text = render_trace(example(3, 4))
    positions = [text.index(p) for p in ("L", "umber", "' Liquid'", "ators")]
    assert positions == sorted(positions)
    assert "kept branch:    L -> umber -> ' Liquid' -> ators" in text
    assert "new children that middle step grafted there: The | ' They'" in text and "the root ' is'" in text
    deeper = example(1, 2)
    deeper["grafted_under"] = {"path": ["a", "b\n"], "depth": 2, "drafter": "middle", "step": 3}
    assert "b\\n (depth 2, middle step 3; path from the root: a b\\n)" in render_trace(deeper)  # a line break escaped


def test_grafting_examples_picks_the_longest_kept_branches_first():
    records = pd.DataFrame([
        {"pair": "p", "benchmark": "b1", "method": "fixed", "question_id": 4, "grafting_examples": [example(0, 2)]},
        {"pair": "p", "benchmark": "b2", "method": "fixed", "question_id": 1, "grafting_examples": [example(5, 4),
                                                                                                   example(6, 1)]},
        {"pair": "p", "benchmark": "b1", "method": "ar", "question_id": 4, "grafting_examples": None},
    ])
    shown = grafting_examples(records, k=2)
    assert len(shown) == 2
    assert shown[0].splitlines()[0] == "p | b2 | fixed | question 1 | turn 5 | small drafter ngram"
    assert shown[1].splitlines()[0].startswith("p | b1 | fixed | question 4 | turn 0")
    assert "L -> umber -> ' Liquid' -> ators" in shown[0]
    assert grafting_examples(records, k=0) == []
