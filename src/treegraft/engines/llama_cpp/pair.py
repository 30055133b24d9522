"""Load a pair of GGUF models into llama.cpp and hand out its engines.

Usage (no Hydra needed)::

    from treegraft.engines.llama_cpp import load_llama_pair
    from treegraft.front import decoder_for
    pair = load_llama_pair("embedded:qwen-coder-1.5b", "embedded:qwen-coder-0.5b")
    dec = decoder_for("all_mid", pair)
    out = dec.generate(pair.tokenizer.encode("def fib(n):"), max_new_tokens=64)

A model is ``embedded:<name>`` (the GGUF file inside the installed model packages, read directly; a
model split across packages is concatenated once into ``<models_dir>/<name>.gguf``, sha256 checked)
or a path to a ``.gguf`` file.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ...model_io import eos_token_ids
from ..protocols import FrequentTokens
from .costs import cached_engine_curve
from .drafter import LlamaCppDrafter
from .head import VocabHead
from .model import HIDDEN_STATE_ARCHS, GGUFModel
from .requant import MIDDLE_WEIGHTS, requantized
from .target import LlamaCppTarget

__all__ = ["LlamaPair", "LlamaEngines", "gguf_path", "load_llama_pair", "llama_eos_ids", "resolve_threads", "build_info"]

EMBEDDED = "embedded:"


def gguf_path(source: str, models_dir: str | os.PathLike | None = None) -> Path:
    """The GGUF file of ``source`` (``embedded:<name>`` or a path)."""
    from ...models.embedded import EMBEDDED_MODELS, _sha256_concat, gguf_parts
    from ...paths import default_models_dir

    if not source.startswith(EMBEDDED):
        path = Path(source)
        if not path.is_file() or path.suffix != ".gguf":
            raise FileNotFoundError(f"model {source!r} is not a .gguf file; the llama.cpp engine loads GGUF files "
                                    f"(embedded:<name> or a path to <file>.gguf)")
        return path
    name = source[len(EMBEDDED):]
    if name not in EMBEDDED_MODELS:
        raise ValueError(f"unknown embedded model {name!r}; expected one of {', '.join(sorted(EMBEDDED_MODELS))}")
    model = EMBEDDED_MODELS[name]
    parts = gguf_parts(model)
    if len(parts) == 1:
        return parts[0]
    out = Path(models_dir or default_models_dir()) / f"{name}.gguf"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f".{out.name}.tmp")
        digest = _sha256_concat(parts, tmp, progress=True)
        if digest != model.sha256:
            tmp.unlink(missing_ok=True)
            raise ValueError(f"sha256 of embedded model {name!r} is {digest}, expected {model.sha256}: reinstall its packages")
        os.replace(tmp, out)
    return out


@dataclass
class LlamaPair:
    """A target and (optionally) a middle drafter on llama.cpp, with the target's tokenizer."""

    target: GGUFModel
    middle: GGUFModel | None
    tokenizer: object
    name: str = ""
    spec: object = None  # the PairSpec it was loaded from (treegraft.front.load_engine_pair)
    runtime: str = "llama.cpp"  # what records call the target's and the middle drafter's runtime
    middle_runtime: str = "llama.cpp"
    engine: dict | None = None  # engine, version, build, exactness, engine=auto's choice (LlamaEngines.info)
    middle_head: VocabHead | None = None  # the middle drafter's head for a draft vocabulary (made on first use)


def resolve_threads(threads: int | str) -> int:
    """``auto`` = the cores this process may run on (llama.cpp's step is memory-bound: every core helps)."""
    if threads == "auto":
        return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if int(threads) < 1:
        raise ValueError(f"engine threads must be >= 1 or auto, got {threads!r}")
    return int(threads)


