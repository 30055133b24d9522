"""The tree's settings: the method presets and :class:`TreeConfig` (plain dataclasses, no Hydra)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

from ..drafters.ngram import NGramConfig
from ..tree import MIDDLE, SMALL

__all__ = ["MethodPreset", "METHOD_PRESETS", "TreeConfig", "auto_shape", "tree_config_from"]


@dataclass(frozen=True)
class MethodPreset:
    """How a method builds its tree.

    shared: the shared-tree construction (asymmetric rescoring, grafting) rather than
        the single-drafter construction.
    schedule: ``"small"`` (every step skips), ``"mid"`` (every step calls) or ``"fixed"``
        (``TreeConfig.schedule``).
    """

    shared: bool
    schedule: str
    grafting: str = "nondestructive"
    expanded_selection: bool = True
    csd: bool = False  # Cascade-Speculative-Drafting chain instead of a tree


METHOD_PRESETS: dict[str, MethodPreset] = {
    "all_small": MethodPreset(shared=False, schedule="small"),
    "all_mid": MethodPreset(shared=False, schedule="mid"),
    "fixed": MethodPreset(shared=True, schedule="fixed"),
    "all_call": MethodPreset(shared=True, schedule="mid"),
    "no_nondestructive": MethodPreset(shared=True, schedule="fixed", grafting="destructive"),
    "no_expanded_selection": MethodPreset(shared=True, schedule="fixed", expanded_selection=False),
    "csd": MethodPreset(shared=False, schedule="mid", csd=True),
}


@dataclass
class TreeConfig:
    """Tree and drafter settings. The defaults are the project's (those of ``conf/tree/default.yaml``,
    which a test keeps equal): the paper's D, W, m (Appendix E) with B_ver and the shape measured on
    the machine; :meth:`paper` gives the paper's GPU-shaped tree (B_ver = 63, whole-tree rescoring).

    method: a key of ``METHOD_PRESETS``: ``all_small`` / ``all_mid`` (single-drafter endpoints),
        ``fixed`` (shared tree, ``schedule``), ``all_call`` (shared tree, every step a call),
        ``no_nondestructive`` / ``no_expanded_selection`` (ablations of ``fixed``), ``csd`` (a
        Cascade-Speculative-Drafting chain: the middle drafter drafts D tokens, itself sped up by the
        n-gram drafter's proposals, and the target verifies the chain).
    depth: D drafting steps; width: W nodes expanded per step; top_m: children per expanded node.
    budget: B_ver, non-root nodes verified per turn, or ``"auto"``: chosen before every turn by
        expected throughput from the measured verification curve and the acceptance observed so far
        (:class:`treegraft.decoding.budget.BudgetPlanner`), up to ``auto_max_budget``.
    shape: ``"paper"``: every step expands ``width`` nodes with ``top_m`` children and a middle step
        rescores the whole tree (the paper's construction, GPU-shaped); ``"auto"``: W, m and the middle step's rescoring
        scope follow B_ver (:func:`auto_shape`; ``width`` / ``top_m`` become caps), so construction
        grows with B_ver, not with W * m * D.
    draft_vocab: size K of the middle drafter's restricted draft vocabulary (the K most frequent
        tokens plus the context's, :mod:`treegraft.drafters.vocab`); None = the full vocabulary.
    middle_scope: with ``shape=auto``, at most this many nodes (in pruning order, root aside) a middle step
        rescores and may graft under, whatever B_ver's scope: on a CPU every scope node is a row of the
        middle drafter's call (None = B_ver's ``2 * B + W``).
    node_cap: construction stops adding nodes past this many.
    schedule: the fixed schedule (1 = call the middle drafter, 0 = skip) of ``fixed`` and the ablations.
    grafting / expanded_selection: override the method's preset (``nondestructive|destructive``, bool).
    max_calls_per_turn: optional per-turn budget of middle-drafter calls (later steps are forced to skip).
    call_backoff: with a learned scheduler, stop calling the middle drafter for a few turns when this
        prompt's call turns produce fewer tokens per second than plain decoding would
        (:class:`~treegraft.decoding.backoff.CallGate`); fixed schedules never back off.
    skip_beyond_budget: leave out the work of a step that cannot change the pruned tree (every node it
        could add or rescore lies deeper than B_ver, so pruning would drop it); the verified tree is the
        same, only the wasted drafter calls go. Matters where B_ver is small (``auto`` on a CPU).
    """

    method: str = "all_small"
    depth: int = 5
    width: int = 10
    top_m: int = 10
    budget: int | str = "auto"
    node_cap: int = 511
    schedule: list[int] = field(default_factory=lambda: [1, 0, 1, 0, 1])
    grafting: str | None = None
    expanded_selection: bool | None = None
    max_calls_per_turn: int | None = None
    ngram: NGramConfig = field(default_factory=NGramConfig)
    auto_max_budget: int = 63
    skip_beyond_budget: bool = True
    call_backoff: bool = True
    shape: str = "auto"
    draft_vocab: int | None = None
    middle_scope: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.ngram, dict):
            self.ngram = NGramConfig(**self.ngram)
        if self.method not in METHOD_PRESETS:
            raise ValueError(f"unknown tree method {self.method!r}; expected one of {sorted(METHOD_PRESETS)}")
        for name in ("depth", "width", "top_m", "node_cap"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.budget != "auto" and int(self.budget) < 0:
            raise ValueError(f"budget must be an int >= 0 or 'auto', got {self.budget!r}")
        self.schedule = [int(a) for a in self.schedule]
        uses_schedule = METHOD_PRESETS[self.method].schedule == "fixed"
        if uses_schedule and (len(self.schedule) != self.depth or any(a not in (0, 1) for a in self.schedule)):
            raise ValueError(f"schedule must be {self.depth} actions of 0 (skip) or 1 (call), got {self.schedule}")
        if self.grafting not in (None, "nondestructive", "destructive"):
            raise ValueError(f"grafting must be nondestructive or destructive, got {self.grafting!r}")
        if self.shape not in ("auto", "paper"):
            raise ValueError(f"shape must be auto or paper, got {self.shape!r}")
        if self.draft_vocab is not None and int(self.draft_vocab) < 1:
            raise ValueError(f"draft_vocab must be a positive size or null, got {self.draft_vocab!r}")
        if self.middle_scope is not None and int(self.middle_scope) < 1:
            raise ValueError(f"middle_scope must be a positive number of nodes or null, got {self.middle_scope!r}")

    @classmethod
    def paper(cls, **overrides) -> "TreeConfig":
        """The paper's tree (Appendix E: B_ver = 63, W = m = 10, whole-tree rescoring) and n-gram drafter
        (the cached target log-probabilities over the full vocabulary, no copy chain)."""
        ngram = NGramConfig(prefill_vocab=None, copy_len=0, scoring="target")
        return cls(**{"budget": 63, "shape": "paper", "ngram": ngram, **overrides})

    @property
    def preset(self) -> MethodPreset:
        base = METHOD_PRESETS[self.method]
        return MethodPreset(
            shared=base.shared,
            schedule=base.schedule,
            grafting=self.grafting or base.grafting,
            expanded_selection=base.expanded_selection if self.expanded_selection is None else self.expanded_selection,
            csd=base.csd,
        )

    def actions(self) -> list[int]:
        """The method's schedule for one turn."""
        kind = self.preset.schedule
        if kind == "small":
            return [SMALL] * self.depth
        if kind == "mid":
            return [MIDDLE] * self.depth
        return list(self.schedule)


def auto_shape(budget: int, max_width: int = 10, max_top_m: int = 10) -> tuple[int, int, int]:
    """``(W, m, scope)`` of ``shape=auto`` for B_ver = ``budget``.

    W = m = 1 + ceil(sqrt(B)) (capped): about D * W * m = 5 * (1 + sqrt B)^2 candidates for B kept
    nodes, enough to fill the budget with the best-scored ones (B = 8: 4 x 4; B = 31: 7 x 7; B = 63:
    9 x 9, the paper's size). A middle step rescores (and may graft under) only the first
    ``scope = 2 * B + W`` nodes in pruning order: nodes ranked below cannot enter the verified tree
    unless the middle drafter lifts them, and encoding them would cost a forward row each.
    """
    side = 1 + math.ceil(math.sqrt(max(int(budget), 1)))
    return min(max_width, side), min(max_top_m, side), 2 * int(budget) + side


def tree_config_from(method: str, tree: dict | None) -> TreeConfig:
    """A :class:`TreeConfig` for ``method`` from a plain dict of tree settings (e.g. the Hydra `tree` group);
    a key that is not a setting (a typo such as ``bugdet``) is an error naming it and the known ones."""
    known = {f.name for f in fields(TreeConfig)} - {"method"}
    unknown = sorted(set(tree or {}) - known)
    if unknown:
        raise ValueError(f"unknown tree setting {', '.join(map(repr, unknown))}; expected one of {', '.join(sorted(known))}")
    return TreeConfig(method=method, **(tree or {}))
