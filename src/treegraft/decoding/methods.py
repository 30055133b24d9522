"""The methods there are, their variants (``fixed@self_draft``, ``treegraft@t_mid_x1.25``), and the learned
methods' policies: where they were fitted (:func:`find_artifacts`) and how they load. Building a decoder
for a method is :func:`treegraft.front.decoder_for`."""

from __future__ import annotations

from pathlib import Path

from ..drafters.small import small_config
from ..paths import CONF_DIR
from .tree_config import METHOD_PRESETS

__all__ = ["METHODS", "LEARNED_METHODS", "LEARNED_ARTIFACTS", "TREE_METHODS", "load_learned_scheduler", "find_artifacts",
           "parse_method", "method_small", "small_settings", "small_names"]

# learned policies on the shared tree: the distilled scheduler and the value system itself
# the files each learned method's policy is loaded from, relative to an experiment's artifacts folder
LEARNED_ARTIFACTS = {
    "treegraft": ("distill/scheduler.pt", "distill/scheduler.meta.json"),
    "direct_planner": ("fit/value_heads.pt", "fit/value_heads.meta.json"),
}
LEARNED_METHODS = tuple(LEARNED_ARTIFACTS)
METHODS = ("ar", *METHOD_PRESETS, *LEARNED_METHODS, "hf_assisted", "hf_prompt_lookup")
# the methods that build a draft tree (and so have a small drafter a variant may choose)
TREE_METHODS = (*METHOD_PRESETS, *LEARNED_METHODS)
SMALL_CONF_DIR = CONF_DIR / "small"


def small_names() -> list[str]:
    """The small drafter configs there are (``conf/small/<name>.yaml``)."""
    return sorted(p.stem for p in SMALL_CONF_DIR.glob("*.yaml"))


def small_settings(name: str) -> dict:
    """The settings dict of ``conf/small/<name>.yaml`` (for ``treegraft.front.decoder_for(small=...)``); an unknown name is
    an error naming the known ones."""
    from omegaconf import OmegaConf

    known = small_names()
    if name not in known:
        raise ValueError(f"unknown small drafter {name!r}; expected one of {', '.join(known)}")
    settings = OmegaConf.to_container(OmegaConf.load(SMALL_CONF_DIR / f"{name}.yaml"), resolve=True)
    small_config(settings)  # a config file with a bad setting fails here, in one line
    return settings


def _variant_parts(method: str) -> tuple[str, dict[str, float], str | None]:
    """``method`` split into its base, runtime-context scales and small drafter (see :func:`parse_method`)."""
    base, _, rest = method.partition("@")
    scales: dict[str, float] = {}
    small = None
    smalls = small_names()

    def bad() -> ValueError:
        return ValueError(f"bad method variant {method!r}; expected <tree method>@<small drafter> with a tree method "
                          f"({', '.join(TREE_METHODS)}) and a small drafter of conf/small ({', '.join(smalls)}), "
                          f"and/or <learned method>@t_tgt_x<scale> / t_mid_x<scale>, joined by +, "
                          f"e.g. fixed@self_draft, treegraft@t_mid_x1.25")

    for part in filter(None, rest.split("+")):
        if part in smalls:
            if base not in TREE_METHODS or small is not None:
                raise bad()
            small = part
            continue
        name, sep, value = part.rpartition("_x")
        if not sep or name not in ("t_tgt", "t_mid") or base not in LEARNED_METHODS or name in scales:
            raise bad()
        try:
            scales[name] = float(value)
        except ValueError:
            raise bad() from None
    if rest and not scales and small is None:  # "fixed@": a variant that names nothing
        raise bad()
    return base, scales, small


def parse_method(method: str) -> tuple[str, dict[str, float]]:
    """``"treegraft@t_mid_x1.25"`` -> ``("treegraft", {"t_mid": 1.25})``: a learned method run with its
    calibrated runtime context rescaled (the sensitivity variants; ``+`` joins several), or a plain
    method name with no scales. Any tree method may also name a small drafter (a config of
    ``conf/small``: ``"fixed@self_draft"`` -> ``("fixed", {})``; :func:`method_small` returns it)."""
    base, scales, _ = _variant_parts(method)
    return base, scales


def method_small(method: str) -> str | None:
    """The small drafter a method variant names (``"fixed@self_draft"`` -> ``"self_draft"``), None where it
    names none (``"fixed"``, ``"treegraft@t_mid_x1.25"``: the configured small drafter)."""
    return _variant_parts(method)[2]


def find_artifacts(method: str, pair: str, engine: str, output_dir: str | Path) -> Path:
    """The experiment folder (``<output_dir>/pipeline/<experiment>``) holding the newest ``method`` policy
    fitted on ``pair`` with ``engine``: its artifacts' metadata lists the pair among the pairs it was fitted
    on, and the stage's recorded config names the engine. So ``make all`` then ``generate method=treegraft``
    finds what ``make all`` fitted under its own experiment. None found is one line naming what was looked at."""
    import json

    from omegaconf import OmegaConf

    from ..errors import MissingArtifactError

    if method not in LEARNED_ARTIFACTS:
        raise ValueError(f"method {method!r} has no learned artifacts; expected one of {', '.join(LEARNED_METHODS)}")
    weights, meta_name = (Path(name) for name in LEARNED_ARTIFACTS[method])
    root = Path(output_dir) / "pipeline"
    found, seen = [], []
    for meta in root.glob(f"*/{meta_name}"):
        folder = meta.parents[len(meta_name.parts) - 1]
        seen.append(folder.name)
        config = meta.parent / "config.yaml"
        if not (folder / weights).exists() or not config.exists():
            continue
        fitted_on = json.loads(meta.read_text()).get("pairs") or []
        fitted_with = OmegaConf.load(config).get("engine", {}).get("name", "torch")
        if pair in fitted_on and fitted_with == engine:
            found.append(((folder / weights).stat().st_mtime, folder))
    if not found:
        looked = f" (looked at {', '.join(sorted(seen))})" if seen else ""
        raise MissingArtifactError(
            f"no {method} policy fitted on pair {pair} with engine {engine} under {root}{looked}: run `make collect fit "
            f"distill` for an experiment with this pair and engine, or set method.artifacts=<outputs/pipeline/<experiment>>")
    return max(found)[1]


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
