"""Where things live: the repository root, its Hydra configs, and the data/model caches."""

from __future__ import annotations

import os
from pathlib import Path

# src/treegraft/paths.py -> repository root (the package is installed editable, `pip install -e .`)
REPO_ROOT = Path(__file__).resolve().parents[2]
CONF_DIR = REPO_ROOT / "conf"


def default_models_dir() -> Path:
    """Converted embedded models: $TREEGRAFT_MODELS, else <repo>/data/models."""
    return Path(os.environ.get("TREEGRAFT_MODELS", REPO_ROOT / "data" / "models"))


def default_benchmarks_dir() -> Path:
    """Benchmark question files: $TREEGRAFT_BENCHMARKS, else <repo>/data/benchmarks."""
    return Path(os.environ.get("TREEGRAFT_BENCHMARKS", REPO_ROOT / "data" / "benchmarks"))


def default_cache_dir() -> Path:
    """Per-machine measurements (runtime choice, verification curves): $TREEGRAFT_CACHE, else <repo>/outputs/cache."""
    return Path(os.environ.get("TREEGRAFT_CACHE", REPO_ROOT / "outputs" / "cache"))
