"""The middle drafter's calls shaped for a CPU on llama.cpp (SmolLM2's GGUF): hidden states instead of the full
LM head with a draft vocabulary, Q4_0 weights on the stock kernels, a capped rescoring scope; every one keeps
the target's greedy output."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from .test_llama_cpp import PROMPT, cache_dir, chat, smol  # noqa: F401  (module fixtures)

TREE = {"auto_max_budget": 15}  # as test_llama_cpp_methods: SmolLM2 drafting for itself is accepted whole


@pytest.fixture(scope="module")
def reference(smol):
    from treegraft.front import decoder_for

    prompts = [chat(smol.tokenizer, p) for p in (PROMPT, "Write a haiku about rain.")]
    return prompts, [decoder_for("ar", smol).generate(p, 32).tokens for p in prompts]


def _encode(model, ids: list[int]) -> None:
    model.clear()
    model.decode(ids, list(range(len(ids))), [[0]] * len(ids), [True] * len(ids))


def test_the_vocabulary_head_gives_llama_cpps_logits_on_its_rows(smol):
    """Hidden states of the sibling context times the GGUF's output rows = llama.cpp's own logits at those
    tokens, up to the bfloat16 products (the head only steers drafts)."""
    from treegraft.engines.llama_cpp.head import VocabHead

    full = smol.middle
    hidden = full.hidden_state_sibling()
    assert hidden is full.hidden_state_sibling() and hidden.hidden_states and not full.hidden_states
    ids = chat(smol.tokenizer, PROMPT)[:48]
    _encode(full, ids)
    _encode(hidden, ids)
    rows = list(range(len(ids)))
    want_all = full.logits_rows(rows)
    states = hidden.hidden_rows(rows)
    assert states.shape == (len(ids), full.n_embd)
    vocab = torch.unique(torch.cat([torch.arange(0, full.n_vocab, 5), want_all.argmax(-1)]))
    got = VocabHead(full.path).logits(states, vocab)
    want = want_all[:, vocab]
    assert got.shape == want.shape
    scale = want.abs().max().item()
    assert (got - want).abs().max().item() < 0.02 * scale, "the head's logits are not llama.cpp's"
    assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() >= 0.9
    for m in (full, hidden):
        m.clear()


@pytest.mark.parametrize("method", ["all_mid", "fixed"])
def test_a_draft_vocabulary_reads_hidden_states_and_keeps_the_output(smol, reference, method, cache_dir):
    from treegraft.front import decoder_for

    prompts, want = reference
    dec = decoder_for(method, smol, {**TREE, "draft_vocab": 256, "middle_scope": 2}, cache_dir=cache_dir)
    assert dec.middle.head is not None and dec.middle.model.hidden_states
    assert dec.plan_turn().scope <= 2
    for ids, ref in zip(prompts, want):
        assert dec.generate(ids, 32).tokens == ref
    assert dec.middle.calls > 0


def test_the_drafter_reads_a_nodes_hidden_state_where_the_full_head_reads_its_logits(smol):
    """The same tree encoded by a drafter on llama.cpp's full head and by one on hidden states and the
    vocabulary head (the pending prompt rows before the nodes in one batch): the same distributions over the
    draft vocabulary, node by node, up to the bfloat16 products."""
    from treegraft.drafters.vocab import frequent_tokens
    from treegraft.engines.llama_cpp import LlamaCppDrafter
    from treegraft.engines.llama_cpp.head import VocabHead
    from treegraft.tree import MIDDLE, DraftTree

    vocab = frequent_tokens(smol.tokenizer, 512, smol.middle.n_vocab)
    full = LlamaCppDrafter(smol.middle, vocab)
    hidden = LlamaCppDrafter(smol.middle.hidden_state_sibling(), vocab, VocabHead(smol.middle.path))
    prompt = chat(smol.tokenizer, PROMPT)[:20]  # under fast_rows: prompt rows and nodes share one decode
    tokens = smol.tokenizer("def fib(n): return n", add_special_tokens=False).input_ids
    tree = DraftTree.with_root(prompt[-1])
    chain = [0]
    for t in tokens[:3]:
        chain.append(tree.add_child(chain[-1], t, -1.0, MIDDLE, 1))
    side = tree.add_child(0, tokens[-1], -2.0, MIDDLE, 1)
    nodes = [*chain, side]
    for d in (full, hidden):
        d.reset(prompt)
        d.start_turn()
        d.encode(tree, nodes)
        assert d.calls == 1
    for n in nodes:
        a, b = full.logprobs[n], hidden.logprobs[n]
        assert torch.equal(a.ids, b.ids)
        la, lb = a.matrix[a.row], b.matrix[b.row]
        assert (la - lb).abs().max().item() < 0.02 * la.abs().max().item(), f"node {n}: the distributions differ"
        assert la.argmax().item() == lb.argmax().item()


def test_q4_0_middle_weights_are_requantized_once_and_keep_the_output(smol, reference, cache_dir, tmp_path):
    import gguf

    from treegraft.engines.llama_cpp import load_llama_pair
    from treegraft.front import decoder_for
    from treegraft.paths import default_models_dir

    (tmp_path / "smollm2-135m").symlink_to(default_models_dir() / "smollm2-135m")  # the converted tokenizer
    pair = load_llama_pair("embedded:smollm2-135m", "embedded:smollm2-135m", n_ctx=2048, models_dir=tmp_path,
                           middle_weights="q4_0")
    path = pair.middle.path
    assert path.endswith(".q4_0.gguf") and not pair.middle.exact and pair.target.exact
    kinds = {t.name: t.tensor_type for t in gguf.GGUFReader(path).tensors}
    original = {t.name: t.tensor_type for t in gguf.GGUFReader(smol.middle.path).tensors}
    kept = ("output.weight", "token_embd.weight")  # the head's rows (tied here) and a row lookup
    matrices = [n for n, t in original.items() if t != gguf.GGMLQuantizationType.F32 and n not in kept]
    assert matrices and all(kinds[n] == gguf.GGMLQuantizationType.Q4_0 for n in matrices)
    assert all(kinds[n] == t for n, t in original.items() if n not in matrices)  # norms, the embedding
    assert [p.name for p in tmp_path.glob("*.gguf")] == [Path(path).name]
    stamp = Path(path).stat().st_mtime_ns
    prompts, want = reference
    for tree in (TREE, {**TREE, "draft_vocab": 256}):
        dec = decoder_for("all_mid", pair, tree, cache_dir=cache_dir)
        for ids, ref in zip(prompts, want):
            assert dec.generate(ids, 32).tokens == ref
        assert dec.middle.calls > 0
    again = load_llama_pair("embedded:smollm2-135m", "embedded:smollm2-135m", n_ctx=2048, models_dir=tmp_path,
                            middle_weights="q4_0")
    assert again.middle.path == path and Path(path).stat().st_mtime_ns == stamp
    for p in (pair, again):
        p.middle.close()


def test_hidden_states_need_an_architecture_whose_graph_is_patched(smol, monkeypatch):
    from treegraft.engines.llama_cpp import GGUFModel, LlamaCppError
    from treegraft.engines.llama_cpp import model as model_module

    monkeypatch.setattr(model_module, "HIDDEN_STATE_ARCHS", ("qwen2",))
    with pytest.raises(LlamaCppError, match="hidden states without the LM head need a qwen2 model.*'llama'"):
        GGUFModel(smol.middle.path, n_ctx=256, n_seq=4, hidden_states=True)


def test_bad_middle_settings_are_one_line_errors():
    from treegraft.decoding import TreeConfig
    from treegraft.engines.llama_cpp import load_llama_pair
    from treegraft.front import EngineSettings

    with pytest.raises(ValueError, match="unknown engine.middle_weights 'q8'; expected one of file, q4_0"):
        EngineSettings(name="llama_cpp", middle_weights="q8")
    with pytest.raises(ValueError, match="unknown middle_weights 'q8'"):
        load_llama_pair("embedded:smollm2-135m", None, middle_weights="q8")
    with pytest.raises(ValueError, match="middle_scope must be a positive number of nodes or null, got 0"):
        TreeConfig(middle_scope=0)
