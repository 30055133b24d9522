"""One place that loads a pair on the configured engine and builds a method's decoder over it.

Every entry point (``treegraft.generate``, the pipeline stages, the benchmarks) goes through
:func:`load_engine_pair` and :func:`engine_decoder`, so ``engine=torch`` (PyTorch / transformers, any
Hugging Face pair, CPU or GPU), ``engine=llama_cpp`` (the pair's GGUF files on llama.cpp) and
``engine=auto`` are one setting, not one code path each.

``engine=auto`` picks by measurement on this machine: llama.cpp where both models are GGUF files (the
embedded pairs), the device is the CPU and the patched llama-cpp-python is installed, and its one-token
step is faster than the PyTorch engine's (both measured once per machine and cached with the verification
curves); PyTorch otherwise. The choice and both step times are recorded (:func:`engine_info`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Mapping

from ..decoding.sampling import SamplingConfig
from ..models import LoadedPair, PairSpec
from .pair import LlamaPair, llama_decoder_for, load_llama_pair

__all__ = ["ENGINES", "engine_settings", "load_engine_pair", "engine_decoder", "engine_info", "engine_workers",
           "pair_verify_curve", "choose_engine"]

ENGINES = ("torch", "llama_cpp", "auto")


def engine_settings(cfg: Any) -> dict:
    """The `engine` group of an entry point's config as a dict: ``name`` (torch | llama_cpp | auto),
    ``exact``, ``threads``, ``n_ctx`` (no group = the PyTorch engine)."""
    raw = cfg.get("engine") if hasattr(cfg, "get") else getattr(cfg, "engine", None)
    raw = dict(raw) if raw is not None else {"name": "torch"}
    name = raw.get("name", "torch")
    if name not in ENGINES:
        raise ValueError(f"unknown engine {name!r}; expected one of {', '.join(ENGINES)}")
    return {"name": name, "exact": bool(raw.get("exact", True)), "threads": raw.get("threads", "auto"),
            "n_ctx": int(raw.get("n_ctx", 4096))}


def _is_gguf_source(source: str | None) -> bool:
    return source is not None and (source.startswith("embedded:") or str(source).endswith(".gguf"))


def _llama_usable(spec: PairSpec, device: str) -> str | None:
    """Why llama.cpp cannot run this pair here (None: it can)."""
    from .build import installed_build

    if not str(device).startswith("cpu"):
        return f"device {device} (llama.cpp runs on the CPU here)"
    if not _is_gguf_source(spec.target) or (spec.middle is not None and not _is_gguf_source(spec.middle)):
        return "the pair's models are not GGUF files"
    if installed_build() is None:
        return "the patched llama-cpp-python is not installed (make llamacpp)"
    return None


def load_engine_pair(spec: PairSpec, settings: Any, log: Callable[[str], None] = print,
                     device: str | None = None, dtype=None) -> LoadedPair | LlamaPair:
    """The pair of ``spec`` on ``settings``' engine (``settings``: an entry point's config with ``engine``,
    ``runtime``, ``middle_runtime``, ``paths`` and, unless given here, ``device`` / ``dtype``). A self-draft
    pair (no middle model) drafts on llama.cpp with the whole file as a separate context: llama.cpp cannot
    run the target's layer prefix."""
    from ..models import load_pair_from_settings

    eng = engine_settings(settings)
    device = str(device if device is not None else getattr(settings, "device", None) or "cpu")
    name = eng["name"]
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
    pair = load_llama_pair(spec.target, spec.middle or spec.target, threads=eng["threads"], exact=eng["exact"],
                           n_ctx=eng["n_ctx"], models_dir=paths.models_dir)
    pair.spec = spec
    pair.runtime = pair.middle_runtime = f"llama.cpp {'exact' if eng['exact'] else 'stock'}"
    pair.engine = {**_llama_build_info(pair), **({"engine_choice": choice} if choice else {})}
    log(f"{spec.name}: engine llama.cpp ({pair.runtime}, {pair.target.threads} threads)")
    return pair


def _llama_build_info(pair: LlamaPair) -> dict:
    from .build import installed_build

    stamp = installed_build() or {}
    return {"engine": "llama_cpp", "engine_version": stamp.get("version"), "engine_build": stamp.get("patch_id"),
            "engine_cmake_args": " ".join(stamp.get("cmake_args", [])), "engine_exact": bool(pair.target.exact),
            "engine_threads": int(pair.target.threads)}


