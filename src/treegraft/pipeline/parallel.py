"""Independent jobs on both cores, sharing the models loaded once (fork after loading).

A stage loads a pair once in the parent process, then forks its workers (one thread each, as every
measurement here runs); the workers pull their jobs from one shared queue (:func:`fork_pull`), so a
worker that finishes early takes the next job instead of idling. Forked workers share the parent's
weight memory copy-on-write, and the packed weights are never written, so two workers cost the memory
of one pair (a 1.5B pair in ``float32_packed`` is ~17 GB: two copies would not fit a 24 GB machine). Each worker builds its own
decoders (their KV caches are per process) and writes its own artifact files; progress comes back to
the parent through a queue, so one progress bar covers every worker.

Both workers run at once, so their forwards share the memory bus: every method of a pair is measured
under the same contention (methods are interleaved prompt by prompt inside each worker), which keeps
speedups comparable; absolute tokens/s are those of a loaded machine.

On CUDA a worker is a GPU (or a group of GPUs for a pair split over several): a process that already
holds CUDA state cannot be forked, so :func:`spawn_pull` starts fresh processes, each seeing only its own
GPUs (``CUDA_VISIBLE_DEVICES``) and loading its own pair, and pulling jobs from the same kind of queue.
"""

from __future__ import annotations

import contextlib
import functools
import multiprocessing as mp
import os
import queue
import traceback
from typing import Callable, Iterator, Sequence

__all__ = ["fork_map", "fork_pull", "one_thread_if_forking", "one_thread_with_workers", "gpu_worker_groups",
           "spawn_pull", "WorkerSetupError"]


class WorkerSetupError(ValueError):
    """The workers asked for cannot run on this machine (one line: what was asked, what is there)."""


@contextlib.contextmanager
def one_thread_if_forking(workers: int):
    """One thread while ``workers`` > 1, so what the parent measures before forking (runtime choice,
    verification curve, per-call costs) is measured as the one-thread workers will run; the thread
    count is restored afterwards."""
    import torch

    if int(workers or 1) <= 1:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def one_thread_with_workers(stage: Callable) -> Callable:
    """A stage ``stage(cfg, ...)`` run under :func:`one_thread_if_forking` of ``cfg.pipeline.workers``."""

    @functools.wraps(stage)
    def wrapper(cfg, *args, **kwargs):
        with one_thread_if_forking(cfg.pipeline.get("workers", 1)):
            return stage(cfg, *args, **kwargs)

    return wrapper


def fork_pull(fn: Callable[[Iterator, Callable[[int], None]], None], jobs: Sequence, weights: Sequence[float],
              workers: int, progress: Callable[[int], None] | None = None) -> None:
    """Run ``fn(pull, report)`` in ``workers`` forked workers that share one queue of ``jobs``, heaviest
    first: ``pull`` yields the next job whenever its worker is free, so a job that takes longer than its
    weight said holds up one worker, not a share fixed in advance (split by estimated weights, an
    evaluation's four slowest benchmarks once fell to one worker, which ran alone for 20 minutes while
    the other core sat idle). One worker or one job: in this process."""
    order = [job for job, _ in sorted(zip(jobs, weights), key=lambda jw: -jw[1])]
    workers = max(1, min(int(workers), len(order)))
    if workers <= 1:
        if order:
            fn(iter(order), progress or (lambda n: None))
        return
    todo = mp.get_context("fork").Queue()
    for i in range(len(order)):
        todo.put(i)  # indices: the jobs themselves reach the workers through the fork
    for _ in range(workers):
        todo.put(-1)  # one stop mark per worker

    def pull() -> Iterator:
        while (i := todo.get()) >= 0:
            yield order[i]

    fork_map(lambda _, report: fn(pull(), report), [[i] for i in range(workers)], progress)


def _report_to(q, fn: Callable, *args) -> None:
    """Run ``fn(*args, report)`` in a worker, telling the parent through ``q``: progress, then done or the traceback."""
    try:
        fn(*args, lambda n=1: q.put(("progress", n)))
        q.put(("done", None))
    except BaseException:  # report, never hang the parent
        q.put(("error", traceback.format_exc()))


