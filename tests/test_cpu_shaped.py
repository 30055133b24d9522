"""CPU-shaped costs stay lossless: every method in every runtime and tree shape equals `ar` of the same
runtime; the budget planner, the shape rule, pruning order and restricted draft vocabularies."""

from __future__ import annotations

import pytest
import torch

from treegraft.decoding import SamplingConfig, TreeConfig
from treegraft.decoding.budget import AcceptanceModel, BudgetPlanner
from treegraft.front import decoder_for
from treegraft.decoding.tree_decoder import METHOD_PRESETS, auto_shape
from treegraft.engines.logprobs import TokenLogProbs, argmax_scores, scores, topk
from treegraft.drafters.vocab import SubsetHead, VocabSubset, frequent_tokens
from treegraft.models import PairSpec, build_tiny_tokenizer, load_pair
from treegraft.tree import SMALL, DraftTree, prune_order, prune_to_budget
from .conftest import ar_decoder, tree_decoder

# a repetitive prompt (whole chains accepted) and code; the session's cache (TREEGRAFT_CACHE) holds the
# frequent tokens and verification curves every test here shares
PROMPTS = ["abab abab abab ab", "def f(x):\n    return x + 1\n\ndef g(x):\n    return"]
# on SmolLM2, one method per tree builder (chains, middle-only, shared tree with grafting, CSD); every
# preset runs on the tiny pair above
SMOLLM2_METHODS = ["all_small", "all_mid", "fixed", "csd"]
TREE = {"budget": "auto", "shape": "auto", "draft_vocab": 64, "ngram": {"prefill_vocab": 32}}


@pytest.fixture(scope="module", params=[("float32_packed", "same"), ("int4", "same"), ("bfloat16_packed", "int8")],
                ids=lambda p: "+".join(p))
def tiny_runtime_pair(request):
    """The tiny pair on a target runtime and a middle-drafter runtime (``bfloat16_packed`` + ``int8``: the
    AVX-512 kernels, skipped where they do not run)."""
    from treegraft.models.runtime import runtime_unavailable

    runtime, middle_runtime = request.param
    reason = runtime_unavailable(runtime) or (middle_runtime != "same" and runtime_unavailable(middle_runtime))
    if reason:
        pytest.skip(reason)
    return load_pair(PairSpec(name="tiny-random", target="tiny-random:0", middle="tiny-random:1"),
                     runtime=runtime, middle_runtime=middle_runtime)


def test_every_method_equals_ar_of_the_same_runtime_on_the_tiny_pair(tiny_runtime_pair):
    pair = tiny_runtime_pair
    tok = pair.tokenizer
    for text in PROMPTS:
        ids = tok(text).input_ids
        ref = decoder_for("ar", pair).generate(ids, 24).tokens
        for method in METHOD_PRESETS:
            dec = decoder_for(method, pair, TREE)
            result = dec.generate(ids, 24)
            assert result.tokens == ref, (pair.runtime, pair.middle_runtime, method, text)
            assert all(t["verified_nodes"] <= t["budget"] <= 63 for t in result.turns)


@pytest.mark.slow  # `make test-all`: CI runs every method on the tiny pair's packed runtimes and SmolLM2's packed logits
@pytest.mark.embedded
@pytest.mark.parametrize("runtime", ["float32_packed"])  # int4: the tiny pair above, and its logits on SmolLM2 in test_runtime
def test_every_method_equals_ar_of_the_same_runtime_on_smollm2(runtime):
    from omegaconf import OmegaConf
    from hydra.utils import instantiate

    from treegraft.config import CONF_DIR
    from treegraft.data import BenchmarkConfig, format_prompt, load_benchmark

    from .conftest import require_embedded

    require_embedded("smollm2-135m")
    pair = load_pair(instantiate(OmegaConf.load(CONF_DIR / "pair" / "smollm2-135m__self.yaml")), runtime=runtime)
    tok = pair.tokenizer
    tree = {**TREE, "draft_vocab": 4096, "ngram": {"prefill_vocab": 2048}}
    for bench in {"float32_packed": ("humaneval",), "int4": ("gsm8k",)}[runtime]:  # code and prose
        record = load_benchmark(BenchmarkConfig(name=bench, num_prompts=1))[0]
        ids = tok(format_prompt(tok, record["turns"][0]), add_special_tokens=False).input_ids[:96]
        ref = decoder_for("ar", pair).generate(ids, 14).tokens
        for method in SMOLLM2_METHODS:
            out = decoder_for(method, pair, tree).generate(ids, 14).tokens
            assert out == ref, (runtime, method, bench)


