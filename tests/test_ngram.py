"""The n-gram drafter: longest match first, target-scored children, floor, incremental index."""

from __future__ import annotations

import math

import pytest
import torch

from treegraft.drafters import NGramConfig, NGramDrafter
from treegraft.drafters.ngram import copy_kind


def scores_for(n_pos: int, table: dict[int, dict[int, float]], m: int = 3):
    """top-m ids/logprobs rows: position p gets ``table[p]`` (padded with dummy tokens 900+)."""
    ids, lps = [], []
    for p in range(n_pos):
        row = sorted(table.get(p, {}).items(), key=lambda kv: -kv[1])
        row += [(900 + i, -20.0 - i) for i in range(m - len(row))]
        ids.append([t for t, _ in row[:m]])
        lps.append([s for _, s in row[:m]])
    return torch.tensor(ids), torch.tensor(lps)


def test_longest_match_first_then_shorter_orders():
    # context: 1 2 3 | 9 2 3 7 | 5 3 8 | 1 2   (root = last token 2)
    ctx = [1, 2, 3, 9, 2, 3, 7, 5, 3, 8, 1, 2]
    drafter = NGramDrafter(NGramConfig(max_n=3, top_m=3, floor_penalty=1.0, scoring="target"))
    table = {1: {3: -0.5}, 4: {3: -0.2}, 2: {9: -1.0}, 5: {7: -0.3}, 8: {8: -0.4}}
    drafter.reset(ctx, *scores_for(len(ctx) - 1, table))
    children, match = drafter.propose([])
    # suffix [1, 2] occurs ending at 1 -> next 3 (score -0.5); suffix [2] ends at 1 and 4 -> 3 again
    # (already found); no other continuation of a bare "2": only one child
    assert match == 2
    assert [t for t, _ in children] == [3] and children[0][1] == pytest.approx(-0.5)
    # from the node "3" below the root: suffix [1,2,3] ends at 2 -> 9; [2,3] ends at 2, 5 -> 9, 7; [3] -> 9, 7, 8
    children, match = drafter.propose([3])
    assert match == 3
    assert [t for t, _ in children] == [9, 7, 8]
    assert dict(children) == pytest.approx({9: -1.0, 7: -0.3, 8: -0.4})


def test_floor_for_tokens_outside_the_cached_top_m_and_no_match():
    ctx = [4, 5, 4, 6]
    drafter = NGramDrafter(NGramConfig(max_n=2, top_m=2, floor_penalty=2.0, scoring="target"))
    ids, lps = scores_for(3, {0: {7: -0.1, 8: -0.9}}, m=2)  # position 0 predicts 7 or 8, but 5 followed
    drafter.reset(ctx, ids, lps)
    children, _ = drafter.propose([4])  # sequence ... 6, 4 -> suffix [4] ends at 0 and 2
    assert children[0][0] == 5 and children[0][1] == pytest.approx(-0.9 - 2.0)  # floor = m-th logprob - penalty
    assert dict(children)[6] == pytest.approx(-21.0 - 2.0)
    assert drafter.propose([99]) == ([], 0)


def test_incremental_index_equals_a_rebuild():
    ctx = [1, 2, 3, 1, 2]
    more = [4, 1, 2, 3, 5, 1]
    a = NGramDrafter(NGramConfig(max_n=4))
    a.reset(ctx, *scores_for(len(ctx) - 1, {}, m=10))
    a.append(more)
    b = NGramDrafter(NGramConfig(max_n=4))
    b.reset(ctx + more, *scores_for(len(ctx) - 1, {}, m=10))
    assert [dict(x) for x in a.index] == [dict(x) for x in b.index]
    assert a.propose([2]) == b.propose([2])


def test_extend_cache_switch():
    ctx = [5, 6, 7]  # prompt; positions 0..2 are scored at prefill
    ids, lps = scores_for(3, {}, m=3)
    on = NGramDrafter(NGramConfig(max_n=1, top_m=3, extend_cache=True, scoring="target"))
    off = NGramDrafter(NGramConfig(max_n=1, top_m=3, extend_cache=False, uncached_score=-12.0, scoring="target"))
    for d in (on, off):
        d.reset(ctx, ids, lps)
        d.append([1, 2, 1])  # generated: positions 3, 4, 5; "1" at 3 was followed by 2
        d.set_scores(3, torch.tensor([[2, 8, 9]]), torch.tensor([[-0.05, -3.0, -4.0]]))  # verified position 3
    assert dict(on.propose([])[0])[2] == pytest.approx(-0.05)
    assert dict(off.propose([])[0])[2] == pytest.approx(-12.0)  # the reference keeps prefill scores only