def _worker(fn: Callable, group: list, q) -> None:
    # One thread, set before any kernel runs: GNU OpenMP's thread pool does not survive fork, so a
    # worker whose parent already ran multi-threaded kernels deadlocks in its first parallel region.
    import torch

    torch.set_num_threads(1)
    _report_to(q, fn, group)


def _wait_for(procs: list, q, progress: Callable[[int], None], what: str, join_s: float) -> None:
    """Relay the workers' progress until each has said done or failed (or all died without a word, killed
    or out of memory); then raise their tracebacks, if any."""
    running, errors = len(procs), []
    while running:
        try:
            kind, value = q.get(timeout=5.0)
        except queue.Empty:
            if not any(p.is_alive() for p in procs):
                errors.append(f"a {what} stopped without reporting (exit codes {[p.exitcode for p in procs]})")
                break
            continue
        if kind == "progress":
            progress(value)
        else:
            running -= 1
            if kind == "error":
                errors.append(value)
    for p in procs:
        p.join(timeout=join_s)
    if errors:
        raise RuntimeError(f"a {what} failed:\n" + "\n".join(errors))


def fork_map(fn: Callable[[list, Callable[[int], None]], None], groups: list[list],
             progress: Callable[[int], None] | None = None) -> None:
    """Run ``fn(group, report)`` for every group: in this process when there is one group, else one forked
    worker per group. ``report(n)`` advances ``progress`` by n units. A worker's exception is raised here
    (with its traceback) once every worker has stopped."""
    progress = progress or (lambda n: None)
    if len(groups) <= 1:
        for group in groups:
            fn(group, progress)
        return
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(fn, group, q), daemon=True) for group in groups]
    for p in procs:
        p.start()
    _wait_for(procs, q, progress, "parallel worker", join_s=30)


def gpu_worker_groups(workers: int, gpus_per_worker: int = 1, visible: int | None = None) -> list[str]:
    """``CUDA_VISIBLE_DEVICES`` of each of ``workers`` GPU workers, ``gpus_per_worker`` GPUs each (a pair
    split over several); one line when the GPUs visible here cannot give every worker its own."""
    import torch

    workers, per = max(1, int(workers)), max(1, int(gpus_per_worker))
    visible = torch.cuda.device_count() if visible is None else int(visible)
    if workers * per > visible:
        raise WorkerSetupError(f"workers={workers} on CUDA needs {workers * per} GPU(s) ({per} per worker: each worker "
                               f"loads its own pair on GPUs of its own), {visible} visible; set pipeline.workers="
                               f"{max(1, visible // per)} or pipeline.gpus_per_worker")
    # the GPUs this process sees, by the names the driver knows them (a SLURM job's CUDA_VISIBLE_DEVICES=4,5)
    names = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()] or [str(i) for i in range(visible)]
    return [",".join(names[w * per + g] for g in range(per)) for w in range(workers)]


def _spawned(fn, context, gpus: str, todo, q) -> None:
    os.environ["CUDA_VISIBLE_DEVICES"] = gpus  # as the parent set it at the start (a child may reset it)

    def pull() -> Iterator:
        while (job := todo.get()) is not None:
            yield job

    _report_to(q, fn, context, pull())


def spawn_pull(fn: Callable, contexts: Sequence, groups: Sequence[str], jobs: Sequence, weights: Sequence[float],
               progress: Callable[[int], None] | None = None) -> None:
    """Run ``fn(context, pull, report)`` in one spawned process per GPU group (``groups[i]`` becomes its
    ``CUDA_VISIBLE_DEVICES``), all pulling ``jobs`` (heaviest first) from one queue. ``fn`` and every
    context must pickle (a module-level function, plain data): a spawned process starts from nothing."""
    progress = progress or (lambda n: None)
    ctx = mp.get_context("spawn")
    todo, q = ctx.Queue(), ctx.Queue()
    for job, _ in sorted(zip(jobs, weights), key=lambda jw: -jw[1]):
        todo.put(job)
    for _ in groups:
        todo.put(None)
    procs = [ctx.Process(target=_spawned, args=(fn, c, g, todo, q), daemon=True) for c, g in zip(contexts, groups)]
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    try:
        for p, gpus in zip(procs, groups):  # the child's environment from its first instruction on
            os.environ["CUDA_VISIBLE_DEVICES"] = gpus
            p.start()
    finally:
        if before is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = before
    _wait_for(procs, q, progress, "GPU worker", join_s=60)
