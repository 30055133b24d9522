"""Stage artifacts: fixed paths under ``outputs/``, atomic writes, recorded configs and input hashes.

Every stage writes to ``<output_dir>/pipeline/<experiment>/<stage>/`` (not a timestamped folder),
through a temp file + rename so an interruption never leaves a half-written artifact, and records
its resolved config (``config.yaml``) and the hashes of the artifacts it read (``inputs.json``).
A stage whose inputs are missing raises :class:`MissingArtifactError` naming the stage to run.
A stage whose outputs were written from the same config and the same inputs is up to date
(:func:`up_to_date`) and skips its work unless run with ``force=true``, so
``make collect fit distill evaluate`` after an interruption redoes only what is missing.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Iterable

import pandas as pd
from omegaconf import OmegaConf

from ..atomic import atomic_torch_save, atomic_write, atomic_write_json, atomic_write_text
from ..errors import MissingArtifactError

__all__ = [
    "IN_SAMPLE_DISTILLED",
    "IN_SAMPLE_PLANNER",
    "MissingArtifactError",
    "stage_dir",
    "require",
    "atomic_write_text",
    "atomic_write_json",
    "atomic_write_parquet",
    "atomic_torch_save",
    "file_hash",
    "record_stage",
    "up_to_date",
]

# offline_eval.csv's labels of the deployed policies scored on the very turns they were fitted on (distill
# writes them; the report's figure leaves them out: it shows held-out figures only)
IN_SAMPLE_DISTILLED = "distilled, in-sample (fitted on these turns)"
IN_SAMPLE_PLANNER = "direct planner, in-sample (fitted on these turns)"

STAGES = ("collect", "fit", "distill", "evaluate", "report")


def stage_dir(output_dir: str | os.PathLike, experiment: str, stage: str) -> Path:
    if stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r}; expected one of {STAGES}")
    return Path(output_dir) / "pipeline" / experiment / stage


def require(path: Path, stage: str, experiment: str) -> Path:
    """``path`` if it exists, else a one-line error saying which stage to run first."""
    if not Path(path).exists():
        raise MissingArtifactError(
            f"missing {path}: run the `{stage}` stage first (make {stage} EXPERIMENT={experiment})"
        )
    return Path(path)


def atomic_write_parquet(df: pd.DataFrame, path: Path) -> None:
    atomic_write(path, lambda tmp: df.to_parquet(tmp, index=False))


def file_hash(path: Path) -> str:
    """sha256 of a file, or of the sorted file hashes under a directory (first 16 hex digits)."""
    path = Path(path)
    h = hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith(".")) if path.is_dir() else [path]
    for f in files:
        h.update(str(f.relative_to(path) if path.is_dir() else f.name).encode())
        h.update(hashlib.sha256(f.read_bytes()).digest())
    return h.hexdigest()[:16]


def record_stage(directory: Path, config_yaml: str, inputs: Iterable[Path] = ()) -> None:
    """Write the resolved config and the input hashes next to a stage's artifacts."""
    atomic_write_text(config_yaml, Path(directory) / "config.yaml")
    atomic_write_json({str(p): file_hash(p) for p in inputs}, Path(directory) / "inputs.json")


# keys that do not change a stage's artifacts: where to log, whether to redo, where files live, what
# evaluate runs (fit and distill never read it: a changed evaluation must not refit the scheduler, which
# would also redo every learned method's records), and collect's sizing (what collect produced reaches
# fit and distill through the hashes of the row files)
_NOT_CONFIG = ("logger", "force", "paths", "evaluation")
_COLLECT_SIZING = ("prompts_per_benchmark", "pair_overrides", "enumerate_every", "max_enumerated_turns",
                   "warmup_tokens", "warmup_repeats", "max_new_tokens", "max_prompt_tokens")


def _comparable_config(config_yaml: str) -> dict:
    conf = OmegaConf.to_container(OmegaConf.create(config_yaml), resolve=False) or {}
    conf = {k: v for k, v in conf.items() if k not in _NOT_CONFIG}
    if isinstance(conf.get("pipeline"), dict):
        conf["pipeline"] = {k: v for k, v in conf["pipeline"].items() if k not in _COLLECT_SIZING}
    return conf


def up_to_date(directory: Path, config_yaml: str, inputs: Iterable[Path], outputs: Iterable[str]) -> bool:
    """True when ``directory`` holds every file of ``outputs`` and was recorded (:func:`record_stage`)
    with the same config (the keys of ``_NOT_CONFIG`` and ``_COLLECT_SIZING`` aside) and the same input hashes."""
    d = Path(directory)
    if not all((d / name).exists() for name in ("config.yaml", "inputs.json", *outputs)):
        return False
    if _comparable_config((d / "config.yaml").read_text()) != _comparable_config(config_yaml):
        return False
    recorded = json.loads((d / "inputs.json").read_text())
    return recorded == {str(p): file_hash(p) for p in inputs}
