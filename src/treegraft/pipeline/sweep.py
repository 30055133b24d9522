"""A whole experiment as Hydra multiruns: `collect` and `evaluate` sharded, `fit`, `distill`, `report` merging.

``python scripts/sweep.py experiment=paper launcher=slurm shards=4`` runs, one stage after the other,
the multiruns a user would type by hand:

* ``collect``: one job per fitting pair x fitting benchmark x prompt range (``pair=`` / ``data=`` /
  ``shard.index``), one multirun per GPU count, each job asking for the GPUs its pair needs
  (:func:`gpus_for_pair`: weights and KV caches from the model configs, over ``gpu_memory`` per GPU);
* ``fit``, ``distill``: one job each (they merge whatever collect shards exist and say what is missing);
* ``evaluate``: one job per evaluated pair (held-out ones included) x benchmark x prompt range;
* ``report``: one job (it reads every record file and says which prompts have none).

The launcher does the scheduling: ``slurm`` (submitit's SLURM executor), ``local`` (submitit's local
executor: the same jobs as subprocesses here) or ``basic`` (Hydra's own, one job after the other in
the stage's process). Hydra's submitit launcher returns when every job of a multirun has finished, so
the stages run in order; while one runs, the sweep prints how many prompts are on disk (the jobs write
one file per prompt or rewrite their record file after every prompt, so the count is the progress).
Nothing here queues, retries or talks to a job: a failed job fails its multirun, and the same command
again redoes only what is missing.
"""

from __future__ import annotations

import math
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from ..devices import now
from ..paths import CONF_DIR, REPO_ROOT

__all__ = ["STAGES", "LAUNCHERS", "StageRun", "gpus_for_pair", "plan_sweep", "run_sweep", "forwarded_overrides"]

STAGES = ("collect", "fit", "distill", "evaluate", "report")
LAUNCHERS = ("local", "slurm", "basic")
SHARDED = ("collect", "evaluate")
# keys of conf/sweep.yaml that steer the sweep itself, not a stage
SWEEP_KEYS = ("launcher", "stages", "shards", "gpu_memory", "dry_run", "poll_s", "launcher_overrides")


@dataclass
class StageRun:
    """One multirun of a stage: its command line, how many jobs it starts and the GPUs each asks for."""

    stage: str
    argv: list[str]
    jobs: int
    gpus: int = 0
    pairs: list[str] = field(default_factory=list)

    @property
    def command(self) -> str:
        import shlex

        return " ".join(shlex.quote(a) for a in self.argv)


def gpus_for_pair(pair: str, cfg) -> int:
    """GPUs one job of ``pair`` asks for: 0 off CUDA; else its weights and KV caches (at ``placement.kv_tokens``,
    in ``pipeline.dtype``, bfloat16 when unset), x1.1, over ``gpu_memory`` per GPU, rounded up. Read from the
    model configs alone (the paper's hub shapes when no hub is reachable); nothing is loaded."""
    import torch

    from ..models.placement import estimate_pair_memory, parse_bytes
    from .common import pair_spec

    if torch.device(cfg.pipeline.device).type != "cuda":
        return 0
    dtype = getattr(torch, cfg.pipeline.get("dtype") or "bfloat16")
    tokens = int((cfg.get("placement") or {}).get("kv_tokens") or 4096)
    need = 1.1 * estimate_pair_memory(pair_spec(pair), dtype, tokens, cfg.paths.models_dir).total
    return max(1, math.ceil(need / parse_bytes(cfg.gpu_memory)))


def _stage_keys(stage: str) -> set[str]:
    """The top-level keys and config groups a stage's primary config has (an override of anything else would
    be refused by that stage's Hydra)."""
    from omegaconf import OmegaConf

    conf = OmegaConf.to_container(OmegaConf.load(Path(CONF_DIR) / f"{stage}.yaml"), resolve=False)
    keys = {k for k in conf if k not in ("defaults", "hydra")}
    for entry in conf.get("defaults", []):
        if isinstance(entry, dict):
            name = next(iter(entry)).removeprefix("override ").strip()
            keys.add(name.split("/")[0])
    return keys


def forwarded_overrides(overrides: Sequence[str], stage: str) -> list[str]:
    """The sweep's command-line overrides that ``stage`` takes: the sweep's own keys dropped, and any
    setting of a group the stage does not have (``evaluation.*`` for `fit`) left out of its command."""
    keys = _stage_keys(stage)
    out = []
    for o in overrides:
        key = o.lstrip("+~").split("=", 1)[0]
        top = key.split(".")[0].split("/")[0]
        if top in SWEEP_KEYS:
            continue
        if top in keys or top in ("experiment", "hydra"):
            out.append(o)
    return out


def _script(stage: str) -> str:
    return str(Path(REPO_ROOT) / "scripts" / f"{stage}.py")


def _launcher_args(cfg, gpus: int) -> list[str]:
    launcher = str(cfg.launcher)
    if launcher not in LAUNCHERS:
        raise ValueError(f"launcher must be one of {', '.join(LAUNCHERS)}, got {launcher!r}")
    args = [f"hydra/launcher={launcher}"]
    if launcher != "basic":
        args.append(f"hydra.launcher.gpus_per_node={gpus}")
    return args + [str(o) for o in (cfg.get("launcher_overrides") or [])]


