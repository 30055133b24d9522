"""TreeGraft inside transformers' generate(): the custom_generate folder, streamers, clear refusals, and
the CLI's streamed output."""

from __future__ import annotations

import threading

import pytest
import torch
from transformers import TextIteratorStreamer

from treegraft.hf_generate import TreeGraftGenerateError
from treegraft.models import build_tiny_model, build_tiny_tokenizer

from .conftest import REPO_ROOT
from .test_generate_cli import run_generate

FOLDER = str(REPO_ROOT)  # holds custom_generate/generate.py
TREE_METHODS = ["all_small", "all_mid", "fixed", "all_call", "no_nondestructive", "no_expanded_selection", "csd", "ar"]


def custom(model, ids, **kwargs):
    return model.generate(ids, custom_generate=FOLDER, trust_remote_code=True, **kwargs)


@pytest.fixture(scope="module")
def tiny():
    return build_tiny_model(0), build_tiny_model(1), build_tiny_tokenizer()


@pytest.mark.parametrize("method", TREE_METHODS)
def test_greedy_custom_generate_equals_generate_on_the_tiny_pair(tiny, method):
    target, middle, tok = tiny
    for text in ("abab abab abab", "hello world"):
        ids = torch.tensor([tok(text).input_ids])
        ref = target.generate(ids, do_sample=False, max_new_tokens=24)
        out = custom(target, ids, assistant_model=middle, method=method, do_sample=False, max_new_tokens=24,
                     tree={"budget": "auto", "shape": "auto"})
        assert torch.equal(out, ref), (method, text)


def _early_eos(model, ids) -> int:
    """A token greedy decoding emits at its 5th step: as EOS it stops generation early."""
    return int(model.generate(ids, do_sample=False, max_new_tokens=8)[0, ids.shape[1] + 4])


@pytest.mark.parametrize("method", ["fixed", "all_small", "csd", "ar"])
def test_min_new_tokens_holds_eos_back_as_generate_does(tiny, method):
    target, middle, tok = tiny
    ids = torch.tensor([tok("abab abab abab").input_ids])
    eos = _early_eos(target, ids)
    early = target.generate(ids, do_sample=False, max_new_tokens=30, eos_token_id=eos, pad_token_id=eos)
    assert early.shape[1] <= ids.shape[1] + 5  # without a minimum, this EOS stops it within 5 tokens
    for kwargs in ({"min_new_tokens": 24}, {"min_length": ids.shape[1] + 24}):
        ref = target.generate(ids, do_sample=False, max_new_tokens=30, eos_token_id=eos, pad_token_id=eos, **kwargs)
        assert ref.shape[1] >= ids.shape[1] + 24
        out = custom(target, ids, assistant_model=middle, method=method, do_sample=False, max_new_tokens=30,
                     eos_token_id=eos, tree={"budget": "auto", "shape": "auto"}, **kwargs)
        assert torch.equal(out, ref), (method, kwargs)


def test_return_dict_and_max_length(tiny):
    target, middle, tok = tiny
    ids = torch.tensor([tok("abcabc").input_ids])
    out = custom(target, ids, assistant_model=middle, do_sample=False, max_length=ids.shape[1] + 10,
                 return_dict_in_generate=True)
    assert torch.equal(out.sequences, target.generate(ids, do_sample=False, max_length=ids.shape[1] + 10))


@pytest.mark.slow  # the tiny-pair twin above runs in `make test`; this one in `make test-all`
@pytest.mark.embedded
def test_greedy_custom_generate_equals_generate_on_smollm2_self(smollm2_self_pair):
    from treegraft.data import BenchmarkConfig, format_prompt, load_benchmark

    pair = smollm2_self_pair
    tok = pair.tokenizer
    record = load_benchmark(BenchmarkConfig(name="humaneval", num_prompts=1))[0]
    ids = torch.tensor([tok(format_prompt(tok, record["turns"][0]), add_special_tokens=False).input_ids[:96]])
    ref = pair.target.generate(ids, do_sample=False, max_new_tokens=20)
    for kwargs in ({"assistant_model": pair.middle, "method": "fixed"}, {"self_draft_layers": 28, "method": "all_mid"},
                   {"method": "all_small"}):
        assert torch.equal(custom(pair.target, ids, do_sample=False, max_new_tokens=20, **kwargs), ref), kwargs


