"""The tree speculative decoder is lossless: greedy equality with `ar`, the sampling
distribution, and KV caches that equal a fresh forward over the emitted text."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from treegraft.data import BENCHMARKS, BenchmarkConfig, format_prompt, load_benchmark
from treegraft.decoding import SamplingConfig, TreeConfig
from treegraft.decoding import verify as verify_module
from treegraft.decoding.sampling import target_distribution
from treegraft.decoding.verify import Acceptance
from treegraft.model_io import forward_hidden, new_cache
from treegraft.models import build_tiny_model
from .conftest import ar_decoder, tree_decoder

PROMPTS = ["hello world", "def f(x):\n    return x + 1\n\ndef g(x):\n    return", "abab abab abab ab", "1 2 3 4"]


def ar_tokens(model, prompt_ids, n, eos=frozenset({2})):
    return ar_decoder(model, set(eos)).generate(prompt_ids, n).tokens


@pytest.mark.parametrize("method", ["all_small", "all_mid"])
@pytest.mark.parametrize("middle_kind", ["same", "random"])
@pytest.mark.parametrize("budget", [0, 7, 63])
def test_greedy_equals_ar_on_tiny_pair(tiny_pair, method, middle_kind, budget):
    tok, target = tiny_pair.tokenizer, tiny_pair.target
    middle = target if middle_kind == "same" else tiny_pair.middle
    for text in PROMPTS:
        ids = tok(text).input_ids
        result = tree_decoder(target, middle, tok, TreeConfig.paper(method=method, budget=budget)).generate(ids, 48)
        assert result.tokens == ar_tokens(target, ids, 48), text
        assert all(t["verified_nodes"] <= budget for t in result.turns)
        if budget == 0:
            assert all(t["accepted"] == 0 for t in result.turns)


def test_a_prompt_without_scores_drafts_from_the_output_alone_and_stays_exact(tiny_pair):
    """``ngram.prefill_scores=false``: the prompt's rows are encoded without an LM head, the n-gram drafter
    has no target scores at prompt positions (it still indexes the prompt), and the output is ``ar``'s."""
    from treegraft.drafters import NGramConfig

    tok, target = tiny_pair.tokenizer, tiny_pair.target
    cfg = TreeConfig(method="all_small", ngram=NGramConfig(prefill_scores=False))
    for text in PROMPTS:
        ids = tok(text).input_ids
        dec = tree_decoder(target, target, tok, cfg)
        assert dec.engine.prefill(ids, 0, None) == ([[] for _ in ids[:-1]], [[] for _ in ids[:-1]])
        result = dec.generate(ids, 48)
        assert result.tokens == ar_tokens(target, ids, 48), text
        assert all(dec.ngram.scores[p] is None for p in range(len(ids) - 1))  # nothing cached at the prompt
        assert len(dec.ngram.tokens) > len(ids)  # ... which is indexed, and the output after it


@pytest.mark.parametrize("method,budget", [("all_small", "auto"), ("all_small", 3), ("fixed", "auto")])
def test_chain_mode_is_one_chain_a_turn_and_stays_exact(tiny_pair, method, budget):
    """``ngram.mode=chain``: every turn's n-gram draft is one path (under the root, or under the best node of a
    middle step before it), at most ``chain_len`` deep, and the output is ``ar``'s."""
    from treegraft.drafters import NGramConfig
    from treegraft.tree import SMALL

    tok, target, middle = tiny_pair.tokenizer, tiny_pair.target, tiny_pair.middle
    cfg = TreeConfig(method=method, budget=budget, ngram=NGramConfig(mode="chain", chain_len=5))
    drafted = 0
    for text in PROMPTS:
        ids = tok(text).input_ids
        dec = tree_decoder(target, middle, tok, cfg)
        trees = []
        build = dec.builder.build
        dec.builder.build = lambda *a, **k: trees.append(build(*a, **k)) or trees[-1]
        assert dec.generate(ids, 48).tokens == ar_tokens(target, ids, 48), text
        for tree in trees:
            small = [n for n in range(1, len(tree)) if tree.creator[n] == SMALL]
            drafted += len(small)
            assert len(small) <= 5
            assert all(tree.parent[b] == a for a, b in zip(small, small[1:]))  # one path, in creation order
            if small and method == "all_small":
                assert tree.parent[small[0]] == 0 and len(tree) == len(small) + 1
    assert drafted > 20  # the prompts repeat: chains were drafted


@pytest.mark.parametrize("method,mode,cached", [("all_small", "chain", False), ("all_small", "tree", True),
                                                ("csd", "chain", True)])