def load_llama_pair(target: str, middle: str | None = None, tokenizer_source: str | None = None,
                    threads: int | str = "auto", exact: bool = True, n_ctx: int = 4096,
                    models_dir: str | os.PathLike | None = None, middle_weights: str = "file") -> LlamaPair:
    """Both GGUF files loaded (middle None: a method without the middle drafter only). The tokenizer is the
    Hugging Face one of ``tokenizer_source`` (default ``target``; an embedded model's converted folder).

    ``middle_weights``: ``file`` (the middle drafter's file as it is, on the target's kernels) or ``q4_0`` (its
    matrices requantized once to Q4_0 into ``models_dir`` and run on llama.cpp's stock repacked kernels: the
    drafter's logits only steer drafts, so it needs no batch invariance; see :mod:`.requant`)."""
    from ...models import load_tokenizer
    from ...paths import default_models_dir

    if middle_weights not in MIDDLE_WEIGHTS:
        raise ValueError(f"unknown middle_weights {middle_weights!r}; expected one of {', '.join(MIDDLE_WEIGHTS)}")
    threads = resolve_threads(threads)
    tgt = GGUFModel(str(gguf_path(target, models_dir)), n_ctx=n_ctx, n_seq=256, threads=threads, exact=exact)
    mid = None
    if middle is not None:
        path, mid_exact = gguf_path(middle, models_dir), exact
        if middle_weights == "q4_0":
            name = middle[len(EMBEDDED):] if middle.startswith(EMBEDDED) else None
            path, mid_exact = requantized(path, models_dir or default_models_dir(), name), False
        mid = GGUFModel(str(path), n_ctx=n_ctx, n_seq=256, threads=threads, exact=mid_exact)
        if mid.n_vocab != tgt.n_vocab:
            raise ValueError(f"tokenizer mismatch: middle drafter {middle!r} has {mid.n_vocab} tokens, target "
                             f"{target!r} {tgt.n_vocab}; the drafters must share the target's tokenizer")
    tokenizer = load_tokenizer(tokenizer_source or target, models_dir)
    return LlamaPair(tgt, mid, tokenizer, name=f"{target}|{middle}")


def llama_eos_ids(model: GGUFModel, tokenizer=None) -> set[int]:
    """The tokenizer's EOS ids plus the GGUF's own end-of-sequence / end-of-turn tokens."""
    ids = eos_token_ids(None, tokenizer)
    for fn in ("llama_vocab_eos", "llama_vocab_eot"):
        tok = int(getattr(model.lib, fn)(model.vocab))
        if tok >= 0:
            ids.add(tok)
    return ids


def build_info(model: GGUFModel) -> dict:
    """What a record says about the engine a model runs on: version, build, options, exactness, threads."""
    from .build import installed_build

    stamp = installed_build() or {}
    return {"engine": "llama_cpp", "engine_version": stamp.get("version"), "engine_build": stamp.get("patch_id"),
            "engine_cmake_args": " ".join(stamp.get("cmake_args", [])), "engine_exact": bool(model.exact),
            "engine_threads": int(model.threads)}


@dataclass
class LlamaEngines:
    """A :class:`LlamaPair`'s engines (:class:`~treegraft.engines.protocols.PairEngines`)."""

    pair: LlamaPair
    name = "llama_cpp"

    @property
    def tokenizer(self):
        return self.pair.tokenizer

    @property
    def has_middle(self) -> bool:
        return self.pair.middle is not None

    def target(self, frequent: FrequentTokens) -> LlamaCppTarget:
        return LlamaCppTarget(self.pair.target, frequent)

    def middle(self, frequent: FrequentTokens, draft_vocab: int | None) -> LlamaCppDrafter:
        middle = self.pair.middle
        if middle is None:
            raise ValueError("this pair has no middle drafter model")
        vocab = frequent(int(draft_vocab), middle.n_vocab) if draft_vocab else None
        if vocab is None or middle.arch not in HIDDEN_STATE_ARCHS:
            return LlamaCppDrafter(middle, vocab)
        # a draft vocabulary: llama.cpp stops at the hidden states, the head reads only the vocabulary's rows
        if self.pair.middle_head is None:
            self.pair.middle_head = VocabHead(middle.path)
        return LlamaCppDrafter(middle.hidden_state_sibling(), vocab, self.pair.middle_head)

    def small(self, settings, frequent: FrequentTokens, draft_vocab: int | None, model=None):
        raise ValueError(f"engine=llama_cpp runs the n-gram small drafter only; small drafter {settings.name} "
                         "needs engine=torch")

    def eos_ids(self) -> set[int]:
        return llama_eos_ids(self.pair.target, self.pair.tokenizer)

    def verify_curve(self, cache_dir: str | Path | None, max_size: int = 64) -> dict[int, float]:
        return cached_engine_curve(self.pair.target, cache_dir, max_size)

    def info(self) -> dict:
        return dict(self.pair.engine) if self.pair.engine else build_info(self.pair.target)

    def workers(self, requested: int) -> int:
        """One: llama.cpp runs its own threads over every core, and a forked copy of its contexts is not safe."""
        return 1