def test_copy_chain_follows_the_most_recent_occurrence_of_the_longest_match():
    # context: 7 1 2 3 4 5 | 8 1 2 9 | 1 2   (root = 2): [1, 2] last occurred before 9
    ctx = [7, 1, 2, 3, 4, 5, 8, 1, 2, 9, 1, 2]
    drafter = NGramDrafter(NGramConfig(max_n=3, copy_len=4, copy_min_order=2))
    drafter.reset(ctx, *scores_for(len(ctx) - 1, {}, m=3))
    chain = drafter.copy_chain([])
    assert [t for t, _ in chain] == [9, 1, 2]  # stops at the newest token (nothing copied past the context)
    assert [t for t, _ in drafter.copy_chain([9])] == [1, 2]  # below a path: [1, 2, 9] ended at 9, then 1 2
    longer = NGramDrafter(NGramConfig(max_n=3, copy_len=2, copy_min_order=2))
    longer.reset([1, 2, 3, 4, 5, 1, 2], *scores_for(6, {}, m=3))
    assert [t for t, _ in longer.copy_chain([])] == [3, 4]  # copy_len tokens
    unigram_only = NGramDrafter(NGramConfig(max_n=3, copy_len=4, copy_min_order=2))
    unigram_only.reset([5, 6, 7, 6], *scores_for(3, {}, m=3))
    assert unigram_only.copy_chain([]) == []  # only a unigram matches: no chain
    assert NGramDrafter(NGramConfig(copy_len=0)).copy_chain([]) == []


def test_calibrated_scores_are_observed_acceptance_rates():
    ctx = [1, 2, 3, 9, 2, 3, 7, 5, 3, 8, 1, 2]
    # the shared rates alone (test_a_prompt_whose_children_fail... covers the prompt's factor)
    drafter = NGramDrafter(NGramConfig(max_n=3, top_m=3, scoring="calibrated", prompt_prior=None))
    drafter.reset(ctx, *scores_for(len(ctx) - 1, {2: {9: -1.0}, 5: {7: -0.3}, 8: {8: -0.4}}))
    children, _ = drafter.propose_kinds([3])
    # each proposed token is the target's own top-1 where it occurred: agreement 1
    assert [(t, kind) for t, _, kind in children] == [(9, (3, 0, 1)), (7, (2, 0, 1)), (8, (1, 0, 1))]
    assert all(score == pytest.approx(math.log(0.3)) for _, score, _ in children)  # the prior before any turn
    drafter.observe([((3, 0, 1), True)] * 8 + [((1, 0, 1), False)] * 8)
    by_token = {t: s for t, s, _ in drafter.propose_kinds([3])[0]}
    assert by_token[9] == pytest.approx(math.log((8 + 0.6) / 10))
    assert by_token[8] == pytest.approx(math.log(0.6 / 10))
    assert by_token[9] > by_token[7] > by_token[8]  # long matches that were right rank above unigrams
    with pytest.raises(ValueError, match="scoring"):
        NGramConfig(scoring="magic")


def test_a_kind_says_whether_the_target_predicted_the_token_where_it_occurred():
    # context 4 5 6 | 4 5 7 | 4 5 (root 5): after "4 5", 6 followed at position 1 and 7 at position 4
    ctx = [4, 5, 6, 4, 5, 7, 4, 5]
    drafter = NGramDrafter(NGramConfig(max_n=2, top_m=3, copy_len=3, copy_min_order=2))
    drafter.reset(ctx, *scores_for(4, {1: {6: -0.1}, 4: {3: -0.2, 7: -1.0}}))  # no cache past position 3
    kinds = {t: kind for t, _, kind in drafter.propose_kinds([])[0]}
    assert kinds[6] == (2, 0, 1)  # the target's top-1 at position 1
    # 7's occurrence (position 4) lies past the cached rows: unknown
    assert kinds[7] == (2, 1, -1)
    drafter.set_scores(4, *scores_for(1, {0: {3: -0.2, 7: -1.0}}))
    kinds = {t: kind for t, _, kind in drafter.propose_kinds([])[0]}
    assert kinds[7][2] == 0  # cached now, and not the top-1 there
    assert drafter.copy_chain_kinds([])[0][2] == copy_kind(2, True, 0)
    drafter.observe([((2, 0, 1), True)] * 6 + [((2, 1, 0), False)] * 6)
    assert drafter.rate((2, 0, 1)) > 0.3 > drafter.rate((2, 1, 0))  # the agreement is learned apart


