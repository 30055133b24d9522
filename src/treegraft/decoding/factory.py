"""One place that turns a method name into a decoder, for the CLI, the benchmarks and the stages."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

from ..models import LoadedPair
from .autoregressive import AutoregressiveDecoder, eos_token_ids
from .hf_peers import HFAssistedDecoder, HFPromptLookupDecoder
from .sampling import SamplingConfig
from .tree_decoder import METHOD_PRESETS, TreeConfig, TreeGraftDecoder

__all__ = ["METHODS", "LEARNED_METHODS", "LEARNED_ARTIFACTS", "build_decoder", "decoder_for", "tree_config_from",
           "load_learned_scheduler",
           "parse_method"]

# learned policies on the shared tree: the distilled scheduler and the value system itself
# the files each learned method's policy is loaded from, relative to an experiment's artifacts folder
LEARNED_ARTIFACTS = {
    "treegraft": ("distill/scheduler.pt", "distill/scheduler.meta.json"),
    "direct_planner": ("fit/value_heads.pt", "fit/value_heads.meta.json"),
}
LEARNED_METHODS = tuple(LEARNED_ARTIFACTS)
METHODS = ("ar", *METHOD_PRESETS, *LEARNED_METHODS, "hf_assisted", "hf_prompt_lookup")


def parse_method(method: str) -> tuple[str, dict[str, float]]:
    """``"treegraft@t_mid_x1.25"`` -> ``("treegraft", {"t_mid": 1.25})``: a learned method run with its
    calibrated runtime context rescaled (the sensitivity variants; ``+`` joins several), or a plain
    method name with no scales."""
    base, _, rest = method.partition("@")
    scales = {}
    for part in filter(None, rest.split("+")):
        name, sep, value = part.rpartition("_x")
        if not sep or name not in ("t_tgt", "t_mid") or base not in LEARNED_METHODS:
            raise ValueError(f"bad method variant {method!r}; expected <learned method>@t_tgt_x<scale> or "
                             f"@t_mid_x<scale> (joined by +), e.g. treegraft@t_mid_x1.25")
        scales[name] = float(value)
    return base, scales


def tree_config_from(method: str, tree: dict | None) -> TreeConfig:
    """A :class:`TreeConfig` for ``method`` from a plain dict of tree settings (e.g. the Hydra `tree` group);
    a key that is not a setting (a typo such as ``bugdet``) is an error naming it and the known ones."""
    known = {f.name for f in fields(TreeConfig)} - {"method"}
    unknown = sorted(set(tree or {}) - known)
    if unknown:
        raise ValueError(f"unknown tree setting {', '.join(map(repr, unknown))}; expected one of {', '.join(sorted(known))}")
    return TreeConfig(method=method, **(tree or {}))


def load_learned_scheduler(method: str, artifacts_dir: str | Path, threshold: float | None = None):
    """The policy of ``treegraft`` (``<dir>/distill/scheduler.pt``) or ``direct_planner`` (``<dir>/fit/``)."""
    from ..errors import MissingArtifactError
    from ..scheduling.learned import DirectPlanner, LearnedScheduler, MarginPredictor
    from ..scheduling.value import ValueSystem

    weights = Path(artifacts_dir) / LEARNED_ARTIFACTS[method][0]
    if method == "treegraft":
        if not weights.exists():
            raise MissingArtifactError(f"missing {weights}: run `make collect fit distill` for this experiment first")
        predictor = MarginPredictor.load(weights.with_suffix(""))
        fallback = predictor.meta.get("fallback")
        if fallback:  # distill found the distilled scheduler below the best fixed schedule on held-out prompts
            from ..scheduling.policy import CostAwareFixedScheduler, FixedScheduler

            if fallback.get("by_middle_cost") and fallback.get("ref_mid_over_tgt"):  # re-picked at the pair's measured costs
                return CostAwareFixedScheduler(fallback["by_middle_cost"], fallback["ref_mid_over_tgt"], fallback["schedule"])
            return FixedScheduler(fallback["schedule"])
        return LearnedScheduler(predictor, predictor.meta.get("threshold", 0.0) if threshold is None else threshold)
    if not weights.exists():
        raise MissingArtifactError(f"missing {weights}: run `make collect fit` first")
    return DirectPlanner(ValueSystem.load(weights.parent))


def build_decoder(method: str, pair: LoadedPair, tree: dict | None = None, sampling: SamplingConfig | None = None,
                  scheduler=None, cache_dir: str | Path | None = None, eager_middle_prefill: bool = False):
    """A decoder with ``.generate(prompt_ids, max_new_tokens) -> GenerationResult`` for ``method`` on a
    loaded pair (:func:`decoder_for` with the pair's models and tokenizer)."""
    return decoder_for(method, pair.target, pair.middle, pair.tokenizer, tree, sampling, scheduler, cache_dir=cache_dir,
                       eager_middle_prefill=eager_middle_prefill)


def decoder_for(method: str, target, middle, tokenizer=None, tree: dict | None = None,
                sampling: SamplingConfig | None = None, scheduler=None, eos_ids: set[int] | None = None,
                cache_dir: str | Path | None = None, eager_middle_prefill: bool = False):
    """The one method dispatch: a decoder for ``method`` over ``target`` and ``middle`` (None where the
    method never calls one).

    ``treegraft`` / ``direct_planner`` need ``scheduler`` (see :func:`load_learned_scheduler`); they
    run the shared tree with that policy deciding every step. ``eos_ids``: the ids that end generation
    (default: the target's and the tokenizer's). ``cache_dir``: where ``budget=auto`` caches the
    verification curve (default: :func:`treegraft.paths.default_cache_dir`). ``eager_middle_prefill``: the
    tree decoders encode the prompt into the middle drafter at prefill (schedule enumeration wants it).
    """
    sampling = sampling or SamplingConfig()
    eos = eos_token_ids(target, tokenizer) if eos_ids is None else set(eos_ids)
    if method == "ar":
        return AutoregressiveDecoder(target, eos, sampling)
    if method in LEARNED_METHODS:
        if scheduler is None:
            raise ValueError(f"method {method} needs its learned scheduler (load_learned_scheduler)")
        return TreeGraftDecoder(target, middle, tokenizer, tree_config_from("fixed", tree), sampling, eos,
                                scheduler=scheduler, cache_dir=cache_dir, eager_middle_prefill=eager_middle_prefill)
    if method in METHOD_PRESETS:
        return TreeGraftDecoder(target, middle, tokenizer, tree_config_from(method, tree), sampling, eos,
                                cache_dir=cache_dir, eager_middle_prefill=eager_middle_prefill)
    if method == "hf_assisted":
        return HFAssistedDecoder(target, middle, eos, sampling)
    if method == "hf_prompt_lookup":
        return HFPromptLookupDecoder(target, eos, sampling)
    raise ValueError(f"unknown method {method!r}; expected one of {', '.join(METHODS)}")
