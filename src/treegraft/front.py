"""The front door: load a pair on the configured engine, hand out its engines, build any method's decoder.

Every entry point (``treegraft.generate``, the pipeline stages, the benchmarks, ``custom_generate``) goes
through :func:`load_engine_pair` and :func:`decoder_for`, so ``engine=torch`` (PyTorch / transformers, any
Hugging Face pair, CPU or GPU), ``engine=llama_cpp`` (the pair's GGUF files on llama.cpp) and
``engine=auto`` are one setting, not one code path each. Library use, no Hydra::

    from treegraft.engines.torch import TorchEngines
    from treegraft.front import decoder_for
    dec = decoder_for("fixed", TorchEngines(target_model, middle_model, tokenizer))
    result = dec.generate(prompt_ids, max_new_tokens=128)

``engine=auto`` picks by measurement on this machine: llama.cpp where both models are GGUF files (the
embedded pairs), the device is the CPU and the patched llama-cpp-python is installed, and its one-token
step is faster than the PyTorch engine's (both measured once per machine and cached with the verification
curves); PyTorch otherwise. The choice and both step times are recorded (``engines_of(pair).info()``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

import torch

from .decoding.autoregressive import AutoregressiveDecoder
from .decoding.methods import LEARNED_METHODS, METHODS, TREE_METHODS
from .decoding.hf_peers import HFAssistedDecoder, HFPromptLookupDecoder
from .decoding.sampling import SamplingConfig
from .decoding.tree_config import TreeConfig, tree_config_from
from .decoding.tree_decoder import TreeGraftDecoder, calls_middle
from .drafters.small import SmallDrafterConfig, small_config
from .drafters.vocab import frequent_tokens
from .engines.llama_cpp import LlamaEngines, LlamaPair, load_llama_pair
from .engines.protocols import FrequentTokens, PairEngines
from .engines.torch import TorchEngines
from .models import LoadedPair, PairSpec
from .paths import default_cache_dir

__all__ = ["ENGINES", "EngineSettings", "load_engine_pair", "engines_of", "decoder_for", "choose_engine"]

ENGINES = ("torch", "llama_cpp", "auto")


@dataclass(frozen=True)
class EngineSettings:
    """The ``engine`` group: ``name`` (torch | llama_cpp | auto), llama.cpp's ``exact`` kernels,
    ``threads`` (an int or ``auto``), ``n_ctx`` and llama.cpp's ``middle_weights`` (``file`` | ``q4_0``:
    :func:`~treegraft.engines.llama_cpp.load_llama_pair`)."""

    name: str = "torch"
    exact: bool = True
    threads: int | str = "auto"
    n_ctx: int = 4096
    middle_weights: str = "file"

    def __post_init__(self):
        from .engines.llama_cpp.requant import MIDDLE_WEIGHTS

        if self.name not in ENGINES:
            raise ValueError(f"unknown engine {self.name!r}; expected one of {', '.join(ENGINES)}")
        if self.middle_weights not in MIDDLE_WEIGHTS:
            raise ValueError(f"unknown engine.middle_weights {self.middle_weights!r}; expected one of "
                             f"{', '.join(MIDDLE_WEIGHTS)}")

    @classmethod
    def of(cls, cfg: Any) -> "EngineSettings":
        """From an entry point's config (its ``engine`` node; none: the PyTorch engine)."""
        raw = cfg.get("engine") if hasattr(cfg, "get") else getattr(cfg, "engine", None)
        if isinstance(raw, EngineSettings):
            return raw
        raw = dict(raw) if raw is not None else {}
        return cls(name=raw.get("name", "torch"), exact=bool(raw.get("exact", True)), threads=raw.get("threads", "auto"),
                   n_ctx=int(raw.get("n_ctx", 4096)), middle_weights=str(raw.get("middle_weights", "file")))


def _is_gguf_source(source: str | None) -> bool:
    return source is not None and (source.startswith("embedded:") or str(source).endswith(".gguf"))


def _llama_usable(spec: PairSpec, device: str) -> str | None:
    """Why llama.cpp cannot run this pair here (None: it can)."""
    from .engines.llama_cpp.build import installed_build

    if not str(device).startswith("cpu"):
        return f"device {device} (llama.cpp runs on the CPU here)"
    if not _is_gguf_source(spec.target) or (spec.middle is not None and not _is_gguf_source(spec.middle)):
        return "the pair's models are not GGUF files"
    if installed_build() is None:
        return "the patched llama-cpp-python is not installed (make llamacpp)"
    return None


