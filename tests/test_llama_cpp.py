"""The llama.cpp engine on SmolLM2's GGUF: batch invariance (a token's logits in a chain or a tree equal
the same token decoded alone, bit for bit, at KV lengths below and above 512 cells), every method's
greedy output equal to this engine's own one-token decoding, KV state after many turns, snapshot /
restore, and the sampling rule's distribution."""

from __future__ import annotations

import os
import random

import pytest
import torch

from treegraft.decoding import SamplingConfig
from treegraft.decoding.sampling import target_distribution
from treegraft.llama_cpp.build import installed_build, patch_id

from .test_tree_decoder import chi_square_pvalue


def _require_llama_cpp():
    if installed_build() is None:
        message = "llama-cpp-python with treegraft's patch is not installed: run `make llamacpp`"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """One cache for the module: the engine's cost curve and the frequent tokens are measured once."""
    return tmp_path_factory.mktemp("llama-cache")


def chat(tokenizer, text: str) -> list[int]:
    from treegraft.data import format_prompt

    return tokenizer(format_prompt(tokenizer, text), add_special_tokens=False).input_ids


@pytest.fixture(scope="module")
def smol():
    """SmolLM2-135M on llama.cpp (exact) as target, the same file as middle drafter, and its tokenizer."""
    from .conftest import require_embedded

    _require_llama_cpp()
    require_embedded("smollm2-135m")
    from treegraft.llama_cpp import load_llama_pair

    return load_llama_pair("embedded:smollm2-135m", "embedded:smollm2-135m", n_ctx=2048)


PROMPT = "Write a Python function that returns the n-th Fibonacci number, then explain how it works."


def test_the_installed_build_is_the_patched_one():
    _require_llama_cpp()
    stamp = installed_build()
    assert stamp["patch_id"] == patch_id(), "the installed llama-cpp-python predates the current patch: make llamacpp"
    assert stamp["version"] == "0.3.36"


def one_token_logits(model, tokens: list[int]) -> list[torch.Tensor]:
    """Each token decoded alone after its prefix (the reference)."""
    model.clear()
    out = []
    for pos, tok in enumerate(tokens):
        model.decode([tok], [pos], [[0]], [True])
        out.append(model.logits(0))
    return out


class Reference:
    """One-token decoding on a second context of the same file, its prefix decoded once."""

    def __init__(self, model, prefix: list[int]):
        self.model, self.n = model, len(prefix)
        one_token_logits(model, prefix)

    def tree(self, tree) -> list[torch.Tensor]:
        """Logits of every node after ``prefix`` + its root-to-node path, each token decoded alone:
        depth first, a node's cell freed when its subtree is done (so every path sits in contiguous cells)."""
        out: dict[int, torch.Tensor] = {}

        def visit(node: int) -> None:
            pos = self.n + tree.depth[node]
            self.model.decode([tree.token[node]], [pos], [[0]], [True])
            out[node] = self.model.logits(0)
            for child in tree.children[node].values():
                visit(child)
            self.model.seq_rm(0, pos, -1)

        visit(0)
        return [out[i] for i in range(len(tree))]


@pytest.mark.parametrize("context", [40, 530])  # KV below and above 512 cells (flash attention's split-KV path)
def test_chains_and_trees_in_one_batch_equal_one_token_decoding(smol, context):
    """The target prefills in batches of up to 512 rows, then verifies a chain or a random tree in one
    batch; every row's logits equal the same tokens decoded one at a time, bit for bit."""
    from treegraft.llama_cpp.engine import LlamaCppTarget
    from treegraft.tree import DraftTree, build_tree_inputs

    rng = random.Random(context)
    prefix = [rng.randrange(smol.target.n_vocab) for _ in range(context)]
    ref = Reference(smol.middle, prefix)
    engine = LlamaCppTarget(smol.target)
    root = rng.randrange(smol.target.n_vocab)
    engine.prefill(prefix + [root], 1, None)
    for n in (2, 4, 8, 16, 32, 64):  # each tree verified after the last one was rolled back (its cells buried)
        tree = DraftTree.with_root(root)
        chain = n <= 8  # small sizes as chains, the rest as random trees
        for i in range(1, n):
            tree.add_child(i - 1 if chain else rng.randrange(i), rng.randrange(smol.target.n_vocab), -1.0, 0, 0)
        rows = engine.forward_tree(build_tree_inputs(tree, list(range(1, len(tree))), context))
        got = rows.logits(list(range(len(tree))))
        want = ref.tree(tree)
        for i in range(len(tree)):
            assert torch.equal(got[i], want[i]), \
                f"{'chain' if chain else 'tree'} of {n} after {context} cells, node {i} (depth {tree.depth[i]}): not bit-identical"
        engine.rollback(context)


def test_keep_moves_the_accepted_path_into_the_context(smol):
    """After keep(), decoding the next token gives the logits of the accepted text decoded plainly."""
    from treegraft.llama_cpp.engine import LlamaCppTarget
    from treegraft.tree import DraftTree, build_tree_inputs

    model = smol.target
    ids = chat(smol.tokenizer, PROMPT)
    engine = LlamaCppTarget(model)
    engine.prefill(ids, 1, None)
    L = engine.context_len()
    tree = DraftTree.with_root(ids[-1])
    a = tree.add_child(0, 100, -1.0, 0, 0)
    b = tree.add_child(0, 200, -1.0, 0, 0)
    c = tree.add_child(b, 300, -1.0, 0, 0)
    tree.add_child(a, 400, -1.0, 0, 0)
    engine.forward_tree(build_tree_inputs(tree, list(range(1, len(tree))), L))
    engine.keep(L, [0, b, c])
    assert engine.context_len() == L + 3
    got = engine.step(500)
    want = one_token_logits(model, ids + [200, 300, 500])[-1]
    assert torch.equal(got, want)
    engine.rollback(L)
    assert engine.context_len() == L
    assert torch.equal(engine.step(ids[-1]), one_token_logits(model, ids)[-1])


