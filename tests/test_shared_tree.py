"""The shared tree: lossless under every schedule, grafting invariants, the "Lumber
Liquidators" effect, and tree signals on hand-built trees."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch

from treegraft.decoding import TreeConfig
from treegraft.decoding.budget import AcceptanceModel
from treegraft.decoding.turn_stats import TurnStats
from treegraft.scheduling import SIGNAL_NAMES, FixedScheduler, tree_signals
from treegraft.tree import MIDDLE, SMALL, DraftTree, prune_to_budget
from .conftest import ar_decoder, tree_decoder

REPEATING = "abcabc abcabc abcabc abc"


def empty_stats():
    return TurnStats()


@pytest.mark.parametrize("schedule", list(itertools.product([0, 1], repeat=5)))
def test_greedy_equals_ar_for_every_schedule(tiny_pair, schedule):
    tok, target, middle = tiny_pair.tokenizer, tiny_pair.target, tiny_pair.middle
    ids = tok(REPEATING).input_ids
    ref = ar_decoder(target, {2}).generate(ids, 24).tokens
    dec = tree_decoder(target, middle, tok, TreeConfig.paper(method="fixed", schedule=list(schedule), budget=24))
    out = dec.generate(ids, 24)
    assert out.tokens == ref
    assert all(t["schedule"] == list(schedule) for t in out.turns)


@pytest.mark.parametrize("method", ["fixed", "all_call", "no_nondestructive", "no_expanded_selection", "csd"])
def test_greedy_equals_ar_for_every_shared_method(tiny_pair, method):
    tok, target = tiny_pair.tokenizer, tiny_pair.target
    for middle in (target, tiny_pair.middle):
        ids = tok("hello hello hello world").input_ids
        dec = tree_decoder(target, middle, tok, TreeConfig.paper(method=method, budget=30))
        assert dec.generate(ids, 32).tokens == ar_decoder(target, {2}).generate(ids, 32).tokens


def grown_tree(decoder, tok, text=REPEATING):
    """A turn's tree after two small steps on a repetitive prompt (the n-gram drafter finds matches)."""
    ids = tok(text).input_ids
    decoder._prefill(ids)
    tree, build = decoder.start_tree(ids[-1])
    stats, builder, plan = empty_stats(), decoder.builder, build.plan
    builder.expand_small(tree, [0], 1, plan, stats)
    builder.expand_small(tree, builder.top_w(tree, tree.nodes_created_at(1), plan.width), 2, plan, stats)
    assert len(tree) > 3, "the n-gram drafter should have proposed something on a repetitive prompt"
    return tree, build, stats


@pytest.mark.parametrize("grafting", ["nondestructive", "destructive"])
def test_grafting_invariants(tiny_pair, grafting):
    tok = tiny_pair.tokenizer
    dec = tree_decoder(tiny_pair.target, tiny_pair.middle, tok,
                           TreeConfig.paper(method="fixed", grafting=grafting, width=4, top_m=5))
    tree, build, stats = grown_tree(dec, tok)
    for step in (3, 4):
        alive_before = set(tree.alive_nodes())
        visited_before = {n for n in alive_before if tree.visited[n]}
        children_before = {n: set(tree.subtree(n)) - {n} for n in alive_before}
        n_before = len(tree)
        dec.builder.graft(tree, build, step, stats)
        newly_visited = {n for n in range(n_before) if tree.visited[n]} - visited_before
        assert newly_visited and not (newly_visited & visited_before)  # the pool never holds visited nodes
        assert len(newly_visited) <= dec.cfg.width
        alive_after = set(tree.alive_nodes())
        removed = alive_before - alive_after
        if grafting == "nondestructive":
            assert not removed  # nothing is ever deleted
        else:
            expected = set().union(*(children_before[n] for n in newly_visited if n in alive_after))
            assert removed == expected  # exactly the selected nodes' old subtrees
        for node in alive_after:
            tokens = [tree.token[c] for c in tree.children[node].values()]
            assert len(tokens) == len(set(tokens))
        assert all(tree.creator[n] == MIDDLE and tree.step[n] == step for n in range(n_before, len(tree)))
        for n in alive_after - {0}:  # rescored: cum is the path sum of the middle drafter's edges
            assert tree.cum[n] == pytest.approx(tree.cum[tree.parent[n]] + tree.edge[n], abs=1e-5)


