"""Batch invariance, checked: a chain or a tree verified in one batch gives every row the logits of the
same tokens decoded one at a time, bit for bit (what makes every method's greedy output equal ``ar``).

Used by the test suite on SmolLM2 and by ``scripts/bench_llama_engine.py --check-exact`` on any pair.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from ...tree import DraftTree, build_tree_inputs
from .model import GGUFModel
from .target import LlamaCppTarget

__all__ = ["InvarianceResult", "batch_invariance", "one_token_logits", "ar_logits"]


def one_token_logits(model: GGUFModel, tokens: list[int]) -> list[torch.Tensor]:
    """Each token decoded alone after its prefix, from a cleared cache, every one in exact kernels."""
    model.clear()
    out = []
    for pos, tok in enumerate(tokens):
        model.decode([tok], [pos], [[0]], [True])
        out.append(model.logits(0))
    return out


def ar_logits(model: GGUFModel, prompt: list[int], continuation: list[int]) -> list[torch.Tensor]:
    """This engine's ``ar``: the prompt prefilled as the target engine does it (all but its last
    token), then ``prompt[-1]`` and each continuation token decoded alone; their logits."""
    engine = LlamaCppTarget(model)
    engine.prefill(prompt, 1, None)
    return [engine.step(t) for t in [prompt[-1], *continuation]]


class _Reference:
    """One-token decoding on a second context of the same file, its prefix prefilled as the engine does."""

    def __init__(self, model: GGUFModel, prefix: list[int]):
        self.model, self.n = model, len(prefix)
        LlamaCppTarget(model).prefill([*prefix, 0], 1, None)  # encodes prefix (a prompt's last token is the root)

    def tree(self, tree: DraftTree) -> list[torch.Tensor]:
        """Logits of every node after the prefix + its root-to-node path, each token decoded alone: depth
        first, a node's cells dropped when its subtree is done (every path sits in contiguous cells)."""
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


@dataclass
class InvarianceResult:
    kind: str  # chain | tree
    size: int
    context: int
    rows: int
    exact_rows: int
    max_abs_diff: float
    argmax_flips: int


def batch_invariance(model: GGUFModel, reference: GGUFModel, context: int, sizes=(2, 4, 8, 16, 32, 64),
                     chain_up_to: int = 8, seed: int = 0) -> list[InvarianceResult]:
    """``model`` (as the target engine) prefills ``context`` random tokens, then verifies a chain (sizes
    <= ``chain_up_to``) or a random tree of each size in one batch, rolled back after each; every row is
    compared with ``reference`` (a second context of the same file) decoding the same path one token
    at a time."""
    rng = random.Random(seed * 1000 + context)
    prefix = [rng.randrange(model.n_vocab) for _ in range(context)]
    ref = _Reference(reference, prefix)
    engine = LlamaCppTarget(model)
    root = rng.randrange(model.n_vocab)
    engine.prefill(prefix + [root], 1, None)
    results = []
    for n in sizes:
        tree = DraftTree.with_root(root)
        chain = n <= chain_up_to
        for i in range(1, n):
            tree.add_child(i - 1 if chain else rng.randrange(i), rng.randrange(model.n_vocab), -1.0, 0, 0)
        rows = engine.forward_tree(build_tree_inputs(tree, list(range(1, len(tree))), context))
        got = rows.logits(list(range(len(tree))))
        want = ref.tree(tree)
        diffs = [float((g - w).abs().max()) for g, w in zip(got, want)]
        results.append(InvarianceResult(
            "chain" if chain else "tree", n, context, len(tree), sum(torch.equal(g, w) for g, w in zip(got, want)),
            max(diffs), sum(int(g.argmax() != w.argmax()) for g, w in zip(got, want))))
        engine.rollback(context)
    return results
