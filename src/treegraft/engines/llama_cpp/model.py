"""llama.cpp's model and context: a GGUF file loaded through llama-cpp-python's low-level API, its KV
sequence operations, batched ``llama_decode`` with per-row logits, and one prompt's saved encoding shared
between decoders (:class:`PromptReuse`).

``exact=True`` (the default) runs the patched ggml's batch-invariant mode
(:mod:`treegraft.engines.llama_cpp.build`) and loads weights without repacking: a token's logits are then
the same bit for bit whether it is decoded alone or in a tree. ``exact=False`` runs the stock fast kernels.
"""

from __future__ import annotations

import copy
import ctypes
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ...devices import now

__all__ = ["GGUFModel", "HIDDEN_STATE_ARCHS", "LlamaCppError", "PromptReuse", "SavedPrompt", "set_batch_invariant", "multicol_check"]


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
    """The patched ggml's process-wide batch-invariant switch (see :mod:`treegraft.engines.llama_cpp.build`)."""
    global _SWITCH
    if _SWITCH is None:
        _SWITCH = _ggml_cpu("ggml_cpu_set_batch_invariant")
        _SWITCH.argtypes = [ctypes.c_bool]
    _SWITCH(bool(on))


# architectures whose graph treegraft's build stops at the final norm when embeddings are on without pooling
HIDDEN_STATE_ARCHS = ("qwen2", "llama")

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
    hidden_states: bool = False  # rows give the final norm's hidden states, no LM head (HIDDEN_STATE_ARCHS only)

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
        self.owns_model = True
        self.vocab = lib.llama_model_get_vocab(self.model)
        self.n_vocab = lib.llama_vocab_n_tokens(self.vocab)
        self.n_embd = lib.llama_model_n_embd(self.model)
        self.arch = self.meta("general.architecture")
        self._hidden_sibling: GGUFModel | None = None
        self._reuse_of: GGUFModel | None = None  # a sibling shares its parent's PromptReuse
        self._prompt_reuse: PromptReuse | None = None  # off: every prefill encodes its prompt
        self._init_context()

    def _init_context(self) -> None:
        lib = self.lib
        cparams = lib.llama_context_default_params()
        cparams.n_ctx = self.n_ctx
        cparams.n_batch = cparams.n_ubatch = self.n_batch  # a tree is one ubatch
        cparams.n_seq_max = self.n_seq
        cparams.kv_unified = True
        cparams.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_ENABLED
        cparams.n_threads = cparams.n_threads_batch = self.threads
        cparams.no_perf = True
        if self.hidden_states:
            if self.arch not in HIDDEN_STATE_ARCHS:
                raise LlamaCppError(f"hidden states without the LM head need a {'/'.join(HIDDEN_STATE_ARCHS)} model "
                                    f"(treegraft's build patches those graphs); {self.path} is {self.arch!r}")
            cparams.embeddings = True  # with no pooling, the patched graph stops at the final norm
            cparams.pooling_type = lib.LLAMA_POOLING_TYPE_NONE
        self.ctx = lib.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            raise LlamaCppError(f"llama.cpp could not create a context for {self.path} (n_ctx {self.n_ctx})")
        self.mem = lib.llama_get_memory(self.ctx)
        self.batch = lib.llama_batch_init(self.n_batch, 0, self.n_seq)
        self.used = 0  # cells taken since the last clear (never freed before it: see bury)

    @property
    def prompt_reuse(self) -> PromptReuse | None:
        return self._reuse_of.prompt_reuse if self._reuse_of is not None else self._prompt_reuse

    @prompt_reuse.setter
    def prompt_reuse(self, reuse: PromptReuse | None) -> None:
        if self._reuse_of is not None:
            self._reuse_of.prompt_reuse = reuse
        else:
            self._prompt_reuse = reuse

    def hidden_state_sibling(self) -> "GGUFModel":
        """A second context on the same weights whose rows give hidden states, not logits (made once).

        Its KV bits are this context's (the layers are the same; only the LM head is left out), so it shares
        this model's :class:`PromptReuse`: a prompt saved by either serves both."""
        if self.hidden_states:
            return self
        if self._hidden_sibling is None:
            sib = copy.copy(self)
            sib.hidden_states, sib.owns_model, sib._hidden_sibling, sib._reuse_of = True, False, None, self
            sib.ctx = sib.batch = None  # this context's, until the sibling has its own (a failed start frees nothing)
            sib._init_context()
            self._hidden_sibling = sib
        return self._hidden_sibling

    def meta(self, key: str) -> str | None:
        """A GGUF metadata value as text (None if the file has no such key)."""
        buf = ctypes.create_string_buffer(256)
        n = self.lib.llama_model_meta_val_str(self.model, key.encode(), buf, len(buf))
        return buf.value.decode() if n >= 0 else None

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

    def hidden_rows(self, rows: list[int]) -> torch.Tensor:
        """float32 hidden states [len(rows), n_embd] (the final norm's output) of the given batch rows of the
        last decode, on a ``hidden_states`` model (every row of its batches is an output)."""
        out = np.empty((len(rows), self.n_embd), dtype=np.float32)
        for j, i in enumerate(rows):
            ptr = self.lib.llama_get_embeddings_ith(self.ctx, i)
            if not ptr:
                raise LlamaCppError(f"no hidden state for batch row {i} (hidden_states is off?)")
            out[j] = np.ctypeslib.as_array(ptr, shape=(self.n_embd,))
        return torch.from_numpy(out)

    def close(self) -> None:
        if getattr(self, "ctx", None):  # (a sibling whose context failed to start has none: nothing to free)
            if self._hidden_sibling is not None:
                self._hidden_sibling.close()
            self.lib.llama_batch_free(self.batch)
            self.lib.llama_free(self.ctx)
            if self.owns_model:
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
