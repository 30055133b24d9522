"""Model loading: embedded GGUF models, hub/local models, tiny random models, self-draft pairs."""

from .embedded import DEFAULT_MODELS, EMBEDDED_MODELS, EmbeddedModel, prepare_embedded_model
from .loading import LoadedPair, PairSpec, load_model, load_pair, load_pair_from_settings
from .placement import Placement
from .self_draft import make_self_draft
from .sources import ModelLoadError, TokenizerMismatchError, check_same_vocabulary, load_tokenizer, resolve_dtype
from .tiny import build_tiny_model, build_tiny_tokenizer

__all__ = [
    "DEFAULT_MODELS",
    "EMBEDDED_MODELS",
    "EmbeddedModel",
    "LoadedPair",
    "ModelLoadError",
    "PairSpec",
    "Placement",
    "TokenizerMismatchError",
    "build_tiny_model",
    "build_tiny_tokenizer",
    "check_same_vocabulary",
    "load_model",
    "load_pair",
    "load_pair_from_settings",
    "load_tokenizer",
    "make_self_draft",
    "prepare_embedded_model",
    "resolve_dtype",
]
