"""A neural small drafter (the paper's Table 9 / Appendix D): lossless under every method that has a
small step, its own KV cache consistent across turns, a self-draft that shares the middle drafter's
weights, its cost in the small drafter's time split, and one-line errors for bad settings."""

from __future__ import annotations

import pytest
import torch

from treegraft.decoding import AutoregressiveDecoder, SamplingConfig, TreeConfig
from treegraft.front import decoder_for
from treegraft.decoding.methods import method_small, parse_method, small_settings
from treegraft.engines.torch import MiddleDrafter
from treegraft.drafters.small import SmallDrafterConfig, small_config
from treegraft.model_io import forward_hidden, new_cache
from treegraft.scheduling import FixedScheduler
from treegraft.decoding.turn_stats import TurnStats
from treegraft.tree import SMALL, DraftTree

from .conftest import compose
from .test_tree_decoder import chi_square_pvalue, sampling_setup  # noqa: F401  (a fixture)
from .conftest import ar_decoder, tree_decoder
from treegraft.engines.torch import TorchEngines

PROMPTS = ["abcabc abcabc abcabc abc", "def f(x):\n    return x + 1\n", "1 2 3 4"]
SELF_DRAFT_1 = {"name": "self_draft", "layers": 1}  # the tiny middle drafter has 2 layers


def ar_tokens(model, ids, n, eos=frozenset({2})):
    return ar_decoder(model, set(eos)).generate(ids, n).tokens


