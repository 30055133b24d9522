"""The llama.cpp engine on SmolLM2's GGUF: the patched build, batch invariance (a token's logits in a chain
or a tree equal the same token decoded alone, bit for bit, at KV lengths below and above 512 cells, and
the stock kernels caught differing), keep / rollback, the KV state after many turns, snapshot / restore.
Every method's output and the sampling test: test_llama_cpp_methods.py."""

from __future__ import annotations

import os

import pytest
import torch

from treegraft.engines.llama_cpp.build import installed_build, patch_id
from treegraft.engines.llama_cpp.check import ar_logits, batch_invariance, one_token_logits


def _require_llama_cpp():
    if installed_build() is None:
        message = "llama-cpp-python with treegraft's patch is not installed: run `make llamacpp`"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)


@pytest.fixture(scope="module")
def cache_dir():
    """The session's cache (TREEGRAFT_CACHE, a temporary folder): the engine's cost curve and SmolLM2's
    frequent tokens are measured once per test worker, for every llama.cpp test and the pipeline's."""
    from treegraft.paths import default_cache_dir

    return default_cache_dir()


def chat(tokenizer, text: str) -> list[int]:
    from treegraft.data import format_prompt

    return tokenizer(format_prompt(tokenizer, text), add_special_tokens=False).input_ids


@pytest.fixture(scope="module")
def smol():
    """SmolLM2-135M on llama.cpp (exact) as target, the same file as middle drafter, and its tokenizer."""
    from .conftest import require_embedded

    _require_llama_cpp()
    require_embedded("smollm2-135m")
    from treegraft.engines.llama_cpp import load_llama_pair

    return load_llama_pair("embedded:smollm2-135m", "embedded:smollm2-135m", n_ctx=2048)


PROMPT = "Write a Python function that returns the n-th Fibonacci number, then explain how it works."


def test_the_installed_build_is_the_patched_one():
    _require_llama_cpp()
    stamp = installed_build()
    assert stamp["patch_id"] == patch_id(), "the installed llama-cpp-python predates the current patch: make llamacpp"
    assert stamp["version"] == "0.3.36"


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K", "Q8_0", "Q5_0", "Q4_1"])
def test_batch_invariant_products_give_every_column_the_bits_of_a_batch_of_one(type_name):
    """The batch-invariant matrix product takes other kernels at other column counts (for the K-quants: one
    column at a time for 1-2, 4 columns x 2 rows in SIMD lanes for 3-4 (5 rows: one pairs with itself),
    8 columns in lanes for 5-16; a shared weight row for the others);
    every output must be bit for bit the one-column result (random rows, widths with partial blocks of
    super-blocks, every column-count regime), and that result must be ggml's vec_dot up to float rounding.
    Qwen's Q4_K / Q6_K are checked here because CI's model (SmolLM2) has none."""
    import platform

    _require_llama_cpp()
    from treegraft.engines.llama_cpp.model import multicol_check

    block = 256 if type_name.endswith("_K") else 32
    results = {(n, nc): multicol_check(type_name, n, rows=5, columns=nc, seed=n + nc)
               for n in (block, 6 * block, 35 * block if block == 256 else 70 * block)
               for nc in (1, 2, 3, 4, 5, 7, 8, 9, 16)}
    if all(r is None for r in results.values()):
        assert platform.machine().lower() not in ("x86_64", "amd64") or not _has_avx2(), "no multi-column kernel on an AVX2 CPU"
        pytest.skip("no multi-column kernel on this CPU (vec_dot per column)")
    assert {key: r[0] for key, r in results.items()} == {key: 0 for key in results}
    worst = max(r[1] for r in results.values())
    assert worst < 1e-5, f"{type_name}: {worst:.2e} of the rms away from vec_dot"
    if type_name.endswith("_K"):  # its own float order: close to vec_dot, not equal everywhere
        assert worst > 0.0


def _has_avx2() -> bool:
    try:
        return " avx2" in open("/proc/cpuinfo").read()
    except OSError:
        return False


@pytest.mark.parametrize("context", [40, 530])  # KV below and above 512 cells (flash attention's split-KV path)
def test_chains_and_trees_in_one_batch_equal_one_token_decoding(smol, context):
    """The target prefills in batches of up to 512 rows, then verifies chains of 2..8 and random trees of
    16..64 rows in one batch each; every row's logits equal the same tokens decoded one at a time, bit
    for bit (the reference runs on the middle drafter's context: the same file, a cache of its own)."""
    results = batch_invariance(smol.target, smol.middle, context)
    assert [r.size for r in results] == [2, 4, 8, 16, 32, 64]
    for r in results:
        assert r.exact_rows == r.rows, f"{r.kind} of {r.size} after {context} cells: {r.rows - r.exact_rows} rows " \
                                       f"not bit-identical (max diff {r.max_abs_diff:.3g})"


