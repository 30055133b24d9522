"""Tree invariants (a correctness bar): pruning is ancestor-closed and within budget, siblings are distinct,
retrieval paths match the mask. Property-based over random trees."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from treegraft.tree import SMALL, DraftTree, build_tree_inputs, prune_to_budget


@st.composite
def random_trees(draw):
    tree = DraftTree.with_root(draw(st.integers(0, 50)))
    for _ in range(draw(st.integers(0, 60))):
        parent = draw(st.integers(0, len(tree) - 1))
        token = draw(st.integers(0, 12))  # small vocabulary: duplicates are proposed often
        edge = draw(st.floats(-8.0, 0.0, allow_nan=False))
        tree.add_child(parent, token, edge, SMALL, 1)
    return tree


@settings(max_examples=200, deadline=None)
@given(random_trees(), st.integers(0, 70))
def test_pruning_is_ancestor_closed_and_within_budget(tree, budget):
    kept = prune_to_budget(tree, budget)
    assert len(kept) <= budget
    assert kept == sorted(set(kept)) and 0 not in kept
    kept_set = set(kept)
    for node in kept:
        assert tree.parent[node] == 0 or tree.parent[node] in kept_set
    # the budget is used: either everything fits or the kept set is full up to the last chain that did not fit
    if len(tree) - 1 <= budget:
        assert len(kept) == len(tree) - 1


@settings(max_examples=200, deadline=None)
@given(random_trees())
def test_siblings_have_distinct_tokens_and_cum_is_path_sum(tree):
    for node in range(len(tree)):
        tokens = [tree.token[c] for c in tree.children[node].values()]
        assert len(tokens) == len(set(tokens))
        for token, child in tree.children[node].items():
            assert tree.token[child] == token and tree.parent[child] == node
            assert tree.depth[child] == tree.depth[node] + 1
            assert abs(tree.cum[child] - (tree.cum[node] + tree.edge[child])) < 1e-9


@settings(max_examples=200, deadline=None)
@given(random_trees(), st.integers(1, 70), st.integers(0, 1000))
def test_inputs_mask_positions_and_paths_agree(tree, budget, context_len):
    kept = prune_to_budget(tree, budget)
    inp = build_tree_inputs(tree, kept, context_len)
    n = inp.size
    assert inp.tokens.shape == (n,) and inp.ancestor_mask.shape == (n, n)
    for row, node in enumerate(inp.node_ids):
        ancestors = {inp.node_ids.index(a) for a in tree.ancestors(node)}
        assert set(torch.nonzero(inp.ancestor_mask[row]).flatten().tolist()) == ancestors
        assert int(inp.position_ids[row]) == context_len + tree.depth[node]
        assert int(inp.tokens[row]) == tree.token[node]
    leaves = [r for r in range(n) if not inp.child_rows[r]]
    assert inp.retrieve_paths.shape[0] == len(leaves)
    for path in inp.retrieve_paths.tolist():
        rows = [r for r in path if r >= 0]
        leaf = rows[-1]
        assert set(rows) == set(torch.nonzero(inp.ancestor_mask[leaf]).flatten().tolist())
        assert rows[0] == 0 and all(inp.parent_row[b] == a for a, b in zip(rows, rows[1:]))


def test_pruning_prefers_high_cum_and_keeps_chains():
    tree = DraftTree.with_root(0)
    a = tree.add_child(0, 1, -0.1, SMALL, 1)
    b = tree.add_child(0, 2, -3.0, SMALL, 1)
    a1 = tree.add_child(a, 3, -0.2, SMALL, 2)
    a1x = tree.add_child(a1, 4, -0.1, SMALL, 3)
    assert prune_to_budget(tree, 3) == [a, a1, a1x]
    assert prune_to_budget(tree, 4) == [a, b, a1, a1x]
    assert tree.add_child(0, 1, -5.0, SMALL, 2) == a and tree.edge[a] == -0.1  # existing child kept as is


def test_subtree_removal_and_copy_are_independent():
    tree = DraftTree.with_root(0)
    a = tree.add_child(0, 1, -0.1, SMALL, 1)
    a1 = tree.add_child(a, 2, -0.1, SMALL, 2)
    b = tree.add_child(0, 3, -0.5, SMALL, 1)
    snapshot = tree.copy()
    removed = tree.remove_subtrees_below(0)
    assert sorted(removed) == [a, a1, b] and tree.num_alive == 1
    assert snapshot.num_alive == 4 and snapshot.children[0] == {1: a, 3: b}