def test_nondestructive_grafting_keeps_the_branch_the_target_accepts(tiny_pair, monkeypatch):
    """The paper's "Lumber Liquidators" case: small steps grow the target's own continuation; a
    middle step then grafts at the root, where the (unrelated) middle drafter proposes other tokens.
    Non-destructive grafting keeps the branch and the target accepts it; destructive grafting loses it."""
    tok, target, middle = tiny_pair.tokenizer, tiny_pair.target, tiny_pair.middle
    ids = tok("the quick brown fox").input_ids
    truth = ar_decoder(target, set()).generate(ids, 6).tokens

    def oracle_propose(self, path, m=None):  # an n-gram drafter that happens to know the continuation
        k = len(path)
        return ([(truth[k], -0.1, (3, 0))], 3) if path == truth[:k] and k < len(truth) else ([], 0)

    accepted = {}
    for grafting in ("nondestructive", "destructive"):
        dec = tree_decoder(target, middle, tok, TreeConfig.paper(method="fixed", schedule=[0, 0, 1, 0, 0],
                                                               grafting=grafting, budget=63), eos_ids=set())
        monkeypatch.setattr(type(dec.ngram), "propose_kinds", oracle_propose)  # the small step's lookup
        monkeypatch.setattr(type(dec.ngram), "copy_chain_kinds", lambda self, path, max_len=None: [])
        dec._prefill(ids)
        dec.middle.reset(ids)
        _, stats = dec._turn(ids[-1], None)
        accepted[grafting] = stats.accepted
    with torch.no_grad():
        middle_top = middle(torch.tensor([ids])).logits[0, -1].topk(TreeConfig.paper().top_m).indices.tolist()
    assert truth[0] not in middle_top  # the middle drafter would not propose the target's token at the root
    assert accepted["nondestructive"] >= 2
    assert accepted["destructive"] == 0


def test_signals_on_a_hand_built_tree():
    t = DraftTree.with_root(0)
    a = t.add_child(0, 1, -0.5, SMALL, 1)  # depth 1
    b = t.add_child(0, 2, -1.0, SMALL, 1)  # depth 1
    a1 = t.add_child(a, 3, -0.25, SMALL, 2)  # depth 2, cum -0.75
    a2 = t.add_child(a, 4, -2.0, SMALL, 2)  # depth 2, cum -2.5
    t.visited[0] = True
    s = tree_signals(t, step=3, width=2, ngram_match_len=2, small_top1_logprob=-0.6931471805599453)
    assert list(s) == list(SIGNAL_NAMES)
    # frontier = step-2 nodes {a1, a2}: mean depth 2, both leaves, cum mean -1.625, max -0.75
    assert s["depth_before"] == 2 and s["leaf_ratio_before"] == 1.0
    assert s["frontier_cum_mean"] == pytest.approx(-1.625) and s["frontier_cum_max"] == pytest.approx(-0.75)
    # picks = top-2 unvisited by cum: a (-0.5, depth 1) and a1 (-0.75, depth 2)
    assert s["collapse_debt"] == pytest.approx(0.5)  # -(1.5 - 2)
    assert s["pre_reselect_past_ratio"] == pytest.approx(0.5)  # a is at depth 1, not a frontier depth
    assert s["pre_reselect_overlap"] == pytest.approx(0.5)  # a1 is in the frontier
    assert s["pre_reselect_score"] == pytest.approx(-0.625)
    assert s["node_count"] == 5 and s["unvisited_count"] == 4
    assert s["ngram_match_len"] == 2 and s["small_top1_prob"] == pytest.approx(0.5)
    assert s["max_depth"] == 2 and s["mid_node_share"] == 0.0
    assert s["recent_al"] == 0 and s["recent_target_conf"] == 0 and s["expected_al"] == 0  # none given
    t.add_child(a1, 5, -0.1, MIDDLE, 3)
    given = tree_signals(t, step=3, width=2, turn_signals={"recent_al": 2.5, "recent_target_conf": 0.75, "expected_al": 1.5})
    assert given["max_depth"] == 3 and given["mid_node_share"] == pytest.approx(0.2)
    assert (given["recent_al"], given["recent_target_conf"], given["expected_al"]) == (2.5, 0.75, 1.5)
    # at step 1 the frontier is the root; a non-finite cum becomes 0
    t.cum[b] = float("-inf")
    s1 = tree_signals(t, step=1, width=10)
    assert s1["depth_before"] == 0 and s1["leaf_ratio_before"] == 0.0
    assert all(v == v and abs(v) != float("inf") for v in s1.values())


