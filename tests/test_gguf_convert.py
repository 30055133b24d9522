"""Our GGUF converter gives the same tokenizer and model as transformers' own GGUF loader (SmolLM2).

transformers' GGUF path costs about a minute for this 135M model (tokenizer + model parse); it is
the reference, loaded once per session.
"""

from __future__ import annotations

import pytest
import torch

from treegraft.models.embedded import EMBEDDED_MODELS, gguf_parts

from .conftest import require_embedded

TEXTS = [
    "Hello world, this is a test.",
    "def is_prime(n: int) -> bool:\n    return n > 1 and all(n % d for d in range(2, n))",
    "Ünïcödé ✓ 日本語 — emojis 🤖 and  double  spaces\t tabs",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.fixture(scope="module")
def reference_and_converted():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = require_embedded("smollm2-135m")
    gguf = gguf_parts(EMBEDDED_MODELS["smollm2-135m"])[0]
    ref_tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    ref_model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return ref_tok, ref_model.eval(), tok, model.eval()


@pytest.mark.slow  # transformers' own GGUF loader as the reference takes ~50 s: `make test-all`
@pytest.mark.embedded
def test_tokenizer_matches_transformers_gguf(reference_and_converted):
    ref_tok, _, tok, _ = reference_and_converted
    assert tok.get_vocab() == ref_tok.get_vocab()
    for text in TEXTS:
        ids = tok(text).input_ids
        assert ids == ref_tok(text).input_ids
        assert tok.decode(ids) == ref_tok.decode(ids)
    assert (tok.eos_token, tok.bos_token) == (ref_tok.eos_token, ref_tok.bos_token)
    assert tok.chat_template == ref_tok.chat_template


@pytest.mark.slow  # the same reference: `make test-all`
@pytest.mark.embedded
def test_logits_match_transformers_gguf(reference_and_converted):
    ref_tok, ref_model, tok, model = reference_and_converted
    ref_state = ref_model.state_dict()
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, ref_state[name]), name
    for text in TEXTS:
        ids = torch.tensor([tok(text).input_ids])
        with torch.no_grad():
            assert torch.equal(model(ids).logits, ref_model(ids).logits)
