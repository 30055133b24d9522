"""llama.cpp as TreeGraft's engine: the target and the middle drafter run from their GGUF files through
llama-cpp-python's low-level API.

A draft tree is verified in one ``llama_decode``. Every tree row carries the seq ids of the leaves below
it (one seq per root-to-leaf path, the committed context copied to each leaf's seq first, unified KV),
so llama.cpp's own attention mask gives each row its context plus its ancestors, at position committed
length + depth. Keeping the accepted path moves its cells into seq 0 (``seq_cp`` over the path's
positions) and drops the leaf seqs; a rejected tree is dropped whole.

The middle drafter's tree grows call by call, so it gives every encoded node a seq of its own: a new
node's seq starts as a copy of its nearest encoded ancestor's seq (the context and that ancestor's
path), and the node's cell also carries the seqs of its new descendants in the same batch.

``exact=True`` (the default) runs the patched ggml's batch-invariant mode
(:mod:`treegraft.llama_cpp.build`) and loads weights without repacking: a token's logits are then the
same bit for bit whether it is decoded alone or in a tree, so every method's greedy output equals this
engine's own one-token decoding. ``exact=False`` runs the stock fast kernels (outputs equal up to
batch rounding).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..devices import Clock
from ..drafters.middle import TokenLogProbs
from ..tree import DraftTree, TreeInputs
from ..devices import now

__all__ = ["GGUFModel", "LlamaCppTarget", "LlamaCppDrafter", "LlamaCppError", "PromptReuse", "set_batch_invariant",
           "multicol_check"]


class LlamaCppError(RuntimeError):
    pass


def _llama():
    try:
        import llama_cpp
    except ImportError:
        raise LlamaCppError("llama-cpp-python is not installed: run `make llamacpp` (builds it from source)") from None
    return llama_cpp


_LOG_CB = None
_SWITCH = None


def _quiet(lib) -> None:
    """llama.cpp's log lines off (errors surface as return codes)."""
    global _LOG_CB
    if _LOG_CB is None:
        _LOG_CB = lib.llama_log_callback(lambda level, text, user: None)
        lib.llama_log_set(_LOG_CB, ctypes.c_void_p(0))
        lib.llama_backend_init()


def _ggml_cpu(symbol: str):
    """A function of the patched ggml CPU backend that libllama loaded, found by its soname (a wheel holds
    no symlinks: libggml-cpu.so is another file, and loading it by path would give a second, unused copy)."""
    import os

    _llama().llama_cpp  # loads libllama and, through it, the ggml CPU backend
    try:
        handle = ctypes.CDLL("libggml-cpu.so.0", mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        return getattr(handle, symbol)
    except (OSError, AttributeError):
        raise LlamaCppError("the installed llama-cpp-python lacks treegraft's batch-invariance patch: "
                            "run `make llamacpp` (builds the patched source)") from None


def set_batch_invariant(on: bool) -> None:
    """The patched ggml's process-wide batch-invariant switch (see :mod:`treegraft.llama_cpp.build`)."""
    global _SWITCH
    if _SWITCH is None:
        _SWITCH = _ggml_cpu("ggml_cpu_set_batch_invariant")
        _SWITCH.argtypes = [ctypes.c_bool]
    _SWITCH(bool(on))


# ggml type ids (ggml.h) of the weight types with a batch-invariant product
GGML_TYPES = {"Q4_1": 3, "Q5_0": 6, "Q8_0": 8, "Q4_K": 12, "Q6_K": 14}


def multicol_check(type_name: str, n: int, rows: int, columns: int, seed: int = 0) -> tuple[int, float] | None:
    """The batch-invariant matrix product of ``type_name`` on ``rows`` random weight rows of ``n`` values and
    ``columns`` random activation columns: (outputs whose bits differ from the same product one column at a
    time, its largest distance from ggml's ``vec_dot`` over the rms of vec_dot's results); None when this
    CPU has no such product for the type (the engine then calls vec_dot per column)."""
    if type_name not in GGML_TYPES:
        raise ValueError(f"unknown ggml type {type_name!r}; expected one of {', '.join(GGML_TYPES)}")
    check = _ggml_cpu("ggml_cpu_treegraft_multicol_check")
    check.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_uint32,
                      ctypes.POINTER(ctypes.c_float)]
    check.restype = ctypes.c_int
    deviation = ctypes.c_float(0.0)
    out = check(GGML_TYPES[type_name], n, rows, columns, seed, ctypes.byref(deviation))
    if out == -2:
        raise LlamaCppError(f"multi-column check on {type_name}: every product was 0 (the CPU backend is not initialised)")
    return None if out == -1 else (out, float(deviation.value))


