"""TreeGraft as a transformers `custom_generate` decoding method (see README.md next to this file).

transformers loads this file when `model.generate(..., custom_generate=<the folder holding
custom_generate/>, trust_remote_code=True)` is called, and calls `generate(model=..., **arguments)`.
The decoding itself lives in the installed `treegraft` package.
"""

from treegraft.hf_generate import treegraft_generate


def generate(model, *args, **kwargs):
    """TreeGraft speculative decoding with `model` as the target; arguments as `model.generate()` plus
    `method`, `tree`, `scheduler_artifacts`, `self_draft_layers` (treegraft.hf_generate)."""
    return treegraft_generate(model, *args, **kwargs)
