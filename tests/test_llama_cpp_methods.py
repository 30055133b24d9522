"""Every method on the llama.cpp engine (SmolLM2's GGUF) gives this engine's own greedy output, also with a
middle drafter on the stock kernels; speculative sampling keeps the target's distribution. (A file of its
own so that the test workers share the llama.cpp tests.)"""

from __future__ import annotations

import pytest
import torch

from treegraft.decoding import SamplingConfig
from treegraft.decoding.sampling import target_distribution
from treegraft.engines.llama_cpp.check import ar_logits

from .test_llama_cpp import PROMPT, cache_dir, chat, smol  # noqa: F401  (module fixtures)
from .test_tree_decoder import chi_square_pvalue

METHODS = ["fixed", "all_mid", "all_small", "csd", "no_nondestructive", "no_expanded_selection", "all_call"]
# budget=auto planned up to 15 nodes: SmolLM2 drafting for itself is accepted whole, and the planner would
# otherwise verify 64-node trees, 64 one-thread rows each, in every test here
TREE = {"auto_max_budget": 15}


@pytest.fixture(scope="module")
def smol_reference(smol):
    from treegraft.front import decoder_for

    prompts = [chat(smol.tokenizer, p) for p in (PROMPT, "Write a haiku about rain.")]
    ar = decoder_for("ar", smol)
    return prompts, [ar.generate(p, 32).tokens for p in prompts]


@pytest.mark.parametrize("method", METHODS)
def test_every_method_equals_this_engines_greedy_decoding(smol, smol_reference, method, cache_dir):
    from treegraft.front import decoder_for

    prompts, want = smol_reference
    dec = decoder_for(method, smol, TREE, cache_dir=cache_dir)
    some = 2 if method in ("fixed", "all_mid", "all_small", "csd") else 1  # the ablations: one prompt
    for ids, ref in zip(prompts[:some], want[:some]):
        out = dec.generate(ids, 32)
        assert out.tokens == ref, f"{method} diverged from ar at token {next(i for i, (x, y) in enumerate(zip(out.tokens, ref)) if x != y)}"
        assert sum(t["accepted"] for t in out.turns) + len(out.turns) >= len(ref)


def test_a_drafter_on_stock_kernels_still_gives_the_targets_output(smol, smol_reference, cache_dir):
    """A middle drafter that disagrees with the target (the stock, batch-variant kernels) changes the
    drafts, never the output."""
    from treegraft.engines.llama_cpp import LlamaPair
    from treegraft.front import decoder_for
    from treegraft.engines.llama_cpp import GGUFModel

    stock = GGUFModel(smol.middle.path, n_ctx=2048, n_seq=256, exact=False)
    pair = LlamaPair(smol.target, stock, smol.tokenizer)
    prompts, want = smol_reference
    dec = decoder_for("all_mid", pair, TREE, cache_dir=cache_dir)
    for ids, ref in zip(prompts, want):
        assert dec.generate(ids, 32).tokens == ref


def test_speculative_sampling_on_llama_cpp_keeps_the_target_distribution(smol, cache_dir):
    from treegraft.front import decoder_for

    ids = smol.tokenizer("My favourite word is").input_ids  # a short prompt with a spread-out next token
    probs = target_distribution(ar_logits(smol.target, ids, [])[-1], SamplingConfig(temperature=1.0))
    dec = decoder_for("all_mid", smol, tree={"depth": 1, "top_m": 4, "budget": 4}, cache_dir=cache_dir,
                            sampling=SamplingConfig(temperature=1.0))
    samples = []
    for seed in range(150):
        dec.sampling.seed = seed  # each generate draws from a generator seeded afresh
        samples.append(dec.generate(ids, 1).tokens[0])
    assert chi_square_pvalue(samples, probs) > 1e-3


def test_generate_on_llama_cpp_prints_the_same_text_for_every_method():
    """`python -m treegraft.generate engine=llama_cpp`: a speculative method prints ar's text; a bad GGUF
    path is one line."""
    from .test_generate_cli import run_generate

    args = ["pair=smollm2-135m__self", "engine=llama_cpp", "engine.threads=1", "prompt=List three prime numbers.",
            "max_new_tokens=24", "tree.auto_max_budget=15"]
    ar = run_generate(*args, "method=ar")
    assert ar.returncode == 0, ar.stderr
    assert "runtime=llama.cpp exact" in ar.stderr
    for method in ("all_small", "all_mid"):
        proc = run_generate(*args, f"method={method}")
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout == ar.stdout, method
    bad = run_generate("pair=smollm2-135m__self", "engine=llama_cpp", "pair.target=/nonexistent/model.gguf",
                       "prompt=hi", "max_new_tokens=2")
    assert bad.returncode == 2
    assert len(bad.stderr.strip().splitlines()) == 1 and "/nonexistent/model.gguf" in bad.stderr


