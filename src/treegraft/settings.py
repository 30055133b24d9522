"""A run's settings, read once from its Hydra config: :class:`RunSettings` (the tree, the small drafter, the engine).

Every entry point (the pipeline stages, ``treegraft.generate``, the engine benchmark) builds one with
:meth:`RunSettings.of` and hands the object down; nothing else reads the ``tree`` or ``small`` node of a
config. A bad setting (``tree.bugdet=8``) is refused here, in one line, before any model is loaded.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Sequence

from .decoding.methods import method_small, small_settings
from .decoding.tree_config import TreeConfig, tree_config_from
from .drafters.small import small_config
from .front import EngineSettings

__all__ = ["RunSettings", "tree_variant"]


def _plain(node) -> dict | None:
    """A config node as a plain dict (interpolations resolved), None for an absent or empty one."""
    if not node:
        return None
    from omegaconf import DictConfig, OmegaConf

    return OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else copy.deepcopy(dict(node))


def tree_variant(tree: dict, overrides: Sequence[str]) -> dict:
    """``tree`` with dotted overrides applied (``["shape=paper", "ngram.copy_len=0"]``, YAML values), as a
    new plain dict."""
    from omegaconf import OmegaConf

    merged = OmegaConf.merge(OmegaConf.create(tree), OmegaConf.from_dotlist(list(overrides)))
    return OmegaConf.to_container(merged, resolve=True)


@dataclass(frozen=True)
class RunSettings:
    """The settings a run's decoders are built from.

    ``tree``: the ``tree`` group as given (a plain dict, interpolations resolved, keys in the config's
    order: it is hashed into evaluate's run key as it is); read it, never change it (:meth:`tree_with`
    gives a changed copy). ``small``: the ``small`` group as a plain dict (None where absent).
    ``engine``: the ``engine`` group (:class:`~treegraft.front.EngineSettings`)."""

    tree: dict = field(default_factory=dict)
    small: dict | None = None
    engine: EngineSettings = field(default_factory=EngineSettings)

    def __post_init__(self):
        self.tree_config("all_small")  # an unknown or bad tree setting: one line, here
        small_config(self.small)  # likewise for the small drafter

    @classmethod
    def of(cls, cfg: Any) -> "RunSettings":
        """From an entry point's config (its ``tree``, ``small`` and ``engine`` nodes); a RunSettings is
        returned as it is."""
        if isinstance(cfg, RunSettings):
            return cfg
        get = cfg.get if hasattr(cfg, "get") else lambda key: getattr(cfg, key, None)
        return cls(tree=_plain(get("tree")) or {}, small=_plain(get("small")), engine=EngineSettings.of(cfg))

    def tree_config(self, method: str) -> TreeConfig:
        """The :class:`TreeConfig` of tree method ``method`` (a key of ``METHOD_PRESETS``) on these settings."""
        return tree_config_from(method, self.tree)

    def tree_with(self, **changes) -> dict:
        """The tree settings with ``changes`` (top-level keys) applied, as a new dict."""
        return {**copy.deepcopy(self.tree), **changes}

    @property
    def depth(self) -> int:
        """D, the drafting steps of a turn (``tree.depth``)."""
        return self.tree_config("all_small").depth

    @property
    def budget_setting(self) -> str:
        """``tree.budget`` as configured (``"auto"`` or a number), as the records and runtime.json write it."""
        return str(self.tree_config("all_small").budget)

    @property
    def tree_shape(self) -> str:
        """``tree.shape`` as configured (``auto`` or ``paper``)."""
        return self.tree_config("all_small").shape

    def small_for(self, method: str) -> dict | None:
        """The small drafter settings ``method`` runs with: the one its variant names (``fixed@self_draft``),
        else the configured ``small`` group; None for the n-gram drafter."""
        name = method_small(method)
        settings = small_settings(name) if name else self.small
        return None if not settings or settings.get("name") == "ngram" else settings