def test_target_scores_are_cached_only_where_drafts_read_them(tiny_pair, method, mode, cached):
    """Chain mode's chain never reads the target's top-m, so a turn computes none (generated positions stay
    unscored); the tree steps and ``csd``'s cascade (n-gram proposals ranked by them, in either mode) get it at
    every verified position. Either way the scheduler's ``recent_target_conf`` is the running mean of the
    target's top-1 probability at each turn's accepted rows."""
    from treegraft.drafters import NGramConfig

    tok, target, middle = tiny_pair.tokenizer, tiny_pair.target, tiny_pair.middle
    ids = tok(PROMPTS[0]).input_ids
    dec = tree_decoder(target, middle, tok, TreeConfig(method=method, ngram=NGramConfig(mode=mode)))
    rows = []
    verify = dec.verify_tree

    def recording(*a, **k):
        inputs, acc = verify(*a, **k)
        rows.append([r.float().clone() for r in acc.logits])
        return inputs, acc

    dec.verify_tree = recording
    start = dec._prefill

    def prefill(prompt):
        start(prompt)
        rows.append(dec.turn_signals["recent_target_conf"])

    dec._prefill = prefill
    assert dec.generate(ids, 32).tokens == ar_tokens(target, ids, 32)
    # the first turn's root sits at the prompt's last position; the last emitted token was never a verified row
    generated = dec.ngram.scores[len(ids) - 1:-1]
    assert dec._reads_ngram_scores == cached and len(generated) >= 31
    assert all((s is not None) == cached for s in generated)
    conf = rows[0]
    for turn in rows[1:]:
        conf = 0.5 * conf + 0.5 * sum(float(torch.softmax(r, -1).max()) for r in turn) / len(turn)
    assert len(rows) > 2 and dec.turn_signals["recent_target_conf"] == pytest.approx(conf, rel=1e-5)


def test_same_model_middle_accepts_whole_chains(tiny_pair):
    tok, target = tiny_pair.tokenizer, tiny_pair.target
    ids = tok(PROMPTS[0]).input_ids
    cfg = TreeConfig.paper(method="all_mid", budget=600, node_cap=2000)
    result = tree_decoder(target, target, tok, cfg).generate(ids, 60)
    assert result.tokens == ar_tokens(target, ids, 60)
    accepted = [t["accepted"] for t in result.turns]
    assert sum(a == cfg.depth for a in accepted) >= len(accepted) - 1  # the last turn may be cut short


def test_stops_at_eos_and_never_past_max_new_tokens(tiny_pair):
    tok, target = tiny_pair.tokenizer, tiny_pair.target
    ids = tok("stop here").input_ids
    free = ar_tokens(target, ids, 30, eos=())
    stop_id = free[7]
    for method in ("all_small", "all_mid"):
        dec = tree_decoder(target, target, tok, TreeConfig.paper(method=method), eos_ids={stop_id})
        out = dec.generate(ids, 30)
        assert out.tokens == free[: free.index(stop_id) + 1] and out.stop_reason == "eos"
        for n in (1, 5, 13):
            dec = tree_decoder(target, target, tok, TreeConfig.paper(method=method), eos_ids=set())
            assert dec.generate(ids, n).tokens == free[:n]