def test_scheduler_is_consulted_each_step_and_call_budget_applies(tiny_pair):
    tok, target, middle = tiny_pair.tokenizer, tiny_pair.target, tiny_pair.middle
    seen = []

    class Recorder(FixedScheduler):
        needs_signals = True

        def decide(self, state):
            seen.append((state.step, list(state.history), state.signals is not None))
            return 1

    cfg = TreeConfig.paper(method="fixed", max_calls_per_turn=2)
    dec = tree_decoder(target, middle, tok, cfg, scheduler=Recorder([1] * 5))
    out = dec.generate(tok(REPEATING).input_ids, 4)
    assert seen[:5] == [(1, [], True), (2, [1], True), (3, [1, 1], True), (4, [1, 1, 0], True), (5, [1, 1, 0, 0], True)]
    assert out.turns[0]["schedule"] == [1, 1, 0, 0, 0] and out.turns[0]["middle_calls"] == 2


def test_csd_drafts_a_chain_and_same_model_accepts_all(tiny_pair):
    tok, target = tiny_pair.tokenizer, tiny_pair.target
    ids = tok(REPEATING).input_ids
    out = tree_decoder(target, target, tok, TreeConfig.paper(method="csd"), eos_ids=set()).generate(ids, 30)
    assert out.tokens == ar_decoder(target, set()).generate(ids, 30).tokens
    assert all(t["verified_nodes"] == 5 for t in out.turns)  # a chain of D nodes, nothing else
    assert sum(t["accepted"] == 5 for t in out.turns) >= len(out.turns) - 1


def kept_paths(decoder, ids, schedule):
    """The pruned tree of one turn as {token path: cum score}, plus the turn's middle calls."""
    decoder._prefill(ids)
    stats = empty_stats()
    tree = decoder.build_tree(ids[-1], schedule, stats)
    kept = prune_to_budget(tree, decoder.budget())
    return {tuple(tree.path_tokens(n)): round(tree.cum[n], 4) for n in kept}, stats.middle_calls


@pytest.mark.parametrize("method", ["all_small", "all_mid", "fixed", "no_nondestructive", "no_expanded_selection", "csd"])
@pytest.mark.parametrize("budget", [0, 1, 2, 4])
def test_skipping_steps_beyond_the_budget_keeps_the_same_verified_tree(tiny_pair, method, budget):
    tok, target = tiny_pair.tokenizer, tiny_pair.target
    ids = tok(REPEATING).input_ids
    schedules = list(itertools.product([0, 1], repeat=5)) if method == "fixed" else [None]
    saved_any = False
    for schedule in schedules:
        runs = {}
        for skip in (False, True):
            cfg = TreeConfig.paper(method=method, budget=budget, width=4, top_m=4, skip_beyond_budget=skip)
            dec = tree_decoder(target, tiny_pair.middle, tok, cfg)
            runs[skip] = kept_paths(dec, ids, list(schedule) if schedule else cfg.actions())
        assert runs[True][0] == runs[False][0], (schedule, runs)
        assert runs[True][1] <= runs[False][1]
        saved_any |= runs[True][1] < runs[False][1]
    if method != "all_small" and budget <= 1:
        assert saved_any, "a budget of 0 or 1 node should let some middle calls go"


