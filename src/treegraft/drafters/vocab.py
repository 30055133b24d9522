"""Restricted vocabularies for the drafters' LM heads (FR-Spec, Zhao et al. 2025).

A drafter's LM head over a 150k-token vocabulary costs a CPU as much as several decoder layers per
row. Drafts only need the tokens that are likely to be proposed: the K most frequent tokens of a
corpus, plus every token of the current context (so whatever the n-gram drafter proposes can be
scored, and copies are never out of reach). Verification always uses the target's full head, so
output stays lossless; only draft scores change (log-softmax over the subset, an upper bound of the
full log-probability).

The frequency corpus is built here, without a network: the Python standard library's own sources
(code, comments and docstrings) of the running interpreter, tokenized with the target's tokenizer.
Tokens that never occur there are ranked by id (byte-level BPE ids follow merge order, a proxy for
pre-training frequency).
"""

from __future__ import annotations

import hashlib
import sysconfig
from collections import Counter
from pathlib import Path

import torch

from ..atomic import atomic_torch_save

__all__ = ["frequent_tokens", "VocabSubset", "SubsetHead"]

_CORPUS_BYTES = 12_000_000


def _corpus_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "idlelib", "site-packages", "lib2to3"}
    files = sorted(p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts))
    return files


def _tokenizer_fingerprint(tokenizer) -> str:
    vocab = tokenizer.get_vocab()
    digest = hashlib.sha256("\n".join(f"{t}\t{i}" for t, i in sorted(vocab.items(), key=lambda kv: kv[1])).encode())
    return digest.hexdigest()[:16]


def frequent_tokens(tokenizer, k: int, vocab_size: int, cache_dir: str | Path | None = None) -> torch.Tensor:
    """The ``k`` most frequent token ids (LongTensor [k], most frequent first) of the stdlib corpus,
    ties and unseen tokens by id; cached per tokenizer in ``<cache_dir>/draft_vocab_<hash>.pt``."""
    k = min(int(k), int(vocab_size))
    cache = Path(cache_dir) / f"draft_vocab_{_tokenizer_fingerprint(tokenizer)}.pt" if cache_dir else None
    if cache is not None and cache.is_file():
        order = torch.load(cache)
    else:
        counts: Counter[int] = Counter()
        used = 0
        for path in _corpus_files():
            if used >= _CORPUS_BYTES:
                break
            text = path.read_text(errors="ignore")
            used += len(text)
            counts.update(tokenizer(text, add_special_tokens=False).input_ids)
        freq = torch.zeros(int(vocab_size), dtype=torch.long)
        for token, c in counts.items():
            if 0 <= token < vocab_size:
                freq[token] = c
        # most frequent first; among equal counts (unseen tokens included) the lower id first
        order = torch.argsort(-freq * (int(vocab_size) + 1) + torch.arange(int(vocab_size)), stable=True)
        if cache is not None:
            atomic_torch_save(order, cache)
    return order[:k].clone()


class VocabSubset:
    """A growing set of token ids with a dense position map.

    ``ids``: LongTensor [S] (insertion order); ``pos_of``: LongTensor [V] with the position of each
    id in ``ids`` or -1.
    """

    def __init__(self, base_ids: torch.Tensor, vocab_size: int):
        self.pos_of = torch.full((int(vocab_size),), -1, dtype=torch.long)
        self.ids = torch.zeros(0, dtype=torch.long)
        self.add(base_ids.tolist())

    def add(self, tokens) -> list[int]:
        """Add the ids not in the set yet; returns the new ones (in order)."""
        cand = torch.tensor(list(dict.fromkeys(int(t) for t in tokens)), dtype=torch.long)
        if not len(cand):
            return []
        new_ids = cand[self.pos_of[cand] < 0]
        if len(new_ids):
            self.pos_of[new_ids] = torch.arange(len(self.ids), len(self.ids) + len(new_ids))
            self.ids = torch.cat([self.ids, new_ids])
        return new_ids.tolist()

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` ids (drop what was added after them)."""
        self.pos_of[self.ids[n:]] = -1
        self.ids = self.ids[:n]

    def __len__(self) -> int:
        return len(self.ids)


class SubsetHead:
    """An LM head restricted to a :class:`VocabSubset`: logits ``[n, S]`` for hidden rows ``[n, H]``.

    Built from the model's dense head weight ``[V, H]`` (rows gathered once, in float32; rows of ids
    added later are appended). ``softcap`` reproduces Gemma's final logit soft-capping.
    """

    def __init__(self, weight: torch.Tensor, subset: VocabSubset, softcap: float | None = None):
        self.weight = weight
        self.subset = subset
        self.softcap = softcap
        self.rows = weight.index_select(0, subset.ids.to(weight.device)).float()

    def add(self, tokens) -> None:
        new = self.subset.add(tokens)
        if new:
            extra = self.weight.index_select(0, torch.tensor(new, device=self.weight.device)).float()
            self.rows = torch.cat([self.rows, extra])

    def truncate(self, n: int) -> None:
        """Back to the first ``n`` ids (e.g. the frequent base vocabulary, before a new prompt's tokens
        are added): the base rows are gathered once per decoder, not once per prompt."""
        self.subset.truncate(n)
        self.rows = self.rows[:n]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        out = torch.nn.functional.linear(hidden.float(), self.rows)
        if self.softcap is not None:
            out = torch.tanh(out / self.softcap) * self.softcap
        return out

    def log_softmax(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(self.logits(hidden), dim=-1)