def test_a_prompt_longer_than_a_batch_is_caught_up_in_several(smol, cache_dir):
    """A prompt of more than n_batch tokens (64 here, 512 by default): the target prefills it in batches and
    the middle drafter catches up in batches before its first call's nodes; the output is ar's."""
    from treegraft.engines.llama_cpp import LlamaPair
    from treegraft.front import decoder_for
    from treegraft.engines.llama_cpp import GGUFModel

    def small_batches():
        return GGUFModel(smol.target.path, n_ctx=1024, n_seq=64, n_batch=64, exact=True)

    with pytest.raises(ValueError, match="n_batch 32 is below n_seq 64"):  # not llama.cpp's abort
        GGUFModel(smol.target.path, n_ctx=1024, n_seq=64, n_batch=32)
    pair = LlamaPair(small_batches(), small_batches(), smol.tokenizer)
    ids = smol.tokenizer("Repeat after me: " + " ".join(f"item{i}" for i in range(50))).input_ids
    assert len(ids) > 2 * pair.middle.n_batch
    want = decoder_for("ar", pair).generate(ids, 12).tokens
    assert decoder_for("all_mid", pair, TREE, cache_dir=cache_dir).generate(ids, 12).tokens == want


def test_decoders_share_one_encoding_of_a_prompt_and_each_is_charged_for_it(smol, smol_reference, cache_dir):
    """With ``PromptReuse`` (what `evaluate` turns on): the first decoder encodes a prompt and saves seq 0,
    the others restore it; each output, each n-gram score and each prefill time (the encoding's seconds,
    charged) are those of a decoder that encoded the prompt itself. ``ar`` reads no prompt row's logits, so
    its scoreless encoding serves only scoreless prefills: a tree method encodes the prompt again with its
    scores (and is charged that), and ``ar`` is never charged for scores it does not read."""
    from treegraft.front import decoder_for
    from treegraft.engines.llama_cpp import PromptReuse

    prompts, want = smol_reference
    alone = decoder_for("all_small", smol, TREE, cache_dir=cache_dir)
    request = (alone.cfg.ngram.top_m, alone.cfg.ngram.prefill_vocab)
    alone_scores = alone.engine.prefill(prompts[0], *request)
    smol.target.prompt_reuse = reuse = PromptReuse()
    smol.middle.prompt_reuse = middle_reuse = PromptReuse()
    try:
        decoders = {m: decoder_for(m, smol, TREE, cache_dir=cache_dir) for m in ("ar", "all_small", "all_mid", "all_call")}
        for dec in decoders.values():  # warm-ups, as evaluate's: every decoder's score request is known after them
            dec.generate(prompts[1], 4)
        reuse.forget()
        middle_reuse.forget()
        for ids, ref in zip(prompts, want):
            encoded = mid_encoded = None
            for method, dec in decoders.items():
                out = dec.generate(ids, 32)
                assert out.tokens == ref, method
                assert reuse.saved.tokens == tuple(ids[:-1])
                if method == "ar":
                    assert reuse.saved.scores == {}, "ar's prompt encoding computed scores it never reads"
                    assert out.prefill_time_s >= reuse.saved.seconds
                    continue
                encoded = encoded or reuse.saved
                assert encoded.scores, f"{method} restored ar's scoreless encoding"
                assert reuse.saved is encoded, f"{method} encoded the prompt again"
                assert out.prefill_time_s >= encoded.seconds
                if method == "all_mid":  # the first to call the middle drafter: it encodes the prompt there
                    mid_encoded = middle_reuse.saved
                    assert mid_encoded is not None and mid_encoded.tokens == tuple(ids[:-1])
            assert middle_reuse.saved is mid_encoded, "all_call's middle drafter encoded the prompt again"
            assert decoders["all_call"].middle.charged_s > 0  # charged for it instead
        assert len(reuse.requests) == 1  # the n-gram drafter's scores (ar requests none)
        shared = decoders["all_small"].engine.prefill(prompts[0], *request)  # encoded (prompts[1] was saved) ...
        again = decoders["all_small"].engine.prefill(prompts[0], *request)  # ... then restored
        assert decoders["all_small"].engine.prefill_charge_s > 0
        for got in (shared, again):
            assert all(torch.equal(a, b) for a, b in zip(got, alone_scores))
    finally:
        smol.target.prompt_reuse = smol.middle.prompt_reuse = None
