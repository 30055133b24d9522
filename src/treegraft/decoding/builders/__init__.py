"""Tree builders, one per construction, behind one interface (:class:`TreeBuilder`): ``start`` a turn's
tree, ``apply_step`` one drafting step with an action, ``build`` all D steps."""

from ..tree_config import TreeConfig
from .base import BuildState, TreeBuilder, TurnPlan
from .csd import CascadeChainBuilder
from .shared import SharedTreeBuilder
from .single import SingleDrafterBuilder

__all__ = ["TreeBuilder", "TurnPlan", "BuildState", "SingleDrafterBuilder", "SharedTreeBuilder", "CascadeChainBuilder",
           "builder_for"]


def builder_for(cfg: TreeConfig, ngram, middle=None, clock=None, small=None,
                small_top_m: int | None = None) -> TreeBuilder:
    """The builder of ``cfg``'s method: the cascade chain (``csd``), the shared tree, or single-drafter;
    ``small``: a neural small drafter in place of the n-gram drafter (:class:`TreeBuilder`)."""
    preset = cfg.preset
    if preset.csd:
        return CascadeChainBuilder(cfg, ngram, middle, clock, small, small_top_m)
    return (SharedTreeBuilder if preset.shared else SingleDrafterBuilder)(cfg, ngram, middle, clock, small, small_top_m)