def test_turn_and_planner_signals_follow_the_decoding(tiny_pair, tmp_path, monkeypatch):
    """recent_al / recent_target_conf start from the prompt (0, the target's confidence on its last
    positions) and then follow each turn's AL and the target's top-1 probability at the accepted
    positions; expected_al is the budget planner's value for the tree at that step. The verification
    curve is a fixed, nearly flat one: measured on a loaded machine (CI's two workers) it could make
    every node look too dear to verify, and expected_al 0 everywhere."""
    import treegraft.engines.torch.target as engine

    flat = {1: 0.010, 2: 0.0101, 4: 0.0102, 8: 0.0104, 16: 0.011, 32: 0.012, 64: 0.014}
    monkeypatch.setattr(engine, "cached_verify_curve", lambda *args, **kwargs: dict(flat))
    tok = tiny_pair.tokenizer
    seen = []

    class Recorder(FixedScheduler):
        needs_signals = True

        def decide(self, state):
            seen.append(dict(state.signals))
            return 0

    dec = tree_decoder(tiny_pair.target, tiny_pair.middle, tok, TreeConfig.paper(method="fixed", budget="auto"),
                           scheduler=Recorder([0] * 5), cache_dir=tmp_path)
    ids = tok("abab abab abab ab").input_ids
    result = dec.generate(ids, 12)
    first = seen[0]
    assert first["recent_al"] == 0 and 0 < first["recent_target_conf"] <= 1
    al = 0.0
    for turn in result.turns[:-1]:
        al = 0.5 * al + 0.5 * turn["accepted"]
    assert dec.turn_signals["recent_al"] == pytest.approx(0.5 * al + 0.5 * result.turns[-1]["accepted"])
    assert 0 < dec.turn_signals["recent_target_conf"] <= 1
    assert all(s["expected_al"] >= 0 for s in seen) and any(s["expected_al"] > 0 for s in seen)


def test_warm_up_times_calls_without_the_prompt_catch_up(tiny_pair, monkeypatch):
    """The warm-up's t_mid is a call's cost, as `collect` measures it: the prompt is encoded at prefill, so
    no timed call carries it (with the lazy catch-up the first call did, and t_mid doubled online)."""
    from treegraft.engines.torch import MiddleDrafter

    tok, target, middle = tiny_pair.tokenizer, tiny_pair.target, tiny_pair.middle
    ids = tok(" ".join(["the quick brown fox jumps over the lazy dog"] * 12)).input_ids
    pending_at_call = []
    forward = MiddleDrafter._forward

    def spy(self, tree, new_nodes):
        pending_at_call.append(len(self.pending))
        return forward(self, tree, new_nodes)

    monkeypatch.setattr(MiddleDrafter, "_forward", spy)
    dec = tree_decoder(target, middle, tok, TreeConfig.paper(method="fixed", budget=8))
    t_tgt, t_mid = dec.warm_up(ids, 8)
    assert t_tgt > 0 and t_mid > 0
    assert pending_at_call and max(pending_at_call) < 16 < len(ids)  # only accepted tokens, never the prompt
    assert dec._eager_middle_prefill is False  # decoding after the warm-up keeps the lazy catch-up
    pending_at_call.clear()
    dec.generate(ids, 8)
    assert pending_at_call[0] == len(ids) - 1


def test_warm_up_leaves_the_budget_planner_as_it_found_it(tiny_pair):
    """The all-call warm-up measures the runtime context only: a planner that learned its drafting time
    there would start the scored decoding pricing every turn as if it called the middle drafter at every
    step, and verify large trees for a sunk cost that never comes."""
    tok, target, middle = tiny_pair.tokenizer, tiny_pair.target, tiny_pair.middle
    ids = tok(" ".join(["the quick brown fox jumps over the lazy dog"] * 4)).input_ids
    dec = tree_decoder(target, middle, tok, TreeConfig.paper(method="fixed", budget="auto"))
    dec.warm_up(ids, 8, repeats=2)
    assert dec.planner is not None and dec.planner.draft_s is None  # the curve kept, nothing learned
    assert dec.planner.acceptance.seen == AcceptanceModel().seen
    dec.generate(ids, 8)
    learned = copy.deepcopy(dec.planner)
    assert learned.draft_s is not None
    dec.warm_up(ids, 8)
    assert dec.planner.draft_s == learned.draft_s and dec.planner.planned == learned.planned
    assert dec.planner.acceptance.seen == learned.acceptance.seen
