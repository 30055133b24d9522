"""Hydra/OmegaConf glue shared by the entry points (the library itself never needs Hydra)."""

from __future__ import annotations

import sys
from pathlib import Path

from omegaconf import OmegaConf

from .paths import CONF_DIR, REPO_ROOT

__all__ = ["CONF_DIR", "register_resolvers", "check_config_choices"]


def register_resolvers() -> None:
    """Register ``${tg_repo_root:}`` (idempotent); call before composing a config."""
    if not OmegaConf.has_resolver("tg_repo_root"):
        OmegaConf.register_new_resolver("tg_repo_root", lambda: str(REPO_ROOT))


register_resolvers()


def check_config_choices(argv: list[str] | None = None, conf_dir=CONF_DIR) -> None:
    """Exit with one line (status 2) when a command-line override names a config that does not exist,
    e.g. ``pair=nope``: "error: unknown pair 'nope'; available: a, b, c". Hydra would print a listing
    and a stack-trace hint; entry points call this before Hydra parses their arguments."""
    for arg in sys.argv[1:] if argv is None else argv:
        key, sep, value = arg.lstrip("+").partition("=")
        if sep and "." in key and not key.startswith(("~", "-")):
            _check_setting(key, conf_dir)
        if not sep or "." in key or "/" in key or key.startswith(("~", "-")):
            continue
        group = Path(conf_dir) / key
        if not group.is_dir():
            continue
        available = sorted(p.stem for p in group.glob("*.yaml"))
        for choice in value.split(","):  # multirun: -m pair=a,b
            if choice and choice != "null" and choice not in available:
                print(f"error: unknown {key} {choice!r}; available: {', '.join(available)}", file=sys.stderr)
                sys.exit(2)


# groups whose options name every setting the code reads (the tree group is TreeConfig's fields): a
# dotted override of a setting no option has is a typo, which the library would otherwise never see
SETTING_GROUPS = ("tree", "method", "engine", "small")


def _check_setting(key: str, conf_dir) -> None:
    """Exit with one line (status 2) when ``key`` (``tree.bugdet``) names no setting of its group."""
    group, *path = key.split(".")
    folder = Path(conf_dir) / group
    if group not in SETTING_GROUPS or not folder.is_dir():
        return
    options = [OmegaConf.to_container(OmegaConf.load(f)) for f in sorted(folder.glob("*.yaml"))]
    level = options
    for depth, name in enumerate(path):
        known = sorted({k for option in level if isinstance(option, dict) for k in option})
        if name not in known:
            where = ".".join([group, *path[:depth]])
            print(f"error: unknown {where} setting {name!r}; expected one of {', '.join(known)}", file=sys.stderr)
            sys.exit(2)
        level = [option[name] for option in level if isinstance(option, dict) and name in option]