def test_kv_caches_equal_a_fresh_forward_after_many_turns(tiny_pair):
    tok, target, middle = tiny_pair.tokenizer, tiny_pair.target, tiny_pair.middle
    ids = tok(PROMPTS[1]).input_ids
    dec = tree_decoder(target, middle, tok, TreeConfig.paper(method="all_mid", budget=20), eos_ids=set())
    final = {}  # the caches as the last turn left them (generate releases them when it returns)
    out = dec.generate(ids, 40, on_tokens=lambda _: final.update(target=dec.engine.cache, middle=dec.middle.cache,
                                                                 committed=dec.middle.committed,
                                                                 pending=len(dec.middle.pending)))
    assert len(out.turns) > 5
    assert dec.engine.cache is None and dec.middle.cache is None  # released after generate
    context = ids + out.tokens[:-1]  # everything emitted except the last token (the next root)
    for model, cache, tokens in [
        (target, final["target"], context),
        (middle, final["middle"], context[: final["committed"]]),
    ]:
        fresh = new_cache()
        with torch.no_grad():
            forward_hidden(model, fresh, torch.tensor(tokens), torch.arange(len(tokens)), None)
        assert cache.get_seq_length() == len(tokens)
        for got, want in zip(cache.layers, fresh.layers):
            torch.testing.assert_close(got.keys, want.keys, atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(got.values, want.values, atol=1e-5, rtol=1e-4)
    # the middle drafter never holds a rejected token: its committed context is a prefix of the text
    assert final["committed"] + final["pending"] == len(context)


# ---------------------------------------------------------------- sampling
def first_token_samples(target, middle, prompt_ids, n, temperature=1.0):
    samples = []
    for seed in range(n):
        dec = tree_decoder(
            target, middle, None, TreeConfig.paper(method="all_mid", depth=1, top_m=6),  # the first token only needs depth 1
            sampling=SamplingConfig(temperature=temperature, seed=seed), eos_ids=set(),
        )
        samples.append(dec.generate(prompt_ids, 1).tokens[0])
    return samples


def chi_square_pvalue(samples, probs):
    n = len(samples)
    counts = torch.bincount(torch.tensor(samples), minlength=probs.numel()).double()
    expected = probs.double() * n
    big = expected >= 5  # pool the rare tokens into one bin so every expected count is >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    exp = exp * (obs.sum() / exp.sum())  # float32 probabilities do not sum to exactly 1
    return chisquare(obs.numpy(), exp.numpy()).pvalue


@pytest.fixture(scope="module")
def sampling_setup():
    target = build_tiny_model(0)
    prompt_ids = [70, 71, 72, 73]
    with torch.no_grad():
        logits = target(torch.tensor([prompt_ids])).logits[0, -1]
    return target, prompt_ids, target_distribution(logits, SamplingConfig(temperature=1.0))


N_SAMPLES = 1500


def test_speculative_sampling_keeps_the_target_distribution(sampling_setup):
    target, prompt_ids, probs = sampling_setup
    # the target itself as middle drafter: the tree holds exactly the most likely tokens, the
    # hardest case for a broken rule to hide
    samples = first_token_samples(target, target, prompt_ids, N_SAMPLES)
    assert chi_square_pvalue(samples, probs) > 1e-3


def test_the_chi_square_test_catches_a_broken_rule(sampling_setup, monkeypatch):
    target, prompt_ids, probs = sampling_setup

    def broken(inputs, row_logits, child_order, cfg, generator):
        # a classic bug: after rejecting the children, draw the bonus from p instead of the residual
        lg = row_logits(0)
        p = target_distribution(lg, cfg)
        for child in child_order(0):
            token = int(inputs.tokens[child])
            if float(torch.rand((), generator=generator)) < float(p[token]):
                return Acceptance(rows=[0, child], bonus=0, logits=[lg, lg])
        return Acceptance(rows=[0], bonus=int(torch.multinomial(p, 1, generator=generator)), logits=[lg])

    monkeypatch.setattr(verify_module, "accept_sampling", broken)
    samples = first_token_samples(target, target, prompt_ids, N_SAMPLES)
    assert chi_square_pvalue(samples, probs) < 1e-6


def test_sampling_with_top_p_stays_in_the_nucleus(tiny_pair):
    tok, target = tiny_pair.tokenizer, tiny_pair.target
    ids = tok("nucleus").input_ids
    cfg = SamplingConfig(temperature=0.9, top_p=0.5, seed=4)
    dec = tree_decoder(target, target, tok, TreeConfig.paper(method="all_mid"), sampling=cfg, eos_ids=set())
    out = dec.generate(ids, 20).tokens
    context = list(ids)
    with torch.no_grad():
        for token in out:
            probs = target_distribution(target(torch.tensor([context])).logits[0, -1], cfg)
            assert probs[token] > 0  # every emitted token is inside the top-p nucleus of its position
            context.append(token)


# ---------------------------------------------------------------- real models
# CI (`make test`) runs a code and a prose benchmark; `make test-all` every benchmark
SMOLLM2_CI_BENCHMARKS = ("humaneval", "alpaca")


@pytest.mark.embedded
@pytest.mark.parametrize("benchmark", [b if b in SMOLLM2_CI_BENCHMARKS else pytest.param(b, marks=pytest.mark.slow)
                                       for b in BENCHMARKS])
def test_greedy_equals_ar_on_smollm2_self_pair(smollm2_self_pair, benchmark):
    pair = smollm2_self_pair
    tok = pair.tokenizer
    record = load_benchmark(BenchmarkConfig(name=benchmark, num_prompts=1))[0]
    ids = tok(format_prompt(tok, record["turns"][0]), add_special_tokens=False).input_ids[:80]
    eos = {tok.eos_token_id}
    ref = ar_decoder(pair.target, eos).generate(ids, 16).tokens
    for method in ("all_small", "all_mid"):
        dec = tree_decoder(pair.target, pair.middle, tok, TreeConfig.paper(method=method, budget=15), eos_ids=eos)
        assert dec.generate(ids, 16).tokens == ref, method