def test_a_prompt_whose_children_fail_lowers_every_rate_until_the_next_prompt():
    ctx = [4, 5, 6, 4, 5]
    drafter = NGramDrafter(NGramConfig(max_n=2, top_m=3, prompt_prior=4.0))
    drafter.reset(ctx, *scores_for(4, {}))
    kind = (2, 0, 0)
    assert drafter.rate(kind) == pytest.approx(0.3)  # the prior, nothing observed
    drafter.observe([(kind, False)] * 4)  # expected 0.3 each before any count: 1.2 + shared counts moving
    shared = drafter.shared_rate(kind)
    assert drafter.prompt_factor() < 1.0 and drafter.rate(kind) == pytest.approx(shared * drafter.prompt_factor())
    drafter.reset(ctx, *scores_for(4, {}))
    assert drafter.prompt_factor() == 1.0 and drafter.rate(kind) == pytest.approx(shared)  # the counts stay shared
    drafter.observe([(kind, True)] * 8)
    assert drafter.prompt_factor() > 1.0
    off = NGramDrafter(NGramConfig(max_n=2, prompt_prior=None))
    off.reset(ctx, *scores_for(4, {}))
    off.observe([(kind, False)] * 4)
    assert off.prompt_factor() == 1.0 and off.rate(kind) == pytest.approx(off.shared_rate(kind))
    with pytest.raises(ValueError, match="prompt_prior"):
        NGramConfig(prompt_prior=0.0)


def test_chain_mode_drafts_the_longest_matchs_most_frequent_follower_as_the_replay_does():
    """``mode: chain``'s draft equals the headroom replay's ``NGramIndex.chain`` (the policy its figures price)
    token by token, with the kind (order, depth capped at 2, unanimous) in each token's rate."""
    import random

    from treegraft.pipeline.headroom import NGramIndex

    rng = random.Random(0)
    for trial in range(40):
        seq = [rng.randrange(6) for _ in range(rng.randrange(2, 60))]  # a small alphabet: many repeats and ties
        drafter = NGramDrafter(NGramConfig(max_n=4, mode="chain", chain_len=6, prompt_prior=None))
        drafter.reset(seq, [[] for _ in seq], [[] for _ in seq])
        index = NGramIndex(4, seq)
        ours = drafter.chain_kinds([])
        assert [(t, k[1:3] + (bool(k[3]),)) for t, _, k in ours] == [(t, k) for t, k in index.chain(6)], trial
        assert all(s == pytest.approx(math.log(0.3)) for _, s, _ in ours)  # the prior before any turn
        path = [t for t, _, _ in ours[:2]]  # below a drafted path: the same chain, continued
        assert [t for t, _, _ in drafter.chain_kinds(path, 4 - len(path))] == [t for t, _, _ in ours[2:4]]


def test_chain_mode_ties_go_to_the_most_recent_follower_and_rates_are_learned():
    # after "7": 1 once, then 2 once (a tie: the most recent, 2); "7 2" -> 7 (unanimous); "2 7" has no follower
    # yet, so order 1 again: 2
    drafter = NGramDrafter(NGramConfig(max_n=2, mode="chain", chain_len=3, prompt_prior=None))
    seq = [7, 1, 5, 7, 2, 7]
    drafter.reset(seq, [[] for _ in seq], [[] for _ in seq])
    chain = drafter.chain_kinds([])
    assert [(t, k) for t, _, k in chain] == [(2, ("chain", 1, 0, 0)), (7, ("chain", 2, 1, 1)),
                                             (2, ("chain", 1, 2, 0))]
    drafter.observe([(("chain", 1, 0, 0), True)] * 8)
    assert drafter.chain_kinds([])[0][1] == pytest.approx(math.log((8 + 0.6) / 10))
    with pytest.raises(ValueError, match="mode"):
        NGramConfig(mode="forest")
    with pytest.raises(ValueError, match="chain needs scoring calibrated"):
        NGramConfig(mode="chain", scoring="target")
