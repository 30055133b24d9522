"""Evaluate's record files: which files hold a method's records (``<method>.jsonl`` and the prompt ranges'
``<method>.shard<i>of<n>.jsonl``), the run key a saved record is reused under (:func:`run_key`), the saved
records of a prompt set, and writing a file of records."""

from __future__ import annotations

import glob
import hashlib
import json
import re
from dataclasses import asdict
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from ..decoding.methods import LEARNED_ARTIFACTS, parse_method
from ..machine import machine_line
from ..settings import RunSettings
from .artifacts import atomic_write_text, file_hash

__all__ = ["SHARD_SUFFIX", "record_method", "method_files", "NOT_IN_RUN_KEY", "run_key", "saved_records", "write_records"]

SHARD_SUFFIX = re.compile(r"\.shard\d+of\d+$")


def record_method(path: Path) -> str:
    """The method of a record file (``fixed.jsonl``, ``fixed.shard0of2.jsonl`` -> ``fixed``)."""
    return SHARD_SUFFIX.sub("", Path(path).stem)


def method_files(folder: Path, method: str) -> list[Path]:
    """Every record file of ``method`` in a benchmark folder: the whole range's ``<method>.jsonl`` and the
    prompt ranges' ``<method>.shard<i>of<n>.jsonl`` of sharded jobs."""
    folder = Path(folder)
    files = [folder / f"{method}.jsonl"] + sorted(folder.glob(f"{glob.escape(method)}.shard*of*.jsonl"))
    return [f for f in files if f.exists()]


# the evaluation settings that choose which prompts and methods run, not what a record of one prompt holds
NOT_IN_RUN_KEY = ("methods", "benchmarks", "prompts_per_benchmark", "ablations", "ablation_prompts", "prompt_offset",
                  "target_half_width", "max_prompts_per_benchmark", "min_prompts_per_benchmark", "round_prompts",
                  "sensitivity", "sensitivity_prompts", "scheduler_from")


def run_key(cfg: DictConfig, pair: str, method: str, artifacts: Path, settings: RunSettings | None = None) -> str:
    """What a method's records depend on: the tree and evaluation settings, dtype, device, the engine
    (and its build), the prompts' offset and, for the learned methods, the scheduler artifacts. Saved records are reused
    only under the same key (a changed config or a refitted scheduler redoes them). ``settings``: the
    caller's (else built from ``cfg``)."""
    settings = RunSettings.of(settings or cfg)
    e = OmegaConf.to_container(cfg.evaluation, resolve=True)
    for k in NOT_IN_RUN_KEY:  # which prompts and methods run, not what a record of one prompt holds
        e.pop(k, None)
    parts = {"pair": pair, "method": method, "evaluation": e,
             "tree": settings.tree, "dtype": cfg.pipeline.dtype,
             "runtime": cfg.runtime, "middle_runtime": cfg.middle_runtime, "cpu": machine_line([cfg.pipeline.device]),
             "device": cfg.pipeline.device, "warmup_tokens": cfg.pipeline.warmup_tokens,
             "warmup_repeats": cfg.pipeline.warmup_repeats}
    engine = asdict(settings.engine)
    if engine["name"] != "torch":  # (absent for the PyTorch engine: its records of earlier runs stay valid)
        from ..engines.llama_cpp.build import installed_build

        parts["engine"] = {**engine, "build": (installed_build() or {}).get("patch_id")}
    small = settings.small_for(method)
    if small is not None:  # (absent for the n-gram drafter: records of earlier runs stay valid)
        parts["small"] = small
    base, _ = parse_method(method)
    if base in LEARNED_ARTIFACTS:
        parts["artifacts"] = {name: file_hash(artifacts / name) for name in LEARNED_ARTIFACTS[base]}
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def saved_records(path: Path, key: str, prompts: list[tuple[int, list[int]]]) -> dict[int, dict]:
    """question id -> the record an earlier run saved for that prompt under the same key and the same
    prompt (token ids, so a changed prompt format redoes it), in any record file of the method (a sharded
    job's included; the newest where several hold one); prompts without one are missing."""
    wanted = {q: list(ids) for q, ids in prompts}
    out = {}
    for file in method_files(path.parent, record_method(path)):
        for line in file.read_text().splitlines():
            r = json.loads(line)
            q = r.get("question_id")
            if q in wanted and r.get("prompt_ids") == wanted[q] and r.get("run_key") == key:
                if q not in out or r.get("tstamp", 0) > out[q].get("tstamp", 0):
                    out[q] = r
    return out


def write_records(records: list[dict], path: Path) -> None:
    """A record file, one JSON line per record (written atomically)."""
    atomic_write_text("".join(json.dumps(r) + "\n" for r in records), path)