METHODS = ["fixed", "all_mid", "all_small", "csd", "no_nondestructive", "no_expanded_selection", "all_call"]


@pytest.fixture(scope="module")
def smol_reference(smol):
    from treegraft.llama_cpp import llama_decoder_for

    prompts = [chat(smol.tokenizer, p) for p in (PROMPT, "What is the capital of France?", "Write a haiku about rain.")]
    ar = llama_decoder_for("ar", smol)
    return prompts, [ar.generate(p, 48).tokens for p in prompts]


@pytest.mark.parametrize("method", METHODS)
def test_every_method_equals_this_engines_greedy_decoding(smol, smol_reference, method, cache_dir):
    from treegraft.llama_cpp import llama_decoder_for

    prompts, want = smol_reference
    dec = llama_decoder_for(method, smol, cache_dir=cache_dir)
    for ids, ref in zip(prompts, want):
        out = dec.generate(ids, 48)
        assert out.tokens == ref, f"{method} diverged from ar at token {next(i for i, (x, y) in enumerate(zip(out.tokens, ref)) if x != y)}"
        assert sum(t["accepted"] for t in out.turns) + len(out.turns) >= len(ref)


def test_a_drafter_on_stock_kernels_still_gives_the_targets_output(smol, smol_reference, cache_dir):
    """A middle drafter that disagrees with the target (the stock, batch-variant kernels) changes the
    drafts, never the output."""
    from treegraft.llama_cpp import LlamaPair, llama_decoder_for
    from treegraft.llama_cpp.engine import GGUFModel

    stock = GGUFModel(smol.middle.path, n_ctx=2048, n_seq=256, exact=False)
    pair = LlamaPair(smol.target, stock, smol.tokenizer)
    prompts, want = smol_reference
    dec = llama_decoder_for("all_mid", pair, cache_dir=cache_dir)
    for ids, ref in zip(prompts, want):
        assert dec.generate(ids, 48).tokens == ref


def test_the_targets_cache_after_many_turns_is_the_plain_decoding_of_the_text(smol, cache_dir):
    from treegraft.llama_cpp import llama_decoder_for

    ids = chat(smol.tokenizer, PROMPT)
    greedy = ids + llama_decoder_for("ar", smol).generate(ids, 40 + 64).tokens  # first: ar clears the target's cache
    dec = llama_decoder_for("all_mid", smol, cache_dir=cache_dir)
    out = dec.generate(ids, 40)
    assert len(out.turns) > 3
    # the last turn may accept more than max_new_tokens lets out: the cache holds every accepted token
    kept = len(ids) - 1 + sum(t["accepted"] + 1 for t in out.turns)
    assert dec.engine.context_len() == kept
    # the drafter's context is the same text (committed cells plus the tokens it has yet to encode)
    assert dec.middle.committed + len(dec.middle.pending) == kept
    text, root = greedy[:kept], greedy[kept]
    # the next root decoded on the kept cache equals the whole text decoded one token at a time (on the
    # middle drafter's context: the same file, exact, a cache of its own)
    got = dec.engine.step(root)
    assert torch.equal(got, one_token_logits(smol.middle, text + [root])[-1])


def test_drafter_snapshot_and_restore_branch_from_the_same_state(smol):
    from treegraft.llama_cpp.engine import LlamaCppDrafter
    from treegraft.tree import DraftTree, build_tree_inputs

    ids = chat(smol.tokenizer, PROMPT)
    drafter = LlamaCppDrafter(smol.middle)
    drafter.reset(ids)
    tree = DraftTree.with_root(ids[-1])
    a = tree.add_child(0, 100, -1.0, 0, 0)
    drafter.encode(tree, [0, a])
    snap = drafter.snapshot()
    first = drafter.logprobs[a].logp.clone()
    b = tree.add_child(a, 200, -1.0, 0, 0)
    drafter.encode(tree, [b])
    after_b = drafter.logprobs[b].logp.clone()
    drafter.restore(snap)
    assert b not in drafter.seq_of
    drafter.encode(tree, [b])  # encoded again from the restored state: the same cells, the same scores
    assert torch.equal(drafter.logprobs[b].logp, after_b)
    assert torch.equal(drafter.logprobs[a].logp, first)
    want = one_token_logits(smol.middle, ids + [100, 200])[-1]
    assert torch.equal(drafter.logprobs[b].logp, torch.log_softmax(want, dim=-1))


def test_speculative_sampling_on_llama_cpp_keeps_the_target_distribution(smol, cache_dir):
    from treegraft.llama_cpp import llama_decoder_for

    ids = smol.tokenizer("My favourite word is").input_ids  # a short prompt with a spread-out next token
    probs = target_distribution(one_token_logits(smol.target, ids)[-1], SamplingConfig(temperature=1.0))
    dec = llama_decoder_for("all_mid", smol, tree={"depth": 1, "top_m": 6, "budget": 8}, cache_dir=cache_dir,
                            sampling=SamplingConfig(temperature=1.0))
    samples = []
    for seed in range(600):
        dec.sampling.seed = seed  # each generate draws from a generator seeded afresh
        samples.append(dec.generate(ids, 1).tokens[0])
    assert chi_square_pvalue(samples, probs) > 1e-3
