"""Hydra/OmegaConf glue shared by the entry points (the library itself never needs Hydra)."""

from __future__ import annotations

from omegaconf import OmegaConf

from .paths import CONF_DIR, REPO_ROOT

__all__ = ["CONF_DIR", "register_resolvers"]


def register_resolvers() -> None:
    """Register ``${tg_repo_root:}`` (idempotent); call before composing a config."""
    if not OmegaConf.has_resolver("tg_repo_root"):
        OmegaConf.register_new_resolver("tg_repo_root", lambda: str(REPO_ROOT))


register_resolvers()