def engine_info(pair: LoadedPair | LlamaPair) -> dict:
    """What a record says about the engine it ran on (engine, version, build, exactness, choice)."""
    info = getattr(pair, "engine", None)
    if info:
        return dict(info)
    if isinstance(pair, LlamaPair):
        return _llama_build_info(pair)
    return {"engine": "torch"}


def engine_decoder(method: str, pair: LoadedPair | LlamaPair, tree: dict | None = None,
                   sampling: SamplingConfig | None = None, scheduler=None, cache_dir: str | Path | None = None,
                   eager_middle_prefill: bool = False, small: dict | None = None):
    """A decoder for ``method`` on whichever engine ``pair`` was loaded on (the one dispatch over engines).
    ``small``: the tree methods' small drafter settings (None or ``ngram``: the n-gram drafter); llama.cpp
    runs the n-gram drafter only."""
    from ..drafters.small import small_config

    small_cfg = small_config(small)
    if isinstance(pair, LlamaPair):
        if small_cfg.neural:
            raise ValueError(f"engine=llama_cpp runs the n-gram small drafter only; small drafter {small_cfg.name} "
                             "needs engine=torch")
        return llama_decoder_for(method, pair, tree, sampling, scheduler, cache_dir,
                                 eager_middle_prefill=eager_middle_prefill)
    from ..decoding.factory import build_decoder

    return build_decoder(method, pair, tree, sampling, scheduler, cache_dir, eager_middle_prefill=eager_middle_prefill,
                         small=small_cfg)


def engine_workers(pair: LoadedPair | LlamaPair, requested: int) -> int:
    """Forked workers a stage may use on this pair: llama.cpp runs its own threads over every core (and a
    forked copy of its contexts is not safe), so one; the PyTorch engine, as many as asked."""
    return 1 if isinstance(pair, LlamaPair) else max(1, int(requested))


def pair_verify_curve(pair: LoadedPair | LlamaPair, cache_dir: str | Path | None, max_size: int = 64) -> dict[int, float]:
    """The target's measured verification curve (seconds by rows) on the pair's engine, cached."""
    if isinstance(pair, LlamaPair):
        from .costs import cached_engine_curve

        return cached_engine_curve(pair.target, cache_dir, max_size)
    from ..decoding.budget import cached_verify_curve

    return cached_verify_curve(pair.target, cache_dir, max_size)


def choose_engine(spec: PairSpec, settings: Any, device: str, dtype=None, log: Callable[[str], None] = print) -> dict:
    """``engine=auto``: the faster one-token step of the two engines on this machine (see the module doc).
    Returns ``{"engine", "reason", "torch_step_ms", "llama_step_ms"}``; both steps are cached per machine."""
    why = _llama_usable(spec, device)
    if why is not None:
        return {"engine": "torch", "reason": why, "torch_step_ms": None, "llama_step_ms": None}
    from ..models import load_pair_from_settings

    eng = engine_settings(settings)
    cache = settings.paths.cache_dir
    llama = load_llama_pair(spec.target, None, threads=eng["threads"], exact=eng["exact"], n_ctx=1024,
                            models_dir=settings.paths.models_dir)
    llama_ms = 1000 * pair_verify_curve(llama, cache, 1)[1]
    llama.target.close()
    # the target alone (a one-layer self-draft spec: no second model loaded)
    torch_pair = load_pair_from_settings(PairSpec(name=spec.name, target=spec.target, self_draft_layers=1), settings,
                                         device, dtype, log=lambda *_: None)
    torch_ms = 1000 * pair_verify_curve(torch_pair, cache, 1)[1]
    del torch_pair
    from ..models.runtime.memory import return_freed_memory

    return_freed_memory()
    name = "llama_cpp" if llama_ms < torch_ms else "torch"
    log(f"engine=auto: {name} (one-token step on this CPU: llama.cpp {llama_ms:.1f} ms, PyTorch {torch_ms:.1f} ms)")
    return {"engine": name, "reason": "faster one-token step", "torch_step_ms": torch_ms, "llama_step_ms": llama_ms}

