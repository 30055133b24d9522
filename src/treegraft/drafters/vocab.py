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
from ..devices import device_tensor

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
        freq = torch.zeros(int(vocab_size), dtype=torch.long, device="cpu")
        for token, c in counts.items():
            if 0 <= token < vocab_size:
                freq[token] = c
        # most frequent first; among equal counts (unseen tokens included) the lower id first
        order = torch.argsort(-freq * (int(vocab_size) + 1) + torch.arange(int(vocab_size), device="cpu"), stable=True)
        if cache is not None:
            atomic_torch_save(order, cache)
    return order[:k].clone()


class VocabSubset:
    """A growing set of token ids with a dense position map, on ``device``.

    ``ids``: LongTensor [S] (insertion order); ``pos_of``: LongTensor [V] with the position of each id
    in ``ids`` or -1; both on ``device``. The host keeps the same set as Python data (``id_list``,
    ``position``), so adding tokens never reads the device back.
    """

    def __init__(self, base_ids, vocab_size: int, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.vocab_size = int(vocab_size)
        self.id_list: list[int] = []
        self.position: dict[int, int] = {}
        self.ids = torch.zeros(0, dtype=torch.long, device=self.device)
        self.pos_of = torch.full((self.vocab_size,), -1, dtype=torch.long, device=self.device)
        self.add(base_ids.tolist() if isinstance(base_ids, torch.Tensor) else base_ids)

    def add(self, tokens) -> list[int]:
        """Add the ids not in the set yet (ids outside the vocabulary are ignored); returns the new ones."""
        new = [t for t in dict.fromkeys(int(t) for t in tokens) if t not in self.position and 0 <= t < self.vocab_size]
        if new:
            start = len(self.id_list)
            self.position.update((t, start + i) for i, t in enumerate(new))
            self.id_list += new
            new_ids = device_tensor(new, self.device)
            self.pos_of[new_ids] = torch.arange(start, start + len(new), device=self.device)
            self.ids = torch.cat([self.ids, new_ids])
        return new

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` ids (drop what was added after them)."""
        if n >= len(self.id_list):
            return
        self.pos_of[self.ids[n:]] = -1
        for t in self.id_list[n:]:
            del self.position[t]
        self.id_list, self.ids = self.id_list[:n], self.ids[:n]

    def __len__(self) -> int:
        return len(self.id_list)


class SubsetHead:
    """An LM head restricted to a :class:`VocabSubset`: logits ``[n, S]`` for hidden rows ``[n, H]``.

    Built from the model's dense head weight ``[V, H]`` (rows gathered once, in float32, onto the
    subset's device, which is the head's; rows of ids added later are appended). ``softcap``
    reproduces Gemma's final logit soft-capping.
    """

    def __init__(self, weight: torch.Tensor, subset: VocabSubset, softcap: float | None = None):
        self.weight = weight
        self.subset = subset
        self.softcap = softcap
        self.rows = self._gather(subset.id_list)

    def _gather(self, ids: list[int]) -> torch.Tensor:
        # the weight may sit elsewhere (an offloaded head): gather there, keep the rows on the subset's device
        rows = self.weight.index_select(0, device_tensor(ids, self.weight.device))
        return rows.to(self.subset.device).float()

    def add(self, tokens) -> None:
        new = self.subset.add(tokens)
        if new:
            self.rows = torch.cat([self.rows, self._gather(new)])

    def truncate(self, n: int) -> None:
        """Back to the first ``n`` ids (e.g. the frequent base vocabulary, before a new prompt's tokens
        are added): the base rows are gathered once per decoder, not once per prompt."""
        self.subset.truncate(n)
        self.rows = self.rows[:n]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        out = torch.nn.functional.linear(hidden.to(self.rows.device).float(), self.rows)
        if self.softcap is not None:
            out = torch.tanh(out / self.softcap) * self.softcap
        return out

    def log_softmax(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(self.logits(hidden), dim=-1)