def test_restricted_vocab_and_shapes_stay_lossless_under_sampling_rules(tiny_pair, tmp_path):
    """Sampling: the same seed, a restricted draft vocabulary and shape=auto only change the drafts;
    every emitted token stays inside the target's support (the distribution test lives in test_tree_decoder)."""
    tok = tiny_pair.tokenizer
    ids = tok("abab abab").input_ids
    cfg = TreeConfig.paper(method="all_mid", budget=12, shape="auto", draft_vocab=40)
    out = tree_decoder(tiny_pair.target, tiny_pair.middle, tok, cfg, SamplingConfig(temperature=0.8, seed=1),
                           eos_ids=set(), cache_dir=tmp_path).generate(ids, 20)
    assert len(out.tokens) == 20


def test_all_small_has_no_middle_drafter_and_the_middle_prefill_is_lazy(tiny_pair, tmp_path):
    tok = tiny_pair.tokenizer
    ids = tok("hello world hello").input_ids
    small = decoder_for("all_small", tiny_pair, {"budget": 4}, cache_dir=tmp_path)
    assert small.middle is None
    mid = tree_decoder(tiny_pair.target, tiny_pair.middle, tok, TreeConfig.paper(method="fixed", schedule=[0, 0, 0, 0, 0],
                                                                            budget=4), eos_ids=set())
    mid.generate(ids, 3)
    assert mid.middle.calls == 0 and mid.middle.pending  # never called: the prompt was never encoded
    eager = tree_decoder(tiny_pair.target, tiny_pair.middle, tok, TreeConfig.paper(method="fixed", schedule=[0] * 5,
                                                                              budget=4), eos_ids=set(),
                             eager_middle_prefill=True)
    eager.generate(ids, 3)
    assert eager.middle.committed >= len(ids) - 1


def test_auto_shape_rule():
    assert auto_shape(0) == (2, 2, 2)
    assert auto_shape(1) == (2, 2, 4)
    assert auto_shape(8) == (4, 4, 20)
    assert auto_shape(31) == (7, 7, 69)
    assert auto_shape(63) == (9, 9, 135)
    assert auto_shape(63, max_width=4, max_top_m=6) == (4, 6, 135)
    widths = [auto_shape(b)[0] for b in range(64)]
    assert widths == sorted(widths)  # grows with B_ver, never with W * m * D


def test_shape_auto_builds_trees_that_grow_with_the_budget(tiny_pair, tmp_path):
    tok = tiny_pair.tokenizer
    ids = tok("abab abab abab ab").input_ids
    sizes = {}
    for budget in (2, 30):
        cfg = TreeConfig.paper(method="all_call", budget=budget, shape="auto")
        res = tree_decoder(tiny_pair.target, tiny_pair.middle, tok, cfg, eos_ids=set()).generate(ids, 12)
        sizes[budget] = max(t["tree_nodes"] for t in res.turns)
    paper = tree_decoder(tiny_pair.target, tiny_pair.middle, tok, TreeConfig.paper(method="all_call", budget=30),
                             eos_ids=set()).generate(ids, 12)
    assert sizes[2] < sizes[30] <= max(t["tree_nodes"] for t in paper.turns)


def _chain_tree() -> DraftTree:
    """root -> a(-0.1) -> b(-0.2) -> c(-0.3); root -> x(-1.0); a -> y(-2.0)."""
    tree = DraftTree.with_root(0)
    a = tree.add_child(0, 1, -0.1, SMALL, 1)
    x = tree.add_child(0, 2, -1.0, SMALL, 1)
    b = tree.add_child(a, 3, -0.2, SMALL, 2)
    tree.add_child(a, 4, -2.0, SMALL, 2)
    tree.add_child(b, 5, -0.3, SMALL, 3)
    assert x == 2
    return tree


def test_prune_order_is_what_each_budget_keeps():
    tree = _chain_tree()
    order = prune_order(tree)
    assert order == [1, 3, 5, 2, 4]  # a, b, c (cum -0.1, -0.3, -0.6), then x (-1.0), then y (-2.1)
    for budget in range(len(order) + 1):
        assert prune_to_budget(tree, budget) == sorted(order[:budget])


