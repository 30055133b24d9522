"""The llama.cpp engine: GGUF target and middle drafter through llama-cpp-python's low-level API (CPU).

``model.py`` holds the model and context (KV sequence ops, batched decode, saved prompts), ``target.py``
the target (a tree verified in one multi-sequence batch), ``drafter.py`` the middle drafter (its tree
encoded incrementally), ``costs.py`` this engine's cost curve, ``head.py`` the middle drafter's LM head over its draft
vocabulary, ``requant.py`` its Q4_0 weights, ``pair.py`` loading a GGUF pair and its :class:`LlamaEngines`; ``build.py`` builds the pinned, patched library (``make llamacpp``, ``patches/``)
and ``check.py`` checks batch invariance. Importing this package does not import llama_cpp: that
happens when a model is loaded.
"""

from .drafter import LlamaCppDrafter
from .model import GGUFModel, LlamaCppError, PromptReuse, set_batch_invariant
from .pair import LlamaEngines, LlamaPair, gguf_path, llama_eos_ids, load_llama_pair, resolve_threads
from .target import LlamaCppTarget

__all__ = ["GGUFModel", "LlamaCppTarget", "LlamaCppDrafter", "LlamaCppError", "PromptReuse", "set_batch_invariant",
           "LlamaPair", "LlamaEngines", "gguf_path", "load_llama_pair", "llama_eos_ids", "resolve_threads"]
