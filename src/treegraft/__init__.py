"""TreeGraft: adaptive multi-drafter grafting for tree-based speculative decoding.

The library is usable without Hydra::

    from treegraft.models import PairSpec, load_pair
    from treegraft.decoding import AutoregressiveDecoder
"""

__version__ = "0.1.0"