@pytest.mark.slow  # the tiny-pair twin above runs in `make test`; this one in `make test-all`
@pytest.mark.embedded
def test_min_new_tokens_on_smollm2_self(smollm2_self_pair):
    pair = smollm2_self_pair
    tok = pair.tokenizer
    ids = torch.tensor([tok("def add(a, b):\n    return a + b\n").input_ids])
    eos = _early_eos(pair.target, ids)
    ref = pair.target.generate(ids, do_sample=False, max_new_tokens=32, min_new_tokens=24, eos_token_id=eos,
                               pad_token_id=eos)
    assert ref.shape[1] >= ids.shape[1] + 24
    for kwargs in ({"assistant_model": pair.middle, "method": "fixed"}, {"self_draft_layers": 28, "method": "all_mid"}):
        out = custom(pair.target, ids, do_sample=False, max_new_tokens=32, min_new_tokens=24, eos_token_id=eos, **kwargs)
        assert torch.equal(out, ref), kwargs


@pytest.mark.embedded
def test_text_iterator_streamer_receives_the_text_in_pieces(smollm2_self_pair):
    pair = smollm2_self_pair
    tok = pair.tokenizer
    ids = torch.tensor([tok("def fib(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n").input_ids])
    streamer = TextIteratorStreamer(tok, skip_prompt=True)
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("out", custom(
        pair.target, ids, method="all_small", do_sample=False, max_new_tokens=16,
        streamer=streamer)))
    thread.start()
    pieces = [piece for piece in streamer]
    thread.join()
    assert len([p for p in pieces if p]) > 1
    assert "".join(pieces) == tok.decode(result["out"][0, ids.shape[1]:])


def test_sampling_is_seeded_by_torch(tiny):
    """A seed fixes the sampled text where the tree does not depend on timings (a fixed B_ver: with
    budget=auto the verified tree follows measured costs, so only the distribution is fixed)."""
    target, middle, tok = tiny
    ids = torch.tensor([tok("abab").input_ids])
    runs = []
    for seed in (7, 7, 8):
        torch.manual_seed(seed)
        runs.append(custom(target, ids, assistant_model=middle, do_sample=True, temperature=0.9, top_k=20,
                           max_new_tokens=12, tree={"budget": 16}))
    assert torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], runs[2])


@pytest.mark.parametrize("bad, message", [
    ({"num_beams": 2}, "num_beams=2"),
    ({"repetition_penalty": 1.2}, "repetition_penalty=1.2"),
    ({"output_scores": True, "return_dict_in_generate": True}, "output_scores=True"),
    ({"method": "treegraft"}, "scheduler_artifacts"),
    ({"no_such_option": 3}, "unsupported argument(s) for TreeGraft generate: no_such_option"),
])
def test_unsupported_arguments_fail_with_one_clear_error(tiny, bad, message):
    target, middle, tok = tiny
    ids = torch.tensor([tok("abab").input_ids])
    kwargs = {"assistant_model": middle, "max_new_tokens": 4, **bad}
    with pytest.raises(TreeGraftGenerateError, match=message.replace("(", r"\(").replace(")", r"\)")):
        custom(target, ids, **kwargs)


def test_batches_padding_and_logits_processors_are_refused(tiny):
    from transformers import LogitsProcessorList, TemperatureLogitsWarper

    target, middle, tok = tiny
    ids = torch.tensor([tok("abab").input_ids] * 2)
    with pytest.raises(TreeGraftGenerateError, match="one sequence at a time"):
        custom(target, ids, assistant_model=middle, max_new_tokens=4)
    one = ids[:1]
    with pytest.raises(TreeGraftGenerateError, match="padding"):
        custom(target, one, attention_mask=torch.tensor([[0] + [1] * (one.shape[1] - 1)]), max_new_tokens=4)
    with pytest.raises(TreeGraftGenerateError, match="logits_processor"):
        custom(target, one, assistant_model=middle, max_new_tokens=4,
               logits_processor=LogitsProcessorList([TemperatureLogitsWarper(0.5)]))


def test_streamed_cli_stdout_equals_the_plain_cli_stdout():
    args = ["pair=tiny-random", "chat_template=false", "prompt=abc abc abc abc", "max_new_tokens=32", "runtime=float32"]
    plain = run_generate(*args, "method=ar")
    assert plain.returncode == 0, plain.stderr
    for method in ("ar", "fixed", "hf_prompt_lookup"):  # token by token, turn by turn, HF's streamer
        streamed = run_generate(*args, f"method={method}", "stream=true")
        assert streamed.returncode == 0, streamed.stderr
        assert streamed.stdout == plain.stdout, method  # every method is lossless, so one reference
