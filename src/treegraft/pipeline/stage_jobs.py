"""What a `collect` or `evaluate` job runs on: the line naming a sweep job, its workers (one spawned per GPU
group, or forked on this host after loading), its progress bar, and the command that reruns one sweep job."""

from __future__ import annotations

import contextlib
import sys
from typing import Callable, Iterator, Sequence

from .parallel import gpu_worker_groups

__all__ = ["job_command", "print_job", "gpu_groups", "progress_to"]


def job_command(stage: str, cfg, pair: str, benchmark: str) -> str:
    """The command that runs ``stage``'s sweep job of one pair x benchmark (a coverage gap's rerun)."""
    return f"python scripts/{stage}.py experiment={cfg.pipeline.name} pair={pair} data={benchmark}"


def print_job(console, stage: str, cfg, pairs: Sequence[str], benchmarks: Sequence[str], shard) -> None:
    """One line naming a sweep job's pairs x benchmarks and prompt range (nothing for a whole stage)."""
    if not shard.whole or cfg.get("pair") or cfg.get("data"):
        console.print(f"{stage} job: {', '.join(pairs)} x {', '.join(benchmarks)}, {shard}")


def gpu_groups(p) -> list[str] | None:
    """``CUDA_VISIBLE_DEVICES`` of each spawned worker where the stage (``pipeline`` settings ``p``) runs on
    CUDA with ``workers`` > 1, each loading a pair of its own (refused here, before any model is loaded, when
    the GPUs are too few); None: one pair loaded here, forked workers share it."""
    import torch

    if torch.device(p.device).type == "cuda" and int(p.get("workers") or 1) > 1:
        return gpu_worker_groups(p.workers, p.get("gpus_per_worker", 1))
    return None


@contextlib.contextmanager
def progress_to(progress: Callable[[int], None] | None, total: int, desc: str) -> Iterator[Callable[[int], None]]:
    """``progress`` (an outer bar's advance by n units), else the advance of a bar of this job's own over
    ``total`` units, closed at the end."""
    if progress is not None:
        yield progress
        return
    from tqdm.auto import tqdm

    bar = tqdm(total=total, desc=desc, file=sys.stderr)
    try:
        yield bar.update
    finally:
        bar.close()
