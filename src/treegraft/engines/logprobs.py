"""What a drafter hands the tree builders: log q(. | node) rows and their batched host readers.

Every engine's drafter (the PyTorch :class:`~treegraft.engines.torch.MiddleDrafter`, llama.cpp's
:class:`~treegraft.engines.llama_cpp.LlamaCppDrafter`) fills ``logprobs[node]`` with a
:class:`TokenLogProbs`; the builders read many nodes at once through :func:`scores`, :func:`topk` and
:func:`argmax_scores`, one host read per call.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..devices import device_tensor

__all__ = ["TokenLogProbs", "scores", "topk", "argmax_scores"]


class TokenLogProbs:
    """log q(. | node): row ``row`` of a log-probability matrix ``matrix`` computed for a batch of nodes,
    over the whole vocabulary (``ids`` None, ``matrix`` [R, V]) or over a subset (``matrix`` [R, S] for
    the token ids ``ids`` [S]; ``pos_of`` [V] maps a token to its column or -1, and a token outside
    scores the row's minimum); ``ids`` and ``pos_of`` live on the matrix's device.

    Nodes scored in one call share their matrix, so the batched readers :func:`scores`, :func:`topk` and
    :func:`argmax_scores` answer for many nodes with one host read; the methods below are the one-node
    forms (one read each)."""

    __slots__ = ("matrix", "row", "ids", "pos_of")

    def __init__(self, matrix: torch.Tensor, row: int = 0, ids: torch.Tensor | None = None,
                 pos_of: torch.Tensor | None = None):
        self.matrix, self.row, self.ids, self.pos_of = (matrix if matrix.dim() == 2 else matrix[None]), row, ids, pos_of

    @property
    def logp(self) -> torch.Tensor:
        """The row itself, [V] or [S]."""
        return self.matrix[self.row]

    def topk(self, m: int) -> tuple[list[float], list[int]]:
        """The ``m`` best (log-probability, token) pairs, best first."""
        return topk([self], m)[0]

    def score(self, token: int) -> float:
        return scores([(self, token)])[0]

    def argmax(self) -> int:
        return argmax_scores([self])[0][0]


def _by_matrix(items: Sequence[TokenLogProbs]) -> list[tuple[TokenLogProbs, list[int]]]:
    """The items grouped by the matrix they index: (a representative, positions in ``items``)."""
    groups: dict[int, tuple[TokenLogProbs, list[int]]] = {}
    for i, lp in enumerate(items):
        groups.setdefault(id(lp.matrix), (lp, []))[1].append(i)
    return list(groups.values())


def _read(parts: list[torch.Tensor], order: list[int], n: int) -> list:
    """One host read of every group's rows (float64: token ids and float32 scores are exact in it), put
    back in the items' order."""
    device = parts[0].device
    flat = torch.cat([p.to(device, torch.float64) for p in parts]).tolist()
    out: list = [None] * n
    for i, row in zip(order, flat):
        out[i] = row
    return out


def scores(pairs: Sequence[tuple[TokenLogProbs, int]]) -> list[float]:
    """log q(token | node) for every (node's :class:`TokenLogProbs`, token) pair, in one host read."""
    if not pairs:
        return []
    parts, order = [], []
    for lp, idx in _by_matrix([p for p, _ in pairs]):
        matrix = lp.matrix
        rows = device_tensor([pairs[i][0].row for i in idx], matrix.device)
        tokens = device_tensor([pairs[i][1] for i in idx], matrix.device)
        if lp.ids is None:
            values = matrix[rows, tokens]
        else:
            pos = lp.pos_of[tokens]
            values = torch.where(pos >= 0, matrix[rows, pos.clamp(min=0)], matrix.amin(dim=-1)[rows])
        parts.append(values)
        order += idx
    return _read(parts, order, len(pairs))


def topk(items: Sequence[TokenLogProbs], m: int) -> list[tuple[list[float], list[int]]]:
    """Each node's ``m`` best (log-probabilities, tokens), best first, in one host read."""
    if not items:
        return []
    parts, order, ks = [], [], {}
    for lp, idx in _by_matrix(items):
        matrix = lp.matrix
        k = min(int(m), matrix.shape[-1])
        # row by row on views of the matrix (a gathered copy of full-vocabulary rows costs more than the topk)
        values, cols = (torch.stack(t) for t in zip(*(matrix[items[i].row].topk(k) for i in idx)))
        tokens = cols if lp.ids is None else lp.ids[cols]
        parts.append(torch.cat([values.double(), tokens.double()], dim=1))
        order += idx
        ks.update((i, k) for i in idx)
    width = 2 * max(ks.values())
    rows = _read([torch.nn.functional.pad(p, (0, width - p.shape[1])) for p in parts], order, len(items))
    return [(row[: ks[i]], [int(t) for t in row[ks[i] : 2 * ks[i]]]) for i, row in enumerate(rows)]


def argmax_scores(items: Sequence[TokenLogProbs]) -> list[tuple[int, float]]:
    """Each node's most likely token and its log-probability (the first of equals), in one host read."""
    if not items:
        return []
    parts, order = [], []
    for lp, idx in _by_matrix(items):
        matrix = lp.matrix
        values, cols = (torch.stack(t) for t in zip(*(matrix[items[i].row].max(dim=-1) for i in idx)))
        tokens = cols if lp.ids is None else lp.ids[cols]
        parts.append(torch.stack([tokens.double(), values.double()], dim=1))
        order += idx
    return [(int(t), v) for t, v in _read(parts, order, len(items))]