def test_acceptance_model_learns_from_verified_and_known_nodes():
    tree = _chain_tree()  # cum: a -0.1, x -1.0, b -0.3, y -2.1, c -0.6
    model = AcceptanceModel(prior_weight=0.0)
    bin_of = model.bin_of
    assert [bin_of(c) for c in (0.0, -0.1, -0.3, -0.6, -1.0, -2.1, -20.0, -float("inf"))] == [0, 1, 2, 3, 5, 7, 11, 12]
    # target path: a, b, then bonus token 9 (c rejected); only a, b verified (budget 2)
    model.update(tree, prune_order(tree), kept={1, 3}, accepted=[1, 3], emitted=[1, 3, 9], greedy=True)
    assert (model.hits[1], model.seen[1]) == (1.0, 1.0)  # a, verified and accepted
    assert (model.hits[2], model.seen[2]) == (1.0, 1.0)  # b
    assert (model.hits[3], model.seen[3]) == (0.0, 1.0)  # c: a known miss (its depth is within the emitted tokens)
    assert (model.hits[5], model.seen[5]) == (0.0, 1.0)  # x: a known miss at depth 1
    # a node extending the emitted path beyond the bonus counts with the continuation rate
    model.update(tree, prune_order(tree), kept={1}, accepted=[1], emitted=[1, 3], greedy=True)
    assert 0 < model.hits[3] < 1 and model.seen[3] == 2.0  # c = (1, 3, 5) extends (1, 3): unknown, fractional
    sampled = AcceptanceModel(prior_weight=0.0)
    sampled.update(tree, prune_order(tree), kept={1}, accepted=[1], emitted=[1, 7], greedy=False)
    assert sum(sampled.seen) == 1.0  # unverified nodes teach nothing under sampling
    table = model.table()
    assert all(a >= b for a, b in zip(table, table[1:]))  # a lower score is never more likely accepted


def _chain(depth: int, edge: float) -> DraftTree:
    tree = DraftTree.with_root(0)
    node = 0
    for i in range(depth):
        node = tree.add_child(node, 10 + i, edge, SMALL, 1)
    return tree


def test_a_one_off_drafting_cost_does_not_make_rows_look_cheap():
    """A turn that carries a one-off (the middle drafter catching up on a 612-token prompt: 15 s on a Zen 1
    EPYC) leaves t_draft at the recent turns' median: with a running mean the next ~20 turns verified
    20-node trees on a curve where every row costs most of a step, 3x slower than plain decoding."""
    linear = {n: 0.11 + 0.075 * (n - 1) for n in (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)}
    tree = DraftTree.with_root(0)
    for i in range(30):  # a chain the calibration half believes
        tree.add_child(i, 10 + i, -0.02 if i == 0 else -0.7, SMALL, 1)
    planner = BudgetPlanner(linear, 63)
    for other in [0.01] * 6 + [15.0]:
        planner.observe(0, verify_s=0.11, other_s=other)
    assert planner.draft_s == 0.01
    assert planner.choose(tree) <= 1
    spiked = BudgetPlanner(linear, 63, draft_s=15.0 * 0.9 ** 6)  # where a running mean would stand 6 turns on
    assert spiked.choose(tree) >= planner.choose(tree) + 4  # rows a step's worth each, for a sunk cost


def test_budget_planner_follows_curve_and_acceptance():
    flat = {1: 1.0, 2: 1.005, 4: 1.01, 8: 1.02, 16: 1.03, 32: 1.05, 64: 1.1}
    steep = {n: float(n) for n in (1, 2, 4, 8, 16, 32, 64)}  # every verified row costs a whole step
    confident = _chain(40, -0.01)  # a long chain the calibration believes (prior exp(cum) ~ 1)
    assert BudgetPlanner(flat, 63, draft_s=0.1).choose(confident) == 40  # nearly free rows: verify the chain whole
    assert BudgetPlanner(steep, 63, draft_s=0.0).choose(confident) == 0  # no draft can pay for its row
    hopeless = _chain(40, -6.0)
    assert BudgetPlanner(flat, 63, draft_s=0.1).choose(hopeless) == 0  # drafts never accepted: plain decoding
    learned = AcceptanceModel(prior_weight=0.0)
    learned.hits = [0.0] * len(learned.hits)
    learned.seen = [1.0] * len(learned.seen)  # every bin observed, never accepted
    assert BudgetPlanner(flat, 63, learned, draft_s=0.1).choose(confident) == 0  # the data overrules the scores
    planner = BudgetPlanner(steep, 63)
    planner.observe(1, verify_s=4.0, other_s=0.5)  # verification twice as slow as the curve says
    assert planner.verify_scale > 1.0 and planner.draft_s == 0.5
    assert planner.planned == pytest.approx(0.9 * 8.0 + 0.1 * 1)  # a running mean of the chosen B
    assert planner.planning_budget() == 11  # ceil(1.5 x 7.3)
    for _ in range(100):
        planner.observe(0, verify_s=1.0, other_s=0.5)
    assert planner.planning_budget() == 4  # the floor: a construction always plans some tree
    capped = BudgetPlanner(steep, 20)
    for _ in range(100):
        capped.observe(63, verify_s=64.0, other_s=0.5)
    assert capped.planning_budget() == 20  # never past the largest budget considered