def load_engine_pair(spec: PairSpec, settings: Any, log: Callable[[str], None] = print,
                     device: str | None = None, dtype=None) -> LoadedPair | LlamaPair:
    """The pair of ``spec`` loaded on ``settings``' engine (``settings``: an entry point's config with
    ``engine``, ``runtime``, ``middle_runtime``, ``paths`` and, unless given here, ``device`` / ``dtype``);
    :func:`engines_of` hands out its engines. A self-draft pair (no middle model) drafts on llama.cpp with
    the whole file as a separate context: llama.cpp cannot run the target's layer prefix."""
    from .models import load_pair_from_settings

    eng = EngineSettings.of(settings)
    device = str(device if device is not None else getattr(settings, "device", None) or "cpu")
    name = eng.name
    choice = None
    if name == "auto":
        choice = choose_engine(spec, settings, device, dtype, log)
        name = choice["engine"]
    if name == "torch":
        pair = load_pair_from_settings(spec, settings, device, dtype, log=log)
        pair.engine = {"engine": "torch", **({"engine_choice": choice} if choice else {})}
        return pair
    why = _llama_usable(spec, device)
    if why is not None:
        raise ValueError(f"engine=llama_cpp cannot run pair {spec.name!r}: {why}")
    paths = settings.paths
    pair = load_llama_pair(spec.target, spec.middle or spec.target, threads=eng.threads, exact=eng.exact,
                           n_ctx=eng.n_ctx, models_dir=paths.models_dir, middle_weights=eng.middle_weights)
    pair.spec = spec
    pair.runtime = pair.middle_runtime = f"llama.cpp {'exact' if eng.exact else 'stock'}"
    if eng.middle_weights != "file":
        pair.middle_runtime = f"llama.cpp stock {eng.middle_weights}"
    pair.engine = {**LlamaEngines(pair).info(), **({"engine_choice": choice} if choice else {})}
    log(f"{spec.name}: engine llama.cpp ({pair.runtime}, {pair.target.threads} threads)")
    return pair


def engines_of(pair: LoadedPair | LlamaPair | PairEngines) -> PairEngines:
    """A loaded pair's engines (a pair's engines: themselves)."""
    if isinstance(pair, LoadedPair):
        return TorchEngines.of(pair)
    if isinstance(pair, LlamaPair):
        return LlamaEngines(pair)
    if isinstance(pair, (TorchEngines, LlamaEngines)):
        return pair
    raise TypeError(f"expected a loaded pair (LoadedPair, LlamaPair) or its engines, got {type(pair).__name__}")


def _frequent(tokenizer, cache_dir: Path) -> FrequentTokens:
    """The restricted vocabularies' base: the most frequent tokens of the tokenizer (by id without one)."""
    def frequent(k: int, vocab_size: int) -> torch.Tensor:
        if tokenizer is None:
            return torch.arange(min(k, vocab_size), device="cpu")
        return frequent_tokens(tokenizer, k, vocab_size, cache_dir)

    return frequent