@dataclass
class GGUFModel:
    """One GGUF file loaded into llama.cpp with one context (its KV cache), ``threads`` threads."""

    path: str
    n_ctx: int = 4096
    n_seq: int = 64  # seq ids: 0 = the committed context, the rest for tree paths / nodes
    threads: int = 1
    exact: bool = True
    n_batch: int = 512

    def __post_init__(self):
        if self.n_batch < self.n_seq:  # llama.cpp reserves an output row per sequence and aborts the process
            raise ValueError(f"n_batch {self.n_batch} is below n_seq {self.n_seq}: llama.cpp needs n_batch >= n_seq")
        lib = self.lib = _llama()
        _quiet(lib)
        if not Path(self.path).is_file():
            raise FileNotFoundError(f"GGUF file not found: {self.path}")
        mparams = lib.llama_model_default_params()
        mparams.use_extra_bufts = not self.exact  # repacked weights take batch-size-dependent kernels
        self.model = lib.llama_model_load_from_file(str(self.path).encode(), mparams)
        if not self.model:
            raise LlamaCppError(f"llama.cpp could not load {self.path}")
        cparams = lib.llama_context_default_params()
        cparams.n_ctx = self.n_ctx
        cparams.n_batch = cparams.n_ubatch = self.n_batch  # a tree is one ubatch
        cparams.n_seq_max = self.n_seq
        cparams.kv_unified = True
        cparams.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_ENABLED
        cparams.n_threads = cparams.n_threads_batch = self.threads
        cparams.no_perf = True
        self.ctx = lib.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            raise LlamaCppError(f"llama.cpp could not create a context for {self.path} (n_ctx {self.n_ctx})")
        self.mem = lib.llama_get_memory(self.ctx)
        self.vocab = lib.llama_model_get_vocab(self.model)
        self.n_vocab = lib.llama_vocab_n_tokens(self.vocab)
        self.batch = lib.llama_batch_init(self.n_batch, 0, self.n_seq)

        self.used = 0  # cells taken since the last clear (never freed before it: see bury)
        self.prompt_reuse: PromptReuse | None = None  # off: every prefill encodes its prompt

    def save_seq0(self) -> ctypes.Array:
        """seq 0's cells (tokens, positions, K and V) as llama.cpp serialises them."""
        size = self.lib.llama_state_seq_get_size(self.ctx, 0)
        buf = (ctypes.c_uint8 * size)()
        if self.lib.llama_state_seq_get_data(self.ctx, buf, size, 0) != size:
            raise LlamaCppError(f"llama.cpp could not save seq 0 ({size} bytes)")
        return buf

    def load_seq0(self, state: ctypes.Array, cells: int) -> None:
        """``state`` (:meth:`save_seq0`) into a cleared cache: its ``cells`` cells become cells 0.. in order."""
        if self.used:
            raise LlamaCppError("load_seq0 needs a cleared cache")
        if self.lib.llama_state_seq_set_data(self.ctx, state, len(state), 0) != len(state):
            raise LlamaCppError(f"llama.cpp could not restore seq 0 ({len(state)} bytes, {cells} cells)")
        self.used = cells

    @property
    def grave(self) -> int:
        """The seq that holds buried cells (never a query's seq, so never attended to)."""
        return self.n_seq - 1

    def free_cells(self) -> int:
        return self.n_ctx - self.used

    def clear(self) -> None:
        self.lib.llama_memory_clear(self.mem, True)
        self.used = 0

    def bury(self, seq: int, p0: int = -1) -> None:
        """Take ``seq`` off its cells from position ``p0`` on, leaving the cells taken.

        Attention reduces over KV cells in cell order, so a token's logits are those of contiguous
        decoding only while its context sits in cells of increasing position. A freed cell would be
        refilled by a later token, behind cells of higher positions; a buried one never is: every new
        cell comes after all the others until :meth:`clear`."""
        self.seq_cp(seq, self.grave, p0, -1)
        self.seq_rm(seq, p0, -1)

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        self.lib.llama_memory_seq_cp(self.mem, src, dst, p0, p1)

    def seq_rm(self, seq: int, p0: int = -1, p1: int = -1) -> None:
        self.lib.llama_memory_seq_rm(self.mem, seq, p0, p1)

    def decode(self, tokens: list[int], positions: list[int], seqs: list[list[int]], logits: list[bool],
               fast: bool = False) -> float:
        """One ``llama_decode`` of these rows; returns its seconds. ``fast``: the stock kernels for this
        batch even on an exact model (a prompt: see :meth:`LlamaCppTarget.prefill`)."""
        n = len(tokens)
        if n > self.n_batch:
            raise LlamaCppError(f"batch of {n} rows exceeds n_batch {self.n_batch}")
        b = self.batch
        b.n_tokens = n
        for i in range(n):
            b.token[i] = tokens[i]
            b.pos[i] = positions[i]
            b.n_seq_id[i] = len(seqs[i])
            for j, s in enumerate(seqs[i]):
                b.seq_id[i][j] = s
            b.logits[i] = bool(logits[i])
        if n > self.free_cells():
            raise LlamaCppError(f"KV cache full: {n} rows with {self.free_cells()} of {self.n_ctx} cells free; "
                                f"raise engine.n_ctx")
        set_batch_invariant(self.exact and not fast)
        start = now()
        rc = self.lib.llama_decode(self.ctx, b)
        elapsed = now() - start
        if rc != 0:
            raise LlamaCppError(f"llama_decode returned {rc} for a batch of {n} rows")
        self.used += n
        return elapsed

    def logits(self, i: int) -> torch.Tensor:
        """float32 logits [vocab] of batch row ``i`` of the last decode (a copy)."""
        ptr = self.lib.llama_get_logits_ith(self.ctx, i)
        return torch.from_numpy(np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy())

    def logits_rows(self, rows: list[int]) -> torch.Tensor:
        """float32 logits [len(rows), vocab] of the given batch rows of the last decode (one copy each)."""
        out = np.empty((len(rows), self.n_vocab), dtype=np.float32)
        for j, i in enumerate(rows):
            out[j] = np.ctypeslib.as_array(self.lib.llama_get_logits_ith(self.ctx, i), shape=(self.n_vocab,))
        return torch.from_numpy(out)

    def close(self) -> None:
        if getattr(self, "ctx", None):
            self.lib.llama_batch_free(self.batch)
            self.lib.llama_free(self.ctx)
            self.lib.llama_model_free(self.model)
            self.ctx = self.model = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


