"""TreeGraft behind transformers' ``model.generate()``: what ``custom_generate/generate.py`` calls.

    out = model.generate(input_ids, custom_generate="/path/to/treegraft", trust_remote_code=True,
                         assistant_model=middle, method="fixed", max_new_tokens=128, do_sample=False,
                         streamer=TextIteratorStreamer(tokenizer))

The calling model is the target; ``assistant_model`` is the middle drafter (or ``self_draft_layers=k``
runs the target's first k layers as one). Our keyword arguments: ``method`` (``fixed`` by default;
``treegraft`` / ``direct_planner`` need ``scheduler_artifacts``, the experiment folder that holds
``distill/`` and ``fit/``; ``ar``, ``all_small``, ``all_mid``, ``all_call``, ``csd`` and the
ablations), ``tree`` (a dict of :class:`~treegraft.decoding.TreeConfig` settings, e.g.
``{"budget": "auto", "shape": "auto"}``). Honoured: ``max_new_tokens`` / ``max_length``,
``min_new_tokens`` / ``min_length`` (EOS held back in the target's own logits, as transformers does),
``eos_token_id``, ``do_sample``, ``temperature``, ``top_k``, ``top_p`` (sampling keeps the target's
distribution; the seed is drawn from torch's global generator, so ``torch.manual_seed`` governs it),
``streamer`` (tokens arrive turn by turn) and ``return_dict_in_generate`` (``sequences``). Anything
that cannot be honoured losslessly (a batch of several prompts, padding, beams, penalties, logits
processors, stopping criteria, scores) is refused with one clear error.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from .decoding.methods import LEARNED_METHODS, load_learned_scheduler
from .decoding.sampling import SamplingConfig
from .decoding.tree_config import METHOD_PRESETS, tree_config_from
from .engines.torch import TorchEngines
from .front import decoder_for

__all__ = ["treegraft_generate", "TreeGraftGenerateError"]


class TreeGraftGenerateError(ValueError):
    """An argument of ``model.generate(custom_generate=...)`` TreeGraft cannot honour."""


# generation-config fields that change which tokens come out; only their neutral values are allowed
_NEUTRAL = {
    "num_beams": 1, "num_beam_groups": 1, "penalty_alpha": None, "repetition_penalty": 1.0,
    "encoder_repetition_penalty": 1.0, "length_penalty": 1.0, "no_repeat_ngram_size": 0, "bad_words_ids": None,
    "force_words_ids": None, "typical_p": 1.0, "epsilon_cutoff": 0.0,
    "eta_cutoff": 0.0, "min_p": None, "diversity_penalty": 0.0, "sequence_bias": None, "suppress_tokens": None,
    "begin_suppress_tokens": None, "forced_bos_token_id": None, "forced_eos_token_id": None, "guidance_scale": None,
    "output_scores": False, "output_logits": False, "output_attentions": False, "output_hidden_states": False,
    "num_return_sequences": 1, "stop_strings": None, "exponential_decay_length_penalty": None,
}
_IGNORED = {"use_cache", "pad_token_id", "bos_token_id", "decoder_start_token_id", "renormalize_logits",
            "cache_implementation", "use_model_defaults", "synced_gpus"}


def _check(name: str, value, neutral) -> None:
    if value is None or value == neutral or (neutral is None and value in ((), [], {})):
        return
    raise TreeGraftGenerateError(
        f"{name}={value!r} is not supported by TreeGraft's lossless decoding (expected {neutral!r}); "
        "pass the neutral value or use the standard generate()"
    )


def treegraft_generate(model: nn.Module, inputs: torch.Tensor | None = None, *, input_ids: torch.Tensor | None = None,
                       attention_mask: torch.Tensor | None = None, generation_config=None, logits_processor=None,
                       stopping_criteria=None, prefix_allowed_tokens_fn=None, synced_gpus=None, assistant_model=None,
                       streamer=None, negative_prompt_ids=None, negative_prompt_attention_mask=None,
                       method: str = "fixed", tree: dict | None = None, scheduler_artifacts: str | None = None,
                       self_draft_layers: int | None = None, **kwargs):
    """Run TreeGraft with ``model`` as target; arguments as :meth:`transformers.GenerationMixin.generate`
    plus ``method``, ``tree``, ``scheduler_artifacts`` and ``self_draft_layers`` (module docstring)."""
    from transformers.generation.utils import GenerateDecoderOnlyOutput

    from .models import make_self_draft

    ids = input_ids if input_ids is not None else inputs
    if ids is None:
        raise TreeGraftGenerateError("no prompt: pass input_ids (a [1, T] tensor of token ids)")
    ids = torch.as_tensor(ids)
    if ids.dim() == 1:
        ids = ids[None]
    if ids.dim() != 2 or ids.shape[0] != 1:
        raise TreeGraftGenerateError(f"TreeGraft decodes one sequence at a time: got input_ids of shape {tuple(ids.shape)}, "
                                     "expected [1, T] (call generate once per prompt)")
    if attention_mask is not None and not bool(torch.as_tensor(attention_mask).all()):
        raise TreeGraftGenerateError("attention_mask with padding is not supported: pass one unpadded prompt")
    for name, value in (("logits_processor", logits_processor), ("stopping_criteria", stopping_criteria),
                        ("prefix_allowed_tokens_fn", prefix_allowed_tokens_fn), ("negative_prompt_ids", negative_prompt_ids),
                        ("negative_prompt_attention_mask", negative_prompt_attention_mask)):
        if value is not None and (not hasattr(value, "__len__") or len(value)):
            raise TreeGraftGenerateError(f"{name} is not supported by TreeGraft's lossless decoding: it would change "
                                         "the target's distribution outside the verification")

    gc = copy.deepcopy(generation_config if generation_config is not None else model.generation_config)
    for key in _IGNORED:
        kwargs.pop(key, None)
    unused = gc.update(**kwargs)
    if unused:
        raise TreeGraftGenerateError(f"unsupported argument(s) for TreeGraft generate: {', '.join(sorted(unused))}")
    for name, neutral in _NEUTRAL.items():
        _check(name, getattr(gc, name, None), neutral)

    prompt = ids[0].tolist()
    if gc.max_new_tokens is not None:
        max_new = int(gc.max_new_tokens)
    elif gc.max_length is not None:
        max_new = int(gc.max_length) - len(prompt)
    else:
        raise TreeGraftGenerateError("set max_new_tokens (or max_length)")
    # transformers' two minimum-length rules, both in new tokens here (min_length counts the prompt)
    min_new = max(int(gc.min_new_tokens or 0), int(gc.min_length or 0) - len(prompt), 0)
    eos = gc.eos_token_id
    eos_ids = set() if eos is None else ({int(eos)} if isinstance(eos, int) else {int(e) for e in eos})
    if gc.do_sample:
        seed = int(torch.randint(0, 2**31 - 1, (1,)))  # torch.manual_seed before generate() governs it
        sampling = SamplingConfig(temperature=float(gc.temperature or 1.0), top_p=float(gc.top_p or 1.0),
                                  top_k=int(gc.top_k or 0), seed=seed)
    else:
        sampling = SamplingConfig()

    middle = assistant_model
    if middle is None and self_draft_layers is not None:
        middle = make_self_draft(model, int(self_draft_layers))
    scheduler = None
    if method in LEARNED_METHODS:
        if scheduler_artifacts is None:
            raise TreeGraftGenerateError(f"method {method} needs scheduler_artifacts=<the experiment's outputs folder>")
        scheduler = load_learned_scheduler(method, scheduler_artifacts)
    calls = method in LEARNED_METHODS or method == "hf_assisted" or (
        method in METHOD_PRESETS and tree_config_from(method, tree).preset.schedule != "small")
    if middle is None and calls:
        raise TreeGraftGenerateError(f"method {method} calls a middle drafter: pass assistant_model= or self_draft_layers=")
    decoder = decoder_for(method, TorchEngines(model, middle), tree, sampling, scheduler, eos_ids=eos_ids)
    if scheduler is not None:
        decoder.warm_up(prompt, 4)  # the learned policy's runtime context

    on_tokens = None
    if streamer is not None:
        streamer.put(ids.cpu())  # transformers' convention: the prompt first (TextStreamer may skip it)
        on_tokens = lambda new: streamer.put(torch.tensor(new, dtype=torch.long)) if new else None  # noqa: E731
    try:
        result = decoder.generate(prompt, max_new, on_tokens=on_tokens, min_new_tokens=min_new)
    finally:
        if streamer is not None:
            streamer.end()
    sequences = torch.tensor([prompt + result.tokens], dtype=torch.long, device=ids.device)
    if gc.return_dict_in_generate:
        return GenerateDecoderOnlyOutput(sequences=sequences)
    return sequences
