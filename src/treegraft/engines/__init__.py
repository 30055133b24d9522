"""The engines: the models behind a decoder, each owning its KV caches.

``protocols.py`` (the bottom of the layer) says what a decoder needs: a target engine (prefill, verify a
tree in one forward, keep/rollback, one-token step), a drafter (encode tree nodes, read log-probabilities,
commit) and a pair's engines; ``logprobs.py`` the drafters' log-probability rows; ``curves.py`` the one
cache of measured verification curves. The implementations sit side by side above them: ``torch/``
(any Hugging Face pair, CPU or GPU) and ``llama_cpp/`` (GGUF pairs on llama.cpp). The decoding loop
imports the protocols only; :mod:`treegraft.front` loads a pair on an engine and builds decoders.
"""

from .protocols import DraftModel, FrequentTokens, PairEngines, TargetEngine, TreeForward

__all__ = ["TargetEngine", "TreeForward", "DraftModel", "PairEngines", "FrequentTokens"]