@dataclass
class SavedPrompt:
    """seq 0's KV after a prompt's rows were encoded, the seconds that took (scores included), and the
    scores read from the rows' logits for every request (``(top_m, vocab)`` -> top-m ids, log-probs)."""

    tokens: tuple[int, ...]
    state: ctypes.Array
    seconds: float
    scores: dict


class PromptReuse:
    """One prompt's encoding shared by every decoder on a model (``GGUFModel.prompt_reuse``).

    An evaluation runs every method on the same prompt, one after the other; each would encode the same
    rows into the same KV bits (the prompt takes the deterministic stock kernels, see
    :meth:`LlamaCppTarget.prefill`). With reuse the first encodes the prompt and saves seq 0; the others
    restore it (milliseconds) and are *charged* the seconds the encoding took, so every method's time
    still counts one full prefill and speedups stay those of separate runs, while a CPU whose prefill
    dominates (a 600-token article: 40 s on a 2-core Zen 1) encodes each prompt once instead of once per
    method. The scores of every ``(top_m, vocab)`` asked for so far are computed from the logits at once."""

    def __init__(self):
        self.saved: SavedPrompt | None = None
        self.requests: dict[tuple, torch.Tensor | None] = {}  # (top_m, vocab) -> the restricted vocabulary's base

    def forget(self) -> None:
        """Drop the saved prompt (the requests stay): the next prefill encodes and is measured afresh."""
        self.saved = None


