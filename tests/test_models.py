"""Model loading: tiny pair, self-draft pairs, embedded models, and the one-line errors."""

from __future__ import annotations

import pytest
import torch

from treegraft.models import (
    ModelLoadError,
    PairSpec,
    TokenizerMismatchError,
    build_tiny_model,
    build_tiny_tokenizer,
    check_same_vocabulary,
    load_model,
    load_pair,
    make_self_draft,
)
from treegraft.models.loading import resolve_source

from .conftest import require_embedded


def test_tiny_pair_loads_two_different_models(tiny_pair):
    assert tiny_pair.target.config.vocab_size == tiny_pair.middle.config.vocab_size == len(tiny_pair.tokenizer)
    wt = tiny_pair.target.model.embed_tokens.weight
    wm = tiny_pair.middle.model.embed_tokens.weight
    assert not torch.equal(wt, wm)
    # seeds fix the weights: building again gives the same model
    assert torch.equal(build_tiny_model(0).model.embed_tokens.weight, wt)


def test_tiny_tokenizer_roundtrip():
    tok = build_tiny_tokenizer()
    text = "def f(x):\n    return x + 1  # é"
    assert tok.decode(tok(text).input_ids) == text
    assert tok.eos_token_id == 2 and len(tok) == 259


def test_self_draft_shares_weights_and_truncates_layers():
    target = build_tiny_model(0, num_layers=3)
    draft = make_self_draft(target, 2)
    assert len(draft.model.layers) == 2 and draft.config.num_hidden_layers == 2
    assert draft.model.layers[0] is target.model.layers[0]
    assert draft.lm_head.weight.data_ptr() == target.lm_head.weight.data_ptr()
    assert draft.model.embed_tokens is target.model.embed_tokens
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        full = make_self_draft(target, 3)(ids).logits
        assert torch.allclose(full, target(ids).logits, atol=1e-6)  # all layers = the target itself
        assert not torch.allclose(draft(ids).logits, target(ids).logits)
    with pytest.raises(ValueError, match="self_draft_layers must be in 1..3"):
        make_self_draft(target, 4)


def test_pair_spec_needs_exactly_one_middle():
    with pytest.raises(ValueError, match="exactly one of middle"):
        PairSpec(name="x", target="tiny-random:0")
    with pytest.raises(ValueError, match="exactly one of middle"):
        PairSpec(name="x", target="tiny-random:0", middle="tiny-random:1", self_draft_layers=1)


def test_missing_embedded_model_says_run_make_models(tmp_path):
    with pytest.raises(ModelLoadError, match=r"embedded model qwen-coder-0.5b not converted: run `make models`"):
        resolve_source("embedded:qwen-coder-0.5b", models_dir=tmp_path)
    with pytest.raises(ModelLoadError, match="unknown embedded model 'nope'"):
        resolve_source("embedded:nope", models_dir=tmp_path)


def test_missing_local_or_hub_model_is_one_clear_line(tmp_path):
    with pytest.raises(ModelLoadError) as err:
        load_model(str(tmp_path / "no-such-model"))
    assert "cannot load model" in str(err.value) and "\n" not in str(err.value)


def _save_tiny(folder, tokenizer):
    build_tiny_model(1).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def test_local_folder_middle_with_same_tokenizer_loads(tmp_path):
    _save_tiny(tmp_path, build_tiny_tokenizer())
    pair = load_pair(PairSpec(name="local", target="tiny-random:0", middle=str(tmp_path)))
    assert torch.equal(pair.middle.model.embed_tokens.weight, build_tiny_model(1).model.embed_tokens.weight)


def test_tokenizer_mismatch_is_rejected(tmp_path):
    other = build_tiny_tokenizer()
    other.add_tokens(["<extra>"])
    _save_tiny(tmp_path, other)
    with pytest.raises(TokenizerMismatchError, match="tokenizer mismatch: target tiny-random:0"):
        load_pair(PairSpec(name="bad", target="tiny-random:0", middle=str(tmp_path)))
    with pytest.raises(TokenizerMismatchError, match="1 only in middle"):
        check_same_vocabulary(build_tiny_tokenizer(), other, "a", "b")


@pytest.mark.embedded
def test_smollm2_self_pair_loads(smollm2_self_pair):
    pair = smollm2_self_pair
    assert pair.spec.name == "smollm2-135m__self"
    assert len(pair.middle.model.layers) == pair.spec.self_draft_layers < len(pair.target.model.layers)
    assert pair.middle.lm_head is pair.target.lm_head
    ids = pair.tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        next_id = pair.target(ids).logits[0, -1].argmax()
    assert pair.tokenizer.decode(next_id).strip() == "Paris"


@pytest.mark.embedded
@pytest.mark.parametrize("name", ["qwen-coder-1.5b", "qwen-coder-0.5b", "gemma3-270m"])
def test_other_embedded_models_load_when_converted(name):
    from treegraft.models import load_tokenizer

    from treegraft.models.embedded import EMBEDDED_MODELS, is_converted
    from treegraft.paths import default_models_dir

    if not is_converted(default_models_dir() / name, EMBEDDED_MODELS[name]):
        pytest.skip(f"{name} is not converted here (CI converts only the models the tests need)")
    tok = load_tokenizer(f"embedded:{name}")
    model = load_model(f"embedded:{name}", dtype="bfloat16")
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        top5 = model(ids).logits[0, -1].topk(5).indices
    assert "Paris" in [tok.decode(t).strip() for t in top5]