def test_the_check_sees_the_stock_kernels_differ(smol):
    """The same check on the stock fast kernels (repacked weights, tiled and split-KV paths) finds rows
    that differ: the check can fail, and the exact mode is what makes it pass."""
    from treegraft.engines.llama_cpp import GGUFModel

    stock, stock_reference = (GGUFModel(smol.target.path, n_ctx=2048, n_seq=256, exact=False) for _ in range(2))
    results = batch_invariance(stock, stock_reference, 40)
    assert sum(r.rows - r.exact_rows for r in results) > 0


def test_keep_moves_the_accepted_path_into_the_context(smol):
    """After keep(), decoding the next token gives the logits of the accepted text decoded plainly."""
    from treegraft.engines.llama_cpp import LlamaCppTarget
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
    want = ar_logits(smol.middle, ids, [200, 300, 500])[-1]  # this engine's ar, on a context of its own
    assert torch.equal(got, want)
    engine.rollback(L)
    assert engine.context_len() == L
    assert torch.equal(engine.step(ids[-1]), ar_logits(smol.middle, ids, [])[-1])


def test_the_targets_cache_after_many_turns_is_the_plain_decoding_of_the_text(smol, cache_dir):
    from treegraft.front import decoder_for

    ids = chat(smol.tokenizer, PROMPT)
    greedy = ids + decoder_for("ar", smol).generate(ids, 24 + 20).tokens  # first: ar clears the target's cache
    dec = decoder_for("all_mid", smol, {"auto_max_budget": 15}, cache_dir=cache_dir)
    out = dec.generate(ids, 24)
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
    assert torch.equal(got, ar_logits(smol.middle, ids, text[len(ids):] + [root])[-1])


def test_a_full_cache_is_re_encoded_without_changing_the_output(smol, cache_dir):
    """With few KV cells the buried tree cells run out and the target re-encodes its context (the
    prompt's batches replayed as prefill ran them, the rest in exact batches) every few turns: the
    output stays this engine's ar."""
    from treegraft.engines.llama_cpp import LlamaPair
    from treegraft.front import decoder_for
    from treegraft.engines.llama_cpp import GGUFModel

    ids = chat(smol.tokenizer, PROMPT)
    want = decoder_for("ar", smol).generate(ids, 48).tokens
    # room for the text and one tree beyond it (the window is n_ctx - 128); 33 rows verified a turn
    small = GGUFModel(smol.target.path, n_ctx=len(ids) + 48 + 136, n_seq=64, threads=smol.target.threads)
    clears = []
    plain_clear = small.clear
    small.clear = lambda: (clears.append(small.used), plain_clear())
    dec = decoder_for("all_mid", LlamaPair(small, smol.middle, smol.tokenizer), tree={"budget": 32},
                            cache_dir=cache_dir)
    out = dec.generate(ids, 48)
    assert out.tokens == want
    assert len(clears) >= 2, f"expected a re-encode (clears of a used cache at {clears})"  # prefill + 1 or more


def _drafter_with_one_node(model, ids):
    """A drafter on ``model`` reset to ``ids`` (all in exact kernels, so scores compare with one-token
    decoding) and a tree of the root and one child ``a`` (token 100), both encoded."""
    from treegraft.engines.llama_cpp import LlamaCppDrafter
    from treegraft.tree import DraftTree

    drafter = LlamaCppDrafter(model)
    drafter.fast_rows = len(ids)
    drafter.reset(ids)
    tree = DraftTree.with_root(ids[-1])
    a = tree.add_child(0, 100, -1.0, 0, 0)
    drafter.encode(tree, [0, a])
    return drafter, tree, a


def test_a_drafter_whose_turn_fills_the_cache_re_encodes_its_context(smol):
    """Schedule enumeration encodes and buries a turn's nodes 2^D times; on a long prompt the drafter's
    cells ran out within a turn ("KV cache full: 31 rows with 30 of 4096 cells free"). It now clears its
    cache and re-encodes the context when a call would not fit, snapshots taken before still restore,
    and every score is the one-token decoding's."""
    from treegraft.engines.llama_cpp import GGUFModel

    ids = chat(smol.tokenizer, PROMPT)
    small = GGUFModel(smol.middle.path, n_ctx=len(ids) + 24, n_seq=64, threads=smol.middle.threads)
    drafter, tree, a = _drafter_with_one_node(small, ids)
    snap = drafter.snapshot()
    b = tree.add_child(a, 200, -1.0, 0, 0)
    scores = []
    for _ in range(40):  # each branch takes a cell that only a clear gives back
        drafter.encode(tree, [b])
        scores.append(drafter.logprobs[b].logp.clone())
        drafter.restore(snap)
    assert drafter.epoch >= 1
    want = torch.log_softmax(one_token_logits(smol.middle, ids + [100, 200])[-1], dim=-1)
    assert all(torch.equal(x, want) for x in scores)
    drafter.encode(tree, [a])
    assert torch.equal(drafter.logprobs[a].logp, torch.log_softmax(one_token_logits(smol.middle, ids + [100])[-1], dim=-1))


def test_drafter_snapshot_and_restore_branch_from_the_same_state(smol):
    ids = chat(smol.tokenizer, PROMPT)
    drafter, tree, a = _drafter_with_one_node(smol.middle, ids)
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
