"""llama.cpp as the CPU engine: GGUF target and middle drafter through llama-cpp-python's low-level API.

``engine.py`` implements the decoder's engine seam (target tree verification in one multi-sequence
batch, the middle drafter's incremental tree encoding), ``build.py`` builds the pinned, patched
library (``make llamacpp``), ``costs.py`` measures this engine's cost curve, ``pair.py`` loads GGUF
pairs and builds decoders. Importing this package does not import llama_cpp: that happens when a
model is loaded.
"""

from .engine import GGUFModel, LlamaCppDrafter, LlamaCppError, LlamaCppTarget, set_batch_invariant
from .pair import (LlamaAutoregressive, LlamaPair, gguf_path, llama_decoder_for, llama_eos_ids, load_llama_pair,
                   resolve_threads)

__all__ = ["GGUFModel", "LlamaCppTarget", "LlamaCppDrafter", "LlamaCppError", "set_batch_invariant", "LlamaPair",
           "LlamaAutoregressive", "gguf_path", "load_llama_pair", "llama_decoder_for", "llama_eos_ids",
           "resolve_threads"]