def decoder_for(method: str, pair: LoadedPair | LlamaPair | PairEngines, tree: dict | TreeConfig | None = None,
                sampling: SamplingConfig | None = None, scheduler=None, cache_dir: str | Path | None = None,
                eager_middle_prefill: bool = False, small: dict | SmallDrafterConfig | None = None,
                small_model=None, eos_ids: set[int] | None = None):
    """The one method dispatch: a decoder with ``.generate(prompt_ids, max_new_tokens) -> GenerationResult``
    for ``method`` over ``pair``'s engines (any engine).

    ``tree``: the tree settings (a dict such as the Hydra ``tree`` node, or a :class:`TreeConfig` whose
    ``method`` this call sets). ``treegraft`` / ``direct_planner`` need ``scheduler``
    (:func:`~treegraft.decoding.methods.load_learned_scheduler`); a preset may take one too (a policy on
    its tree). ``cache_dir``: where ``budget=auto`` caches the verification curve and the draft vocabulary
    its frequency table (default :func:`treegraft.paths.default_cache_dir`). ``eager_middle_prefill``: the
    tree decoders encode the prompt into the middle drafter at prefill (schedule enumeration wants it).
    ``small``: the tree methods' small drafter, a settings dict (``small_settings``, the Hydra ``small``
    node) or :class:`SmallDrafterConfig`; None or ``ngram``: the n-gram drafter; methods without one
    ignore it, so one ``small`` serves a whole method list. ``small_model``: a neural small drafter's
    model, already loaded (PyTorch engine). ``eos_ids``: the ids that end generation (default: the
    engine's). A method variant (``fixed@self_draft``) is split by ``parse_method`` / ``method_small``.
    """
    engines = engines_of(pair)
    sampling = sampling or SamplingConfig()
    small_cfg = small_config(small)  # checked for every method: a bad setting is an error even where unused
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; expected one of {', '.join(METHODS)}")
    if method in LEARNED_METHODS and scheduler is None:
        raise ValueError(f"method {method} needs its learned scheduler (load_learned_scheduler)")
    if method.startswith("hf_") and not isinstance(engines, TorchEngines):
        raise ValueError(f"method {method!r} runs transformers' generate: it needs engine=torch")
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    frequent = _frequent(engines.tokenizer, cache)
    if method in TREE_METHODS:
        base = "fixed" if method in LEARNED_METHODS else method  # a learned policy runs the shared tree
        cfg = replace(tree, method=base) if isinstance(tree, TreeConfig) else tree_config_from(base, tree)
        # a neural small drafter first: an engine that runs none says so before anything is built
        small_drafter = engines.small(small_cfg, frequent, cfg.draft_vocab, small_model) if small_cfg.neural else None
    eos = engines.eos_ids() if eos_ids is None else set(eos_ids)
    if method == "ar":
        return AutoregressiveDecoder(engines.target(frequent), eos, sampling)
    if method == "hf_assisted":
        return HFAssistedDecoder(engines.target_model, engines.middle_model, eos, sampling)
    if method == "hf_prompt_lookup":
        return HFPromptLookupDecoder(engines.target_model, eos, sampling)
    middle = engines.middle(frequent, cfg.draft_vocab) if calls_middle(cfg, scheduler) and engines.has_middle else None
    return TreeGraftDecoder(engines.target(frequent), middle, engines.tokenizer, cfg, sampling, eos,
                            scheduler=scheduler, cache_dir=cache, eager_middle_prefill=eager_middle_prefill,
                            small=small_cfg, small_drafter=small_drafter)


def choose_engine(spec: PairSpec, settings: Any, device: str, dtype=None, log: Callable[[str], None] = print) -> dict:
    """``engine=auto``: the faster one-token step of the two engines on this machine (see the module doc).
    Returns ``{"engine", "reason", "torch_step_ms", "llama_step_ms"}``; both steps are cached per machine."""
    why = _llama_usable(spec, device)
    if why is not None:
        return {"engine": "torch", "reason": why, "torch_step_ms": None, "llama_step_ms": None}
    from .models import load_pair_from_settings
    from .models.runtime.memory import return_freed_memory

    eng = EngineSettings.of(settings)
    cache = settings.paths.cache_dir
    llama = load_llama_pair(spec.target, None, threads=eng.threads, exact=eng.exact, n_ctx=1024,
                            models_dir=settings.paths.models_dir)
    llama_ms = 1000 * engines_of(llama).verify_curve(cache, 1)[1]
    llama.target.close()
    # the target alone (a one-layer self-draft spec: no second model loaded)
    torch_pair = load_pair_from_settings(PairSpec(name=spec.name, target=spec.target, self_draft_layers=1), settings,
                                         device, dtype, log=lambda *_: None)
    torch_ms = 1000 * engines_of(torch_pair).verify_curve(cache, 1)[1]
    del torch_pair
    return_freed_memory()
    name = "llama_cpp" if llama_ms < torch_ms else "torch"
    log(f"engine=auto: {name} (one-token step on this CPU: llama.cpp {llama_ms:.1f} ms, PyTorch {torch_ms:.1f} ms)")
    return {"engine": name, "reason": "faster one-token step", "torch_step_ms": torch_ms, "llama_step_ms": llama_ms}