def one_line_error(excinfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message and message
    return message


# ---------------------------------------------------------------- lossless
@pytest.mark.parametrize("method", ["fixed", "all_small", "all_call", "no_nondestructive", "csd"])
def test_greedy_equals_ar_with_a_self_draft_small_drafter(tiny_pair, method):
    tok, target, middle = tiny_pair.tokenizer, tiny_pair.target, tiny_pair.middle
    for text in PROMPTS:
        ids = tok(text).input_ids
        dec = tree_decoder(target, middle, tok, TreeConfig.paper(method=method, budget=12, width=4, top_m=4),
                               small=SELF_DRAFT_1)
        out = dec.generate(ids, 16)
        assert out.tokens == ar_tokens(target, ids, 16), (method, text)
        if method != "all_call":  # every step of all_call is the middle drafter's
            assert sum(t["small_calls"] for t in out.turns) > 0


@pytest.mark.parametrize("method", ["fixed", "all_small", "csd"])
def test_a_small_drafter_that_is_the_target_gets_its_tokens_accepted(tiny_pair, method):
    """The target's own two layers as the small drafter (a self-draft of middle = target): greedy output
    still equals ar, and the small steps' tokens are accepted (the accept path, not only rejections)."""
    tok, target = tiny_pair.tokenizer, tiny_pair.target
    ids = tok(PROMPTS[1]).input_ids
    dec = tree_decoder(target, target, tok, TreeConfig.paper(method=method, schedule=[0, 0, 1, 0, 0], budget=12,
                                                                width=3, top_m=3),
                           small={"name": "self_draft", "layers": 2}, eos_ids=set())
    out = dec.generate(ids, 24)
    assert out.tokens == ar_tokens(target, ids, 24, eos=())
    accepted = [t["accepted"] for t in out.turns]
    assert sum(a >= 2 for a in accepted) >= len(accepted) - 1  # the last turn may be cut short


def test_greedy_equals_ar_with_a_loaded_small_model_and_a_learned_style_scheduler(tiny_pair):
    """``name: model`` loads another model of the tokenizer (here the target's own weights, tiny-random:0);
    a scheduler that reads the tree signals keeps the n-gram index up, one that does not leaves it idle."""
    tok, target, middle = tiny_pair.tokenizer, tiny_pair.target, tiny_pair.middle
    small = {"name": "model", "model": "tiny-random:0"}

    class Alternate(FixedScheduler):
        needs_signals = True

        def decide(self, state):
            assert state.signals is not None
            return state.step % 2

    ids = tok(PROMPTS[0]).input_ids
    for scheduler in (Alternate([1] * 5), FixedScheduler([0, 1, 0, 1, 0])):
        dec = decoder_for("treegraft", TorchEngines(target, middle, tok), {"budget": 12, "width": 3, "top_m": 3},
                          scheduler=scheduler, small=small, eos_ids={2})
        out = dec.generate(ids, 16)
        assert out.tokens == ar_tokens(target, ids, 16)
        assert sum(t["accepted"] for t in out.turns) > 0  # the target's own proposals
        assert (len(dec.ngram.tokens) > 0) == scheduler.needs_signals


def test_sampling_keeps_the_target_distribution_with_a_neural_small_drafter(sampling_setup):  # noqa: F811
    """The tiny target's whole depth as the small drafter (its own top-m: the hardest case for a broken
    rule to hide), all_small, the first token sampled 1500 times."""
    target, prompt_ids, probs = sampling_setup
    dec = tree_decoder(target, target, None, TreeConfig.paper(method="all_small", depth=1, top_m=6), eos_ids=set(),
                           small={"name": "self_draft", "layers": 2})
    samples = []
    for seed in range(1500):  # one decoder, a fresh generator per sample (generate starts every state anew)
        dec.sampling = SamplingConfig(temperature=1.0, seed=seed)
        samples.append(dec.generate(prompt_ids, 1).tokens[0])
    assert dec.small.tokens_encoded > 0
    assert chi_square_pvalue(samples, probs) > 1e-3


# ---------------------------------------------------------------- the drafter itself
def test_the_self_draft_shares_the_middle_drafters_weights(tiny_pair):
    middle = tiny_pair.middle
    dec = tree_decoder(tiny_pair.target, middle, tiny_pair.tokenizer, TreeConfig.paper(method="fixed"),
                           small=SELF_DRAFT_1)
    small_model = dec.small.model
    assert small_model is not middle and len(small_model.base_model.layers) == 1
    middle_ptrs = {p.data_ptr() for p in middle.parameters()}
    assert all(p.data_ptr() in middle_ptrs for p in small_model.parameters())  # no copy
    assert small_model.base_model.layers[0].self_attn.q_proj.weight.data_ptr() == \
        middle.base_model.layers[0].self_attn.q_proj.weight.data_ptr()
    assert dec.small is not dec.middle and dec.small.cache is None  # an engine (and KV cache) of its own


def test_the_small_drafters_cache_stays_consistent_across_turns(tiny_pair):
    """After several turns the small drafter proposes what a fresh drafter fed the same context does, and its
    cache holds exactly a fresh forward over its committed context (nothing rejected left in it). The
    target is the middle drafter and its whole depth the small drafter, so turns accept both drafters'
    tokens: slots the small drafter encoded are kept, the middle drafter's are queued for its next call."""
    tok, target = tiny_pair.tokenizer, tiny_pair.target
    ids = tok(PROMPTS[1]).input_ids
    dec = tree_decoder(target, target, tok, TreeConfig.paper(method="fixed", budget=12, width=3, top_m=3),
                           small={"name": "self_draft", "layers": 2}, eos_ids=set())
    emitted: list[int] = []
    checked = []
    commits = []  # per turn: accepted path nodes (root included) in the small drafter's cache, and the others
    commit = dec.small.commit

    drafted_context = ids[:-1]  # what the small drafter's context must be: the prompt, then every turn's path

    def spy(path_nodes, path_tokens):
        encoded = sum(n in dec.small.slot_of for n in path_nodes)
        commits.append((encoded, len(path_nodes) - encoded))
        drafted_context.extend(path_tokens)
        commit(path_nodes, path_tokens)

    dec.small.commit = spy

    def compare(turn: int, root: int) -> None:
        if turn < 3:
            return
        context = ids + emitted  # ends with the root
        assert context[-1] == root
        live = dec.small
        snap = live.snapshot()
        live.start_turn()
        tree = DraftTree.with_root(root)
        child = tree.add_child(0, 100 + turn, -1.0, SMALL, 1)
        live.encode(tree, [0, child])
        got = [live.logprobs[n].logp.clone() for n in (0, child)]
        live.restore(snap)
        fresh = MiddleDrafter(live.model)
        fresh.reset(context)
        fresh.encode(tree, [0, child])
        for n, lp in zip((0, child), got):
            torch.testing.assert_close(lp, fresh.logprobs[n].logp, atol=1e-5, rtol=1e-4)
            assert lp.topk(3).indices.tolist() == fresh.logprobs[n].logp.topk(3).indices.tolist()
        checked.append(turn)

    final = {}
    dec.generate(ids, 30, before_turn=compare,
                 on_tokens=lambda new: (emitted.extend(new),
                                        final.update(cache=dec.small.cache, committed=dec.small.committed,
                                                     pending=len(dec.small.pending))))
    assert len(checked) >= 3, "the comparison should have run on several turns"
    assert any(encoded > 1 for encoded, _ in commits)  # accepted nodes the small drafter had encoded: slots kept
    assert any(queued for _, queued in commits)  # accepted nodes it had not: queued for its next call
    shared = min(len(emitted), len(drafted_context) - len(ids))  # the text may be cut at max_new_tokens
    assert shared > 20 and drafted_context[: len(ids) + shared] == ids + emitted[:shared]
    assert final["committed"] + final["pending"] == len(drafted_context)  # never a rejected token
    context = drafted_context[: final["committed"]]
    fresh = new_cache()
    with torch.no_grad():
        forward_hidden(dec.small.model, fresh, torch.tensor(context), torch.arange(len(context)), None)
    assert final["cache"].get_seq_length() == len(context)
    for got, want in zip(final["cache"].layers, fresh.layers):
        torch.testing.assert_close(got.keys, want.keys, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(got.values, want.values, atol=1e-5, rtol=1e-4)


def test_the_small_drafters_cost_is_in_the_small_time_split(tiny_pair):
    tok, target, middle = tiny_pair.tokenizer, tiny_pair.target, tiny_pair.middle
    ids = tok(PROMPTS[0]).input_ids
    runs = {}
    for name, small in (("ngram", None), ("self_draft", SELF_DRAFT_1)):
        dec = tree_decoder(target, middle, tok, TreeConfig.paper(method="fixed", budget=12, width=3, top_m=3),
                               small=small)
        runs[name] = (dec, dec.generate(ids, 8).turns)
    ngram_dec, ngram_turns = runs["ngram"]
    neural_dec, neural_turns = runs["self_draft"]
    assert all(t["small_forward_s"] == 0.0 for t in ngram_turns)
    assert all(0.0 < t["small_forward_s"] <= t["small_s"] for t in neural_turns)
    assert all(t["small_calls"] > 0 for t in neural_turns)
    for t in neural_turns:  # the neural drafter's forwards are model time, not "outside the forwards"
        assert t["outside_forward_s"] == pytest.approx(
            t["turn_s"] - t["target_forward_s"] - t["middle_forward_s"] - t["small_forward_s"])
    assert neural_dec.small.tokens_encoded > 0 and len(neural_dec.ngram.tokens) == 0  # the n-gram index left idle
    assert len(ngram_dec.ngram.tokens) > 0


# ---------------------------------------------------------------- settings
def test_bad_small_drafter_settings_are_one_line_errors(tiny_pair):
    tok, target, middle = tiny_pair.tokenizer, tiny_pair.target, tiny_pair.middle
    cfg = TreeConfig.paper(method="fixed")
    cases = [
        ({"name": "self_draft", "layers": 0}, "layers must be an int >= 1"),
        ({"name": "self_draft", "layers": 3}, r"self_draft layers must be in 1\.\.2 .*got 3"),
        ({"name": "neural"}, "unknown small drafter 'neural'; expected one of ngram, self_draft, model"),
        ({"name": "self_draft"}, "self_draft needs layers"),
        ({"name": "ngram", "layers": 2}, "ngram takes no layers"),
        ({"name": "model"}, "needs model=<source>"),
        ({"name": "self_draft", "layers": 1, "depth": 3}, "unknown small drafter setting 'depth'"),
        ({"name": "model", "model": "tiny-random:0", "layers": 5}, r"layers must be in 1\.\.2 .*tiny-random:0"),
    ]
    for small, match in cases:
        with pytest.raises(ValueError, match=match) as excinfo:
            tree_decoder(target, middle, tok, cfg, small=small)
        one_line_error(excinfo)
    with pytest.raises(ValueError, match="unknown small drafter 'nope'; expected one of ngram, .*self_draft") as excinfo:
        small_settings("nope")
    one_line_error(excinfo)
    with pytest.raises(ValueError, match="layers must be an int >= 1") as excinfo:  # checked where unused too
        decoder_for("ar", TorchEngines(target, middle, tok), small={"name": "self_draft", "layers": 0})
    one_line_error(excinfo)
    # one configured small drafter serves a method list: a method without a small drafter ignores it
    assert isinstance(decoder_for("ar", TorchEngines(target, middle, tok), small=SELF_DRAFT_1), AutoregressiveDecoder)


def test_a_small_model_of_another_tokenizer_is_refused(tiny_pair):
    from treegraft.models import TokenizerMismatchError, build_tiny_tokenizer

    other = build_tiny_tokenizer()
    other.add_tokens(["<extra>"])
    with pytest.raises(TokenizerMismatchError, match="small drafter model 'tiny-random:0' has another tokenizer") as e:
        tree_decoder(tiny_pair.target, tiny_pair.middle, other, TreeConfig.paper(method="fixed"),
                         small={"name": "model", "model": "tiny-random:0"})
    one_line_error(e)


def test_small_settings_read_the_config_group():
    assert small_settings("ngram") == {"name": "ngram"}
    settings = small_settings("self_draft")
    assert settings["name"] == "self_draft" and settings["layers"] == 6
    assert small_config(settings) == SmallDrafterConfig(name="self_draft", layers=6)
    assert small_config(small_settings("qwen3-0.6b")).model == "Qwen/Qwen3-0.6B"
    assert not small_config(None).neural and small_config(settings).neural


def test_method_variants_name_a_small_drafter():
    assert method_small("fixed@self_draft") == "self_draft" and parse_method("fixed@self_draft") == ("fixed", {})
    assert method_small("fixed") is None and parse_method("fixed") == ("fixed", {})
    assert method_small("treegraft@t_mid_x1.25") is None
    assert parse_method("treegraft@t_mid_x1.25") == ("treegraft", {"t_mid": 1.25})
    assert parse_method("treegraft@t_mid_x1.25+self_draft") == ("treegraft", {"t_mid": 1.25})
    assert method_small("treegraft@self_draft+t_tgt_x2") == "self_draft"
    assert method_small("all_small@ngram") == "ngram" and method_small("csd@self_draft") == "self_draft"
    for bad in ("ar@self_draft", "hf_assisted@self_draft", "fixed@t_mid_x1.25", "fixed@nope", "fixed@self_draft+ngram",
                "treegraft@t_mid_xfast", "fixed@+"):
        with pytest.raises(ValueError, match="bad method variant") as excinfo:
            parse_method(bad)
        message = one_line_error(excinfo)
        assert "self_draft" in message and "t_mid_x" in message  # it lists what is allowed


def test_llama_cpp_refuses_a_neural_small_drafter_in_one_line():
    from treegraft.engines.llama_cpp import LlamaPair
    from treegraft.front import decoder_for

    with pytest.raises(ValueError, match="engine=llama_cpp runs the n-gram small drafter only") as excinfo:
        decoder_for("fixed", LlamaPair(None, None, None), small=small_settings("self_draft"))
    one_line_error(excinfo)


def test_generate_cli_with_a_neural_small_drafter(capsys):
    from treegraft.generate import cli

    common = ["pair=tiny-random", "prompt=abcabc abcabc ab", "chat_template=false", "max_new_tokens=8",
              "runtime=float32", "middle_runtime=same"]
    outputs = {}
    for method, small in (("ar", []), ("fixed", ["small=self_draft", "small.layers=1"])):
        assert compose("generate", common)["small"]["name"] == "ngram"  # the default
        assert cli(compose("generate", [*common, f"method={method}", *small])) == 0
        outputs[method] = capsys.readouterr().out
    assert outputs["fixed"] == outputs["ar"] and outputs["ar"].strip()
    assert cli(compose("generate", [*common, "method=fixed", "small=self_draft"])) == 2
    err = capsys.readouterr().err  # the default 6 layers exceed the tiny middle drafter's 2: one line
    assert "error: small drafter self_draft layers must be in 1..2" in err and len(err.strip().splitlines()) == 1


@pytest.mark.embedded
@pytest.mark.parametrize("method", ["fixed", pytest.param("all_small", marks=pytest.mark.slow)])
def test_greedy_equals_ar_on_smollm2_with_a_self_draft_small_drafter(smollm2_self_pair, method):
    pair = smollm2_self_pair
    tok = pair.tokenizer
    ids = tok("def fibonacci(n):\n    if n < 2:\n        return n\n    return", add_special_tokens=False).input_ids
    eos = {tok.eos_token_id}
    ref = ar_decoder(pair.target, eos).generate(ids, 10).tokens
    dec = tree_decoder(pair.target, pair.middle, tok, TreeConfig.paper(method=method, budget=8, width=3, top_m=3),
                           eos_ids=eos, small=small_settings("self_draft"))
    assert dec.generate(ids, 10).tokens == ref
    assert len(dec.small.model.base_model.layers) == 6


def test_schedule_enumeration_with_a_neural_small_drafter_matches_each_schedule_built_alone(tiny_pair):
    """collect's enumeration branches the turn at every step (the skip branch on a copy of the tree): each
    branch's small steps must see the small drafter's state of that branch, so every schedule's outcome
    equals the same schedule built and verified alone from the same state."""
    import itertools

    from treegraft.pipeline.enumeration import enumerate_turn, schedule_key

    tok, target = tiny_pair.tokenizer, tiny_pair.target
    ids = tok(PROMPTS[1]).input_ids
    cfg = TreeConfig.paper(method="fixed", budget=10, width=3, top_m=3)
    small = {"name": "self_draft", "layers": 2}  # the target's own layers: its proposals are accepted

    def fresh():
        dec = tree_decoder(target, target, tok, cfg, small=small, eos_ids=set(), eager_middle_prefill=True)
        dec._prefill(ids)
        return dec

    enumerated = enumerate_turn(fresh(), ids[-1], with_signals=False).outcomes
    alone = {}
    for schedule in itertools.product([0, 1], repeat=cfg.depth):
        dec = fresh()
        stats = TurnStats()
        tree = dec.build_tree(ids[-1], list(schedule), stats)
        inputs, acc = dec.verify_tree(tree, stats)
        alone[schedule_key(schedule)] = (acc.accepted, len(tree), inputs.size - 1)
    got = {k: (o.accepted, o.tree_nodes, o.verified_nodes) for k, o in enumerated.items()}
    assert got == alone
    assert len({a for a, _, _ in alone.values()}) > 1  # the schedules differ: a wrong branch state would show
