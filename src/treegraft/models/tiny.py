"""Tiny randomly initialised models and their tokenizer, built from code (no download), for tests.

``tiny-random:<seed>`` is a 2-layer Llama over a byte-level vocabulary of 256 bytes plus three
special tokens. Two seeds give two unrelated models of one vocabulary: the tiny pair's target and
middle drafter. Weights are drawn with a larger init scale than usual so that next-token
distributions are peaked and greedy decoding repeats itself, as real models do (the n-gram drafter
then has something to find).
"""

from __future__ import annotations

import torch

__all__ = ["TINY_PREFIX", "TINY_SPECIAL_TOKENS", "build_tiny_tokenizer", "build_tiny_config", "build_tiny_model",
           "tiny_model_of"]

TINY_PREFIX = "tiny-random:"
TINY_SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>")


def build_tiny_tokenizer():
    """A byte-level BPE tokenizer with no merges: one token per byte, ids 3..258; specials 0..2."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {tok: i for i, tok in enumerate(TINY_SPECIAL_TOKENS)}
    for ch in sorted(bytes_to_unicode().values(), key=lambda c: ord(c)):
        vocab[ch] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", model_max_length=2048
    )
    return tok


def build_tiny_config(vocab_size: int = 259, num_layers: int = 2):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        initializer_range=0.25,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )


def build_tiny_model(seed: int = 0, num_layers: int = 2):
    """A tiny Llama whose weights depend only on ``seed``."""
    from transformers import LlamaForCausalLM

    cpu_rng = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = LlamaForCausalLM(build_tiny_config(num_layers=num_layers))
    finally:
        torch.random.set_rng_state(cpu_rng)
    model.generation_config.eos_token_id = 2
    model.generation_config.pad_token_id = 0
    return model.eval()


def tiny_model_of(source: str):
    """The tiny random model a ``tiny-random:<seed>`` source names (seed 0 when none is given)."""
    return build_tiny_model(int(source[len(TINY_PREFIX):] or 0))