def _subset_log_softmax(logits: torch.Tensor, ids: torch.Tensor | None) -> torch.Tensor:
    return torch.log_softmax(logits if ids is None else logits[ids], dim=-1)


class LlamaTreeForward:
    """Rows of a verified tree: their logits, read from llama.cpp on demand (valid until the next decode)."""

    def __init__(self, model: GGUFModel):
        self.model = model

    def logits(self, rows: list[int]) -> torch.Tensor:
        return self.model.logits_rows(rows)


def _leaves_below(parent: list[int]) -> list[list[int]]:
    """For each row, the leaves of the subtree below it (rows in parent-first order)."""
    n = len(parent)
    has_child = [False] * n
    for p in parent:
        if p >= 0:
            has_child[p] = True
    below: list[list[int]] = [[] for _ in range(n)]
    for row in range(n - 1, -1, -1):
        if not has_child[row]:
            below[row].insert(0, row)
        if parent[row] >= 0:
            below[parent[row]][:0] = below[row]
    return below


class LlamaCppTarget:
    """:class:`~treegraft.decoding.engine.TargetEngine` over a :class:`GGUFModel`."""

    device = head_device = torch.device("cpu")
    clock = Clock()  # llama.cpp runs on the host: its clock waits for nothing
    reserve = 128  # cells kept free for a tree: the context window is n_ctx minus this
    fast_prompt = True  # the prompt through the stock kernels (see prefill)

    def __init__(self, model: GGUFModel, frequent=None):
        """``frequent(k, vocab_size)``: the ``k`` most frequent token ids (the prefill's restricted vocabulary)."""
        self.model = model
        self._frequent = frequent
        self.tokens: list[int] = []  # the committed context, in the cache's seq 0
        self._prompt_len = 0  # its first tokens, encoded by prefill
        self._leaf_seqs: list[int] = []
        self._first_seq: list[int] = []
        self._tree_tokens: list[int] = []
        self._prefill_bases: dict[int, torch.Tensor] = {}  # vocab K -> the K most frequent tokens
        self.prefill_charge_s = 0.0  # seconds the last prefill adds to its own (PromptReuse)

    def context_window(self) -> int | None:
        return self.model.n_ctx - self.reserve

    def prefill(self, prompt_ids: list[int], top_m: int, vocab: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """With ``vocab`` = K the scores are a log-softmax over the K most frequent tokens plus the
        prompt's own, as on the PyTorch engine (llama.cpp computes the full head; the subset is read from it).

        The prompt is encoded with the stock fast kernels even on an exact model (``fast_prompt``): its
        KV is then a deterministic function of the prompt, the same for ``ar`` and for every method, and
        exactness is needed only from the first decoded token on. (Batch-invariant kernels run a
        512-token prompt through the slow reference path: on a Zen 3 EPYC that was half of a 64-token
        generation's time.) That also lets decoders share one encoding of a prompt
        (:class:`PromptReuse`); ``prefill_charge_s`` then says how many seconds to add to this call's own
        so that it counts what encoding the prompt cost (0 without reuse)."""
        start = now()
        m = self.model
        self._leaf_seqs = []
        self.tokens = list(prompt_ids[:-1])
        self._prompt_len = len(self.tokens)
        self.prefill_charge_s = 0.0
        m.clear()
        if not self.tokens:
            return torch.zeros(0, top_m, dtype=torch.long), torch.zeros(0, top_m)
        key = (int(top_m), int(vocab) if vocab and self._frequent is not None else None)
        base = None
        if key[1] is not None:
            if key[1] not in self._prefill_bases:
                self._prefill_bases[key[1]] = self._frequent(key[1], m.n_vocab)
            base = self._prefill_bases[key[1]]
        reuse = m.prompt_reuse
        if reuse is None:
            return self._encode_and_score(prompt_ids, {key: base})[key]
        reuse.requests.setdefault(key, base)
        saved = reuse.saved
        if saved is not None and saved.tokens == tuple(self.tokens) and key in saved.scores:
            m.load_seq0(saved.state, len(self.tokens))
        else:
            t0 = now()
            scores = self._encode_and_score(prompt_ids, dict(reuse.requests))
            saved = reuse.saved = SavedPrompt(tuple(self.tokens), None, now() - t0, scores)
            saved.state = m.save_seq0()
        self.prefill_charge_s = saved.seconds - (now() - start)
        return saved.scores[key]

    def _encode_and_score(self, prompt_ids: list[int], requests: dict) -> dict:
        """Encode the prompt's rows into the cleared cache; the top-m ids and log-probs at every row for each
        request ``(top_m, vocab) -> base``: over the full vocabulary (no base) or over the base plus the
        prompt's own tokens."""
        m = self.model
        subsets = {key: None if base is None else torch.unique(torch.cat([base, torch.tensor(prompt_ids, dtype=torch.long)]))
                   for key, base in requests.items()}
        out = {key: ([], []) for key in requests}
        for rows in self._encode_prompt():
            for i in range(rows):
                logits = m.logits(i)
                for key, ids in subsets.items():
                    logp = _subset_log_softmax(logits, ids)
                    v, j = logp.topk(min(key[0], logp.shape[-1]))
                    out[key][0].append(j if ids is None else ids[j])
                    out[key][1].append(v)
        return {key: (torch.stack(i), torch.stack(v)) for key, (i, v) in out.items()}

    def _encode_prompt(self):
        """Decode the prompt part of the context into a cleared cache, ``n_batch`` rows at a time, every
        row's logits requested; yields each batch's row count (its logits are readable until the next).
        :meth:`_make_room` replays exactly these batches, so the prompt's KV comes out the same bits."""
        m = self.model
        for start in range(0, self._prompt_len, m.n_batch):
            chunk = self.tokens[start:min(start + m.n_batch, self._prompt_len)]
            m.decode(chunk, list(range(start, start + len(chunk))), [[0]] * len(chunk), [True] * len(chunk),
                     fast=self.fast_prompt)
            yield len(chunk)

    def context_len(self) -> int:
        return len(self.tokens)

    def _make_room(self, n: int) -> None:
        """Re-encode the committed context into a cleared cache when fewer than ``n`` cells are free
        (buried cells are reclaimed only this way): the prompt's batches replayed as they were, the rest
        in exact batches, so nothing changes but the cost."""
        m = self.model
        if m.free_cells() >= n:
            return
        m.clear()
        for _ in self._encode_prompt():
            pass
        for start in range(self._prompt_len, len(self.tokens), m.n_batch):
            chunk = self.tokens[start:start + m.n_batch]
            m.decode(chunk, list(range(start, start + len(chunk))), [[0]] * len(chunk), [False] * len(chunk))

    def forward_tree(self, inputs: TreeInputs) -> LlamaTreeForward:
        n = inputs.size
        self._make_room(n)
        below = _leaves_below(inputs.parent_row)
        leaves = [r for r in range(n) if below[r] == [r]]
        if len(leaves) + 2 > self.model.n_seq:
            raise LlamaCppError(f"tree of {len(leaves)} leaves exceeds the engine's {self.model.n_seq - 2} path seqs")
        seq_of_leaf = {leaf: 1 + i for i, leaf in enumerate(leaves)}
        for s in seq_of_leaf.values():  # each path starts from the committed context
            self.model.seq_cp(0, s)
        seqs = [[seq_of_leaf[leaf] for leaf in below[r]] for r in range(n)]
        self._leaf_seqs = list(seq_of_leaf.values())
        self._first_seq = [s[0] for s in seqs]
        self._tree_tokens = list(inputs.token_ids)
        self.model.decode(self._tree_tokens, list(inputs.positions), seqs, [True] * n)
        return LlamaTreeForward(self.model)

    def keep(self, context_len: int, rows: list[int]) -> None:
        """The accepted path (root first) joins seq 0: its cells are the path's positions in the seq of a
        leaf below its last row; every tree cell is then buried under the leaf seqs."""
        self.model.seq_cp(self._first_seq[rows[-1]], 0, context_len, context_len + len(rows))
        self._drop_tree(context_len)
        self.tokens = self.tokens[:context_len] + [self._tree_tokens[r] for r in rows]

    def rollback(self, context_len: int) -> None:
        self._drop_tree(context_len)
        if context_len < len(self.tokens):
            self.model.bury(0, context_len)
        self.tokens = self.tokens[:context_len]

    def _drop_tree(self, context_len: int) -> None:
        for s in self._leaf_seqs:
            self.model.bury(s, context_len)
        self._leaf_seqs = []

    def step(self, token: int) -> torch.Tensor:
        """One-token decode of ``token`` at the end of the context (``ar``); its logits [vocab]."""
        self._make_room(1)
        self.model.decode([token], [len(self.tokens)], [[0]], [True])
        self.tokens.append(token)
        return self.model.logits(0)

    def verify_curve(self, cache_dir: str | Path | None, max_size: int) -> dict[int, float]:
        from .costs import cached_engine_curve

        return cached_engine_curve(self.model, cache_dir, max_size)

    def release(self) -> None:
        """Nothing to free: the KV cells live in the model's context, sized once and reused."""


class LlamaCppDrafter:
    """:class:`~treegraft.decoding.engine.DraftModel` over a :class:`GGUFModel` (the middle drafter).

    Same contract as :class:`~treegraft.drafters.middle.MiddleDrafter`: the prompt is pending until the
    first call, a call encodes the requested nodes not yet encoded (and their unencoded ancestors),
    :meth:`commit` keeps the encoded prefix of the accepted path and queues the rest as pending."""

    clock = Clock()
    reserve = 256  # free cells a turn may take; below that, the next call re-encodes the context
    fast_rows = 32  # a call that catches up on more context rows than this (the prompt) takes the stock kernels

    def __init__(self, model: GGUFModel, draft_vocab: torch.Tensor | None = None):
        self.model = model
        self.draft_vocab = draft_vocab
        self.tokens: list[int] = []  # the committed context, in the cache's seq 0
        self.ids: torch.Tensor | None = None  # the draft vocabulary plus every context token (sorted)
        self.pos_of: torch.Tensor | None = None
        self.committed = 0
        self.pending: list[int] = []
        self.seq_of: dict[int, int] = {}  # encoded node -> its seq, this turn
        self.logprobs: dict[int, TokenLogProbs] = {}
        self._row_logits: dict[int, torch.Tensor] = {}  # encoded node -> its logits, this turn
        self.calls = 0
        self.tokens_encoded = 0
        self.forward_s = 0.0
        self.charged_s = 0.0  # seconds of a shared prompt encoding charged since reset (PromptReuse)
        self._prompt: list[int] = []
        self.epoch = 0  # clears of the cache within a prompt (a snapshot's node cells live in one epoch)

    # the draft vocabulary grows with the context, as SubsetHead does
    def _add_vocab(self, tokens: list[int]) -> None:
        if self.draft_vocab is None:
            return
        new = torch.tensor(sorted(set(tokens)), dtype=torch.long)
        base = self.ids if self.ids is not None else self.draft_vocab
        self.ids = torch.unique(torch.cat([base, new]))
        self.pos_of = torch.full((self.model.n_vocab,), -1, dtype=torch.long)
        self.pos_of[self.ids] = torch.arange(len(self.ids))

    def reset(self, prompt_ids: list[int], encode: bool = False) -> None:
        self.model.clear()
        self.tokens, self.committed, self.pending = [], 0, list(prompt_ids[:-1])
        self._prompt, self.charged_s = list(prompt_ids[:-1]), 0.0
        self.seq_of, self.logprobs, self._row_logits = {}, {}, {}
        self.ids = None
        self._add_vocab(list(prompt_ids))
        if encode and self.pending:
            start = now()
            self._decode_rows([], None)
            self.forward_s += now() - start

    @property
    def context_len(self) -> int:
        return self.committed + len(self.pending)

    def start_turn(self) -> None:
        self._drop_nodes(list(self.seq_of))
        self.seq_of, self.logprobs, self._row_logits = {}, {}, {}

    def snapshot(self) -> tuple:
        """Within a turn the cells only grow: restoring drops the seqs of the nodes encoded since (and
        the context caught up since), so schedules that share a prefix branch from the same state."""
        return (self.committed, list(self.pending), dict(self.seq_of), dict(self.logprobs), dict(self._row_logits),
                self.epoch)

    def restore(self, snap: tuple) -> None:
        committed, pending, seq_of, logprobs, row_logits, epoch = snap
        if epoch != self.epoch:  # the cache was cleared since (:meth:`_clear`): the snapshot's node cells
            self._drop_nodes(list(self.seq_of))  # are gone; keep today's context, re-encode nodes when needed
            self.seq_of, self.logprobs, self._row_logits = {}, dict(logprobs), dict(row_logits)
            return
        self._drop_nodes([n for n in self.seq_of if n not in seq_of])
        if self.committed > committed:
            self.model.bury(0, committed)
            self.tokens = self.tokens[:committed]
        self.committed, self.pending = committed, list(pending)
        self.seq_of, self.logprobs, self._row_logits = dict(seq_of), dict(logprobs), dict(row_logits)

    def _drop_nodes(self, nodes: list[int]) -> None:
        for n in nodes:
            self.model.bury(self.seq_of[n])

    def _free_seqs(self, k: int) -> list[int]:
        used = set(self.seq_of.values())
        free = [s for s in range(1, self.model.grave) if s not in used][:k]
        if len(free) < k:
            raise LlamaCppError(f"middle drafter tree needs more than {self.model.grave - 1} node seqs this turn")
        return free

    def _catch_up_prompt(self) -> None:
        """The prompt's rows alone into a cleared cache (seq 0, cells 0.. in order, stock kernels: they only
        steer drafts), before anything else is encoded on them; with ``PromptReuse`` on the model, the saved
        encoding of the same prompt is restored instead and its seconds charged (``charged_s``)."""
        m, n = self.model, len(self._prompt)
        start = now()
        reuse = m.prompt_reuse
        saved = reuse.saved if reuse is not None else None
        m.clear()  # nothing is committed: every cell is a buried one
        if saved is not None and saved.tokens == tuple(self._prompt):
            m.load_seq0(saved.state, n)
        else:
            t0 = now()
            for s in range(0, n, m.n_batch):
                chunk = self._prompt[s:s + m.n_batch]
                m.decode(chunk, list(range(s, s + len(chunk))), [[0]] * len(chunk), [False] * len(chunk), fast=True)
            if reuse is not None:
                saved = reuse.saved = SavedPrompt(tuple(self._prompt), m.save_seq0(), now() - t0, {})
        if saved is not None:
            charge = saved.seconds - (now() - start)
            self.charged_s += charge
            self.forward_s += charge
        self.tokens_encoded += n
        self.tokens, self.committed, self.pending = list(self._prompt), n, self.pending[n:]

    def _decode_rows(self, new_nodes: list[int], tree: DraftTree | None) -> None:
        """One decode of the pending chain (seq 0) and the new tree nodes, each node with a seq of its own;
        every node row's logits are kept for the turn (a later call may ask for an encoded node's). A prompt
        of more than ``fast_rows`` rows is caught up on its own first (:meth:`_catch_up_prompt`)."""
        m = self.model
        if (self.committed == 0 and len(self._prompt) > self.fast_rows
                and self.pending[:len(self._prompt)] == self._prompt):
            self._catch_up_prompt()
            if not new_nodes and not self.pending:  # an eager prefill (reset(encode=True)): nothing else to encode
                return
        seqs = dict(zip(new_nodes, self._free_seqs(len(new_nodes))))
        desc: dict[int, list[int]] = {n: [] for n in new_nodes}
        for n in new_nodes:  # a node's cell also carries the seqs of its new descendants
            a = tree.parent[n]
            while a >= 0 and a in seqs:
                desc[a].append(seqs[n])
                a = tree.parent[a]
            # the nearest encoded ancestor's seq (or the context's) is where the node's seq starts
            m.seq_cp(self.seq_of[a] if a >= 0 else 0, seqs[n])
        on_context = [seqs[n] for n in new_nodes if self._anchor(tree, n, seqs) < 0]
        p, ctx = len(self.pending), self.context_len
        tokens = self.pending + [tree.token[n] for n in new_nodes]
        positions = list(range(self.committed, ctx)) + [ctx + tree.depth[n] for n in new_nodes]
        rows = [[0, *on_context]] * p + [[seqs[n], *desc[n]] for n in new_nodes]
        logits = [False] * p + [True] * len(new_nodes)
        # the drafter's logits only steer the drafts, never the output: a long catch-up may take fast kernels
        fast = p > self.fast_rows
        # batches of at most n_batch rows, the new nodes in the last (a long prompt is caught up first)
        last = max(0, len(tokens) - m.n_batch)
        if len(new_nodes) > m.n_batch:
            raise LlamaCppError(f"middle drafter call of {len(new_nodes)} nodes exceeds n_batch {m.n_batch}")
        for start in range(0, last, m.n_batch):
            end = min(start + m.n_batch, last)
            m.decode(tokens[start:end], positions[start:end], rows[start:end], logits[start:end], fast=fast)
        m.decode(tokens[last:], positions[last:], rows[last:], logits[last:], fast=fast)
        for i, n in enumerate(new_nodes):
            self._row_logits[n] = m.logits(p - last + i)
        self.tokens_encoded += len(tokens)
        self.tokens += self.pending
        self.committed, self.pending = ctx, []
        self.seq_of.update(seqs)

    @staticmethod
    def _anchor(tree: DraftTree, node: int, new: dict[int, int]) -> int:
        a = tree.parent[node]
        while a >= 0 and a in new:
            a = tree.parent[a]
        return a

    def _clear(self) -> None:
        """Clear the cache (buried cells come back only this way); the context becomes pending, to be
        re-encoded with the next call (a saved prompt restored), and this turn's nodes as they are needed
        again. Node scores already read stay valid: a node's logits depend only on its path."""
        self.model.clear()
        self.tokens, self.committed, self.pending = [], 0, self.tokens + self.pending
        self.seq_of = {}
        self.epoch += 1

    def encode(self, tree: DraftTree, nodes: list[int], need_logprobs: list[int] | None = None) -> None:
        """Encode ``nodes`` (and unencoded ancestors); fill ``self.logprobs`` for ``need_logprobs``
        (default ``nodes``)."""
        need = list(nodes if need_logprobs is None else need_logprobs)
        todo = tree.closure_missing(nodes, self.seq_of)
        # a turn can bury many cells (schedule enumeration encodes and buries 2^D constructions' nodes; a
        # 96-token collect on a 1,400-token CNN/DM prompt ran out: "31 rows with 30 of 4096 cells free")
        if self.model.free_cells() < len(self.pending) + len(todo):
            self._clear()
            todo = tree.closure_missing(nodes, self.seq_of)
        start = now()
        if todo or self.pending:
            self._decode_rows(todo, tree)
            self.calls += 1
        for n in need:
            if n not in self.logprobs:
                self.logprobs[n] = self._logprobs(self._row_logits[n])
        self.forward_s += now() - start

    def _logprobs(self, logits: torch.Tensor) -> TokenLogProbs:
        if self.ids is None:
            return TokenLogProbs(torch.log_softmax(logits, dim=-1))
        return TokenLogProbs(torch.log_softmax(logits[self.ids], dim=-1), 0, self.ids, self.pos_of)

    def release(self) -> None:
        """Nothing to free: the KV cells live in the model's context, sized once and reused."""

    def commit(self, path_nodes: list[int], path_tokens: list[int]) -> None:
        kept = 0
        for node in path_nodes:
            if node in self.seq_of:
                kept += 1
            else:
                break
        if kept:
            last = self.seq_of[path_nodes[kept - 1]]
            self.model.seq_cp(last, 0, self.committed, self.committed + kept)
        self._drop_nodes(list(self.seq_of))
        self.committed += kept
        self.tokens += list(path_tokens[:kept])
        self.pending.extend(path_tokens[kept:])
        self.seq_of = {}
        if self.model.free_cells() < self.reserve:
            self._clear()
        self._add_vocab(list(path_tokens))
        self.logprobs, self._row_logits = {}, {}
