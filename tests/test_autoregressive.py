"""`ar` (target-only decoding) equals `model.generate` token for token, and handles bad input."""

from __future__ import annotations

import pytest
import torch

from treegraft.data import BenchmarkConfig, format_prompt, load_benchmark
from treegraft.decoding import PromptError, SamplingConfig, eos_token_ids
from .conftest import ar_decoder


def hf_greedy(model, prompt_ids, max_new_tokens, eos_ids):
    out = model.generate(
        torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=sorted(eos_ids),
        pad_token_id=sorted(eos_ids)[0], attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
    )
    return out[0, len(prompt_ids):].tolist()


@pytest.mark.parametrize("text", ["hello world", "def f(x):\n    return", "aaaaaaaaaa", "1 2 3 4 5"])
def test_ar_equals_generate_on_tiny_model(tiny_pair, text):
    tok, model = tiny_pair.tokenizer, tiny_pair.target
    prompt_ids = tok(text).input_ids
    eos = eos_token_ids(model, tok)
    result = ar_decoder(model, eos).generate(prompt_ids, max_new_tokens=40)
    assert result.tokens == hf_greedy(model, prompt_ids, 40, eos)
    assert result.new_tokens == len(result.tokens) and result.tokens_per_s > 0
    assert result.stop_reason in {"eos", "max_new_tokens"}


def test_ar_stops_at_eos_and_never_past_max_new_tokens(tiny_pair):
    tok, model = tiny_pair.tokenizer, tiny_pair.target
    prompt_ids = tok("stop here").input_ids
    free = ar_decoder(model, set()).generate(prompt_ids, max_new_tokens=12)
    assert free.new_tokens == 12 and free.stop_reason == "max_new_tokens"
    # declare the 5th generated token an end-of-sequence id: decoding must stop right there
    stop_id = free.tokens[4]
    stopped = ar_decoder(model, {stop_id}).generate(prompt_ids, max_new_tokens=12)
    first = free.tokens.index(stop_id)
    assert stopped.tokens == free.tokens[: first + 1] and stopped.stop_reason == "eos"


def test_ar_sampling_is_seeded_and_top_p_tiny_is_greedy(tiny_pair):
    tok, model = tiny_pair.tokenizer, tiny_pair.target
    prompt_ids = tok("sample me").input_ids
    draw = lambda seed, **kw: ar_decoder(  # noqa: E731
        model, set(), SamplingConfig(temperature=1.0, seed=seed, **kw)
    ).generate(prompt_ids, 20).tokens
    assert draw(1) == draw(1)
    assert draw(1) != draw(2)
    greedy = ar_decoder(model, set()).generate(prompt_ids, 20).tokens
    assert draw(3, top_p=1e-6) == greedy


def test_ar_rejects_bad_prompts(tiny_pair):
    dec = ar_decoder(tiny_pair.target, set())
    with pytest.raises(PromptError, match="empty prompt"):
        dec.generate([], 5)
    with pytest.raises(PromptError, match=r"prompt of 2040 tokens \+ max_new_tokens 10 exceeds the model's context window of 2048"):
        dec.generate([5] * 2040, 10)
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        SamplingConfig(temperature=-1)


@pytest.mark.embedded
# CI: humaneval; `make test-all`: gsm8k and mt_bench too
@pytest.mark.parametrize("benchmark", [pytest.param("gsm8k", marks=pytest.mark.slow), "humaneval",
                                       pytest.param("mt_bench", marks=pytest.mark.slow)])
def test_ar_equals_generate_on_smollm2_real_prompts(smollm2_self_pair, benchmark):
    tok, model = smollm2_self_pair.tokenizer, smollm2_self_pair.target
    record = load_benchmark(BenchmarkConfig(name=benchmark, num_prompts=1))[0]
    prompt_ids = tok(format_prompt(tok, record["turns"][0]), add_special_tokens=False).input_ids
    eos = eos_token_ids(model, tok)
    result = ar_decoder(model, eos).generate(prompt_ids, max_new_tokens=32)
    assert result.tokens == hf_greedy(model, prompt_ids, 32, eos)