def _grouped_by_gpus(pairs: Sequence[str], cfg) -> dict[int, list[str]]:
    groups: dict[int, list[str]] = {}
    for pair in pairs:
        groups.setdefault(gpus_for_pair(pair, cfg), []).append(pair)
    return dict(sorted(groups.items()))


def plan_sweep(cfg, overrides: Sequence[str]) -> list[StageRun]:
    """The multiruns of ``cfg.stages`` in order (``overrides``: the sweep's command line, forwarded)."""
    from .common import fit_pairs
    from .evaluate_scope import eval_pairs

    stages = list(cfg.stages)
    bad = [s for s in stages if s not in STAGES]
    if bad:
        raise ValueError(f"unknown stage(s) {bad} in stages; expected a list drawn from {list(STAGES)}")
    shards = int(cfg.shards)
    if shards < 1:
        raise ValueError(f"shards must be >= 1 (prompt ranges per pair x benchmark), got {shards}")
    if shards > 1 and cfg.evaluation.get("target_half_width") is not None and "evaluate" in stages:
        raise ValueError(f"shards={shards} splits each benchmark's prompts, but evaluation.target_half_width="
                         f"{cfg.evaluation.target_half_width} sizes them by the headline CI; set "
                         "evaluation.target_half_width=null or shards=1")
    runs = []
    for stage in stages:
        base = [sys.executable, _script(stage), "-m", *forwarded_overrides(overrides, stage)]
        if stage not in SHARDED:
            runs.append(StageRun(stage, base + _launcher_args(cfg, 0), jobs=1))
            continue
        if stage == "collect":
            pairs, benchmarks = fit_pairs(cfg), list(cfg.pipeline.fit_benchmarks)
        else:
            pairs, benchmarks = eval_pairs(cfg), list(cfg.evaluation.benchmarks)
        shard_args = [f"shard.count={shards}", "shard.index=" + ",".join(map(str, range(shards)))] if shards > 1 else []
        for gpus, group in _grouped_by_gpus(pairs, cfg).items():
            argv = base + _launcher_args(cfg, gpus) + [f"pair={','.join(group)}", f"data={','.join(benchmarks)}",
                                                       *shard_args]
            runs.append(StageRun(stage, argv, jobs=len(group) * len(benchmarks) * shards, gpus=gpus, pairs=group))
    return runs


def _progress(stage: str, cfg) -> Callable[[], str] | None:
    """A function that says how much of a sharded stage is on disk (None for the others)."""
    from .artifacts import stage_dir

    folder = stage_dir(cfg.paths.output_dir, cfg.pipeline.name, stage)
    if stage == "collect":
        from .collected import collect_coverage

        return lambda: collect_coverage(cfg, folder).status
    if stage == "evaluate":
        from .evaluate_scope import evaluate_coverage

        return lambda: evaluate_coverage(cfg, folder).status
    return None


def run_sweep(cfg, overrides: Sequence[str], log: Callable[[str], None] = print) -> list[dict]:
    """Run (or, with ``dry_run``, print) the multiruns of :func:`plan_sweep`, one after the other; stops at
    the first that fails (one line naming it and its log folder). Returns one row per multirun."""
    runs = plan_sweep(cfg, overrides)
    rows = []
    for i, run in enumerate(runs, 1):
        where = f" on {run.gpus} GPU(s) each" if run.gpus else ""
        log(f"[{i}/{len(runs)}] {run.stage}: {run.jobs} job(s){where}" + (f" ({', '.join(run.pairs)})" if run.pairs else ""))
        log(f"  {run.command}")
        if cfg.dry_run:
            rows.append({"stage": run.stage, "jobs": run.jobs, "gpus": run.gpus, "status": "planned", "minutes": 0.0})
            continue
        progress = _progress(run.stage, cfg)
        start = now()
        proc = subprocess.Popen(run.argv, cwd=REPO_ROOT)
        done = threading.Event()

        def watch() -> None:  # what the jobs have written so far, whenever it changes
            last = None
            while not done.wait(float(cfg.poll_s)):
                try:
                    line = progress()
                except Exception:  # noqa: BLE001 (a half-listed folder: the next poll reads it again)
                    continue
                if line != last:
                    log(f"  {line} after {(now() - start) / 60:.1f} min")
                    last = line

        watcher = threading.Thread(target=watch, daemon=True) if progress else None
        if watcher:
            watcher.start()
        code = proc.wait()
        done.set()
        minutes = (now() - start) / 60
        rows.append({"stage": run.stage, "jobs": run.jobs, "gpus": run.gpus,
                     "status": "ok" if code == 0 else f"failed ({code})", "minutes": minutes})
        if progress:
            log(f"  {progress()}")
        if code != 0:
            from .artifacts import stage_dir

            logs = stage_dir(cfg.paths.output_dir, cfg.pipeline.name, "report").parent / "multirun" / run.stage
            raise RuntimeError(f"{run.stage} multirun failed with exit status {code} after {minutes:.1f} min "
                               f"(job logs under {logs}); the same sweep command again redoes only what is missing")
    return rows
