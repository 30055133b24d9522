"""Load a pair of GGUF models into llama.cpp and build a decoder for a method over it.

Usage (no Hydra needed)::

    from treegraft.llama_cpp import load_llama_pair, llama_decoder_for
    pair = load_llama_pair("embedded:qwen-coder-1.5b", "embedded:qwen-coder-0.5b")
    dec = llama_decoder_for("all_mid", pair)
    out = dec.generate(pair.tokenizer.encode("def fib(n):"), max_new_tokens=64)

A model is ``embedded:<name>`` (the GGUF file inside the installed model packages, read directly; a
model split across packages is concatenated once into ``<models_dir>/<name>.gguf``, sha256 checked)
or a path to a ``.gguf`` file.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch

from ..decoding.autoregressive import (GenerationResult, eos_token_ids, extend_until_stop, hold_eos, make_generator,
                                       prepare_prompt)
from ..decoding.sampling import SamplingConfig, sample_from_logits
from .engine import GGUFModel, LlamaCppDrafter, LlamaCppTarget
from ..devices import now

__all__ = ["LlamaPair", "gguf_path", "load_llama_pair", "llama_decoder_for", "LlamaAutoregressive", "llama_eos_ids"]

EMBEDDED = "embedded:"


def gguf_path(source: str, models_dir: str | os.PathLike | None = None) -> Path:
    """The GGUF file of ``source`` (``embedded:<name>`` or a path)."""
    from ..models.embedded import EMBEDDED_MODELS, _sha256_concat, gguf_parts
    from ..paths import default_models_dir

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
    spec: object = None  # the PairSpec it was loaded from (load_engine_pair)
    runtime: str = "llama.cpp"  # what records call the target's and the middle drafter's runtime
    middle_runtime: str = "llama.cpp"
    engine: dict | None = None  # engine, version, build, exactness (treegraft.llama_cpp.select.engine_info)


def resolve_threads(threads: int | str) -> int:
    """``auto`` = the cores this process may run on (llama.cpp's step is memory-bound: every core helps)."""
    if threads == "auto":
        return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if int(threads) < 1:
        raise ValueError(f"engine threads must be >= 1 or auto, got {threads!r}")
    return int(threads)


def load_llama_pair(target: str, middle: str | None = None, tokenizer_source: str | None = None,
                    threads: int | str = "auto", exact: bool = True, n_ctx: int = 4096,
                    models_dir: str | os.PathLike | None = None) -> LlamaPair:
    """Both GGUF files loaded (middle None: a method without the middle drafter only). The tokenizer is the
    Hugging Face one of ``tokenizer_source`` (default ``target``; an embedded model's converted folder)."""
    from ..models import load_tokenizer

    threads = resolve_threads(threads)
    tgt = GGUFModel(str(gguf_path(target, models_dir)), n_ctx=n_ctx, n_seq=256, threads=threads, exact=exact)
    mid = None
    if middle is not None:
        mid = GGUFModel(str(gguf_path(middle, models_dir)), n_ctx=n_ctx, n_seq=256, threads=threads, exact=exact)
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


class LlamaAutoregressive:
    """``ar`` on llama.cpp: the prompt, then one ``llama_decode`` of one token per new token (the
    reference every method's greedy output on this engine must equal)."""

    def __init__(self, model: GGUFModel, eos_ids: set[int], sampling: SamplingConfig | None = None):
        self.engine = LlamaCppTarget(model)
        self.eos_ids = set(eos_ids)
        self.sampling = sampling or SamplingConfig()

    @torch.inference_mode()
    def generate(self, prompt_ids: Sequence[int] | torch.Tensor, max_new_tokens: int,
                 on_tokens: Callable[[list[int]], None] | None = None, min_new_tokens: int = 0) -> GenerationResult:
        prompt_ids = prepare_prompt(prompt_ids, max_new_tokens, None, self.engine.context_window())
        generator = make_generator(self.sampling, torch.device("cpu"))
        start = now()
        self.engine.prefill(prompt_ids, 1, None)
        start -= self.engine.prefill_charge_s  # a shared prompt encoding counts in full (PromptReuse)
        logits = self.engine.step(prompt_ids[-1])
        prefill_time = now() - start
        tokens: list[int] = []
        while True:
            token = sample_from_logits(hold_eos(logits, self.eos_ids, len(tokens), min_new_tokens), self.sampling,
                                       generator)
            stop_reason = extend_until_stop(tokens, [token], self.eos_ids, max_new_tokens)
            if on_tokens is not None:
                on_tokens([token])
            if stop_reason:
                break
            logits = self.engine.step(token)
        return GenerationResult(tokens=tokens, prompt_tokens=len(prompt_ids), wall_time_s=now() - start,
                                prefill_time_s=prefill_time, stop_reason=stop_reason)


def llama_decoder_for(method: str, pair: LlamaPair, tree: dict | None = None, sampling: SamplingConfig | None = None,
                      scheduler=None, cache_dir: str | Path | None = None, eos_ids: set[int] | None = None,
                      eager_middle_prefill: bool = False):
    """A decoder for ``method`` on llama.cpp (``ar``, the tree presets and the learned methods; the HF peers
    run on the PyTorch engine only)."""
    from ..decoding.factory import LEARNED_METHODS, tree_config_from
    from ..decoding.tree_decoder import METHOD_PRESETS, TreeGraftDecoder
    from ..drafters.vocab import frequent_tokens
    from ..paths import default_cache_dir

    sampling = sampling or SamplingConfig()
    eos = llama_eos_ids(pair.target, pair.tokenizer) if eos_ids is None else set(eos_ids)
    if method == "ar":
        return LlamaAutoregressive(pair.target, eos, sampling)
    if method not in METHOD_PRESETS and method not in LEARNED_METHODS:
        raise ValueError(f"method {method!r} does not run on engine=llama_cpp; expected ar, "
                         f"{', '.join(METHOD_PRESETS)} or {', '.join(LEARNED_METHODS)}")
    if method in LEARNED_METHODS and scheduler is None:
        raise ValueError(f"method {method} needs its learned scheduler (load_learned_scheduler)")
    cfg = tree_config_from("fixed" if method in LEARNED_METHODS else method, tree)
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()

    def frequent(k: int, vocab_size: int) -> torch.Tensor:
        if pair.tokenizer is None:
            return torch.arange(min(k, vocab_size))
        return frequent_tokens(pair.tokenizer, k, vocab_size, cache)

    drafter = None
    if pair.middle is not None:
        vocab = frequent(int(cfg.draft_vocab), pair.middle.n_vocab) if cfg.draft_vocab else None
        drafter = LlamaCppDrafter(pair.middle, vocab)
    return TreeGraftDecoder(None, None, pair.tokenizer, cfg, sampling, eos, scheduler=scheduler, cache_dir=cache,
                            engine=LlamaCppTarget(pair.target, frequent), drafter=drafter,
                            eager_middle_prefill=eager_middle_prefill)