def test_budget_auto_plans_every_turn(tiny_pair, tmp_path):
    tok = tiny_pair.tokenizer
    ids = tok("abab abab abab ab").input_ids
    dec = tree_decoder(tiny_pair.target, tiny_pair.target, tok, TreeConfig.paper(method="all_mid", budget="auto"),
                           eos_ids=set(), cache_dir=tmp_path)
    res = dec.generate(ids, 40)
    assert (tmp_path / "verify_curves.json").is_file()
    assert all(0 <= t["budget"] <= 63 for t in res.turns)
    # the same model as middle drafter: chains are accepted whole, and the planner learns it
    assert max(t["budget"] for t in res.turns) >= 3 and dec.planner.acceptance.p(-0.05) > 0.5
    assert res.tokens == ar_decoder(tiny_pair.target, set()).generate(ids, 40).tokens


def test_vocab_subset_and_head_equal_a_restricted_softmax():
    torch.manual_seed(0)
    weight = torch.randn(50, 8)
    subset = VocabSubset(torch.tensor([5, 1, 7]), 50)
    head = SubsetHead(weight, subset)
    head.add([7, 30, 1, 31])  # only 30 and 31 are new
    assert subset.ids.tolist() == [5, 1, 7, 30, 31] and int(subset.pos_of[30]) == 3 and int(subset.pos_of[2]) == -1
    h = torch.randn(2, 8)
    full = h @ weight.T
    torch.testing.assert_close(head.log_softmax(h), torch.log_softmax(full[:, subset.ids], -1))
    logp = head.log_softmax(h)
    lp = TokenLogProbs(logp, 0, subset.ids, subset.pos_of)
    values, tokens = lp.topk(2)
    assert tokens[0] == lp.argmax() and values[0] == pytest.approx(lp.score(tokens[0]))
    assert lp.score(2) == pytest.approx(float(logp[0].min()))  # outside the subset: the floor
    # the batched readers answer for rows of several matrices at once, in the items' order
    other = TokenLogProbs(logp, 1, subset.ids, subset.pos_of)
    alone = TokenLogProbs(torch.log_softmax(full, -1)[1])  # a full-vocabulary row of another matrix
    assert scores([(other, 30), (alone, 30), (lp, 2)]) == pytest.approx(
        [float(logp[1, 3]), float(torch.log_softmax(full, -1)[1, 30]), float(logp[0].min())])
    best = topk([alone, other], 3)
    assert best[0][1] == torch.log_softmax(full, -1)[1].topk(3).indices.tolist()
    assert best[1][1] == subset.ids[logp[1].topk(3).indices].tolist()
    assert argmax_scores([other, alone]) == [(best[1][1][0], pytest.approx(best[1][0][0])),
                                             (best[0][1][0], pytest.approx(best[0][0][0]))]
    subset.truncate(3)  # back to the base: 30 and 31 leave the set, host and device alike
    assert subset.id_list == [5, 1, 7] and int(subset.pos_of[30]) == -1 and 30 not in subset.position


def test_frequent_tokens_are_deterministic_and_cached(tmp_path):
    tok = build_tiny_tokenizer()
    first = frequent_tokens(tok, 40, 259, tmp_path)
    assert len(first) == 40 and len(set(first.tolist())) == 40
    assert list(tmp_path.glob("draft_vocab_*.pt"))
    assert torch.equal(frequent_tokens(tok, 40, 259, tmp_path), first)
    assert int(tok(" ").input_ids[-1]) in first.tolist()  # the space byte is among the most frequent
