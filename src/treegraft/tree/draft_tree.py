"""The draft tree: array-backed nodes shared by every drafter of a turn.

Node 0 is the root: the last emitted token, not yet in any KV cache. Every other node is a draft
token proposed under its parent. Per node we keep (one Python list per field, indexed by node id):

=============  =====================================================================
``token``      token id
``parent``     parent node id (-1 for the root)
``depth``      0 for the root, parent depth + 1 otherwise
``creator``    which drafter created it: ``ROOT``, ``SMALL`` (the small drafter), ``COPY_CHAIN`` (the n-gram
               drafter's copy chain under the root) or ``MIDDLE``
``step``       drafting step (1..D) that created it; 0 for the root
``edge``       log-score of the node's token given its parent's prefix
``cum``        path score: sum of ``edge`` from the root (root = 0)
``visited``    whether the middle drafter has expanded it (``visited_mid`` in the spec)
``alive``      False once removed by destructive grafting (ids are never reused)
``children``   dict token -> child id (a token occurs at most once among siblings)
``kept``       provenance of non-destructive grafting: 1 + the index in ``grafts`` of the graft that kept
               this node's branch (the node is the root of a kept branch), 0 otherwise
=============  =====================================================================

``grafts`` lists the turn's non-destructive grafts that kept something, one
``(grafted_under, step, kept_roots)`` tuple each (:meth:`note_graft`): a middle step grafted new children
under ``grafted_under``, a node that already had children, and kept the branches rooted at ``kept_roots``
that destructive grafting would have deleted. Those include what the same step's later grafts add below
``grafted_under``'s old subtree (:meth:`note_graft_below`): destructive grafting has deleted those grafts'
nodes by then and skips them, so their children are never built (a re-proposed child comes back as a new,
unselected node, grafted under one middle step later if at all). A node lies on a kept branch iff it or an
ancestor has ``kept`` set (nodes added under a kept branch later exist only because it was kept).

Node ids are creation order, so "ties broken by creation order" is "ties broken by id".
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["ROOT", "SMALL", "MIDDLE", "COPY_CHAIN", "CREATOR_NAMES", "DraftTree"]

ROOT, SMALL, MIDDLE, COPY_CHAIN = -1, 0, 1, 2
CREATOR_NAMES = {ROOT: "root", SMALL: "small", MIDDLE: "middle", COPY_CHAIN: "copy"}


@dataclass
class DraftTree:
    """An append-only tree of draft tokens (see the module docstring for the fields)."""

    token: list[int] = field(default_factory=list)
    parent: list[int] = field(default_factory=list)
    depth: list[int] = field(default_factory=list)
    creator: list[int] = field(default_factory=list)
    step: list[int] = field(default_factory=list)
    edge: list[float] = field(default_factory=list)
    cum: list[float] = field(default_factory=list)
    visited: list[bool] = field(default_factory=list)
    alive: list[bool] = field(default_factory=list)
    children: list[dict[int, int]] = field(default_factory=list)
    kept: list[int] = field(default_factory=list)
    grafts: list[tuple[int, int, tuple[int, ...]]] = field(default_factory=list)

    @classmethod
    def with_root(cls, root_token: int) -> "DraftTree":
        tree = cls()
        tree._append(int(root_token), -1, 0, ROOT, 0, 0.0, 0.0)
        return tree

    def __len__(self) -> int:
        """Number of node ids ever created (dead ones included)."""
        return len(self.token)

    @property
    def num_alive(self) -> int:
        return sum(self.alive)

    def _append(self, token: int, parent: int, depth: int, creator: int, step: int, edge: float, cum: float) -> int:
        node = len(self.token)
        self.token.append(token)
        self.parent.append(parent)
        self.depth.append(depth)
        self.creator.append(creator)
        self.step.append(step)
        self.edge.append(edge)
        self.cum.append(cum)
        self.visited.append(False)
        self.alive.append(True)
        self.children.append({})
        self.kept.append(0)
        return node

    def add_child(self, parent: int, token: int, edge: float, creator: int, step: int) -> int:
        """Add ``token`` under ``parent``; if that token is already a child, return the existing node unchanged."""
        existing = self.children[parent].get(token)
        if existing is not None:
            return existing
        node = self._append(token, parent, self.depth[parent] + 1, creator, step, edge, self.cum[parent] + edge)
        self.children[parent][token] = node
        return node

    def alive_nodes(self) -> list[int]:
        return [i for i, a in enumerate(self.alive) if a]

    def nodes_created_at(self, step: int) -> list[int]:
        return [i for i, (s, a) in enumerate(zip(self.step, self.alive)) if s == step and a and i != 0]

    def path_tokens(self, node: int) -> list[int]:
        """Tokens from the root's first child down to ``node`` (the root's own token excluded)."""
        out = []
        while node > 0:
            out.append(self.token[node])
            node = self.parent[node]
        out.reverse()
        return out

    def ancestors(self, node: int) -> list[int]:
        """Ids from the root down to ``node``, both included."""
        out = []
        while node >= 0:
            out.append(node)
            node = self.parent[node]
        out.reverse()
        return out

    def closure_missing(self, nodes, have) -> list[int]:
        """``nodes`` and their ancestors that are not in ``have`` (a drafter's encoded nodes), in id
        order (parents first): what a drafter must encode to score ``nodes``."""
        todo: set[int] = set()
        for node in nodes:
            n = node
            while n >= 0 and n not in have and n not in todo:
                todo.add(n)
                n = self.parent[n]
        return sorted(todo)

    def subtree(self, node: int) -> list[int]:
        """``node`` and every alive descendant, parents before children."""
        out, stack = [], [node]
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(self.children[n].values())
        return out

    def remove_subtrees_below(self, node: int) -> list[int]:
        """Delete every descendant of ``node`` (destructive grafting); returns the removed ids."""
        removed = []
        for child in list(self.children[node].values()):
            for n in self.subtree(child):
                self.alive[n] = False
                removed.append(n)
        self.children[node] = {}
        return removed

    def recompute_cum(self, start: int = 0) -> None:
        """Recompute ``cum`` top-down below ``start`` from the current ``edge`` values."""
        stack = [start]
        while stack:
            n = stack.pop()
            base = self.cum[n]
            for child in self.children[n].values():
                self.cum[child] = base + self.edge[child]
                stack.append(child)

    def copy(self) -> "DraftTree":
        """An independent copy (for enumerating schedules that share a prefix)."""
        return DraftTree(
            token=list(self.token), parent=list(self.parent), depth=list(self.depth), creator=list(self.creator),
            step=list(self.step), edge=list(self.edge), cum=list(self.cum), visited=list(self.visited),
            alive=list(self.alive), children=[dict(c) for c in self.children], kept=list(self.kept),
            grafts=list(self.grafts),
        )

    # ------------------------------------------------------------------ grafting provenance
    def note_graft(self, node: int, step: int, existing: dict[int, int], proposed) -> tuple[int, ...]:
        """Record a non-destructive graft under ``node`` at ``step``: ``existing`` are its children (token ->
        id) before the graft, ``proposed`` the tokens the middle drafter proposed there. A child whose token
        was not proposed is a kept branch (destructive grafting deletes it and never brings it back); a
        re-proposed child would be re-added by destructive grafting without its subtree, so its own
        children are the kept branches. Returns the kept roots (the event is recorded only if there are any)."""
        proposed = set(proposed)
        roots: list[int] = []
        for token, child in existing.items():
            if not self.alive[child]:
                continue
            if token in proposed:
                roots.extend(c for c in self.children[child].values() if self.alive[c])
            else:
                roots.append(child)
        if roots:
            self.grafts.append((node, int(step), tuple(roots)))
            for n in roots:
                if not self.kept[n]:  # the first graft that kept it
                    self.kept[n] = len(self.grafts)
        return tuple(roots)

    def note_graft_below(self, above: int, step: int, node: int, added) -> tuple[int, ...]:
        """Record that ``node``'s graft at ``step`` added the children ``added`` after a graft under its
        ancestor ``above`` earlier in the same step: destructive grafting deleted ``node`` with ``above``'s
        old subtree and skips this graft, so ``added`` exist only because grafting was non-destructive. They
        become kept branches of ``above``'s graft (its event, or a new one), unless ``node`` already lies on a
        kept branch (then they do already). Returns the kept roots recorded."""
        if self.first_kept(self.ancestors(node)) is not None:
            return ()
        roots = tuple(c for c in added if self.alive[c] and not self.kept[c])
        if not roots:
            return ()
        index = next((i for i in range(len(self.grafts) - 1, -1, -1) if self.grafts[i][:2] == (above, step)), None)
        if index is None:
            self.grafts.append((above, int(step), roots))
            index = len(self.grafts) - 1
        else:
            self.grafts[index] = (above, int(step), self.grafts[index][2] + roots)
        for n in roots:
            self.kept[n] = index + 1
        return roots

    def first_kept(self, path_nodes: list[int]) -> int | None:
        """Index in ``path_nodes`` (a root-down path: the root, then accepted nodes) of its first node on a
        kept branch, None if none: the path's nodes from there on exist only because grafting kept them."""
        kept = self.kept
        return next((i for i, n in enumerate(path_nodes) if kept[n]), None)
