"""Evaluate's per-pair work and its workers: what one pair's job has left to do (:class:`PairJob`: the
prompts, the records saved under the run key, the generations missing), the worker that warms every
decoder up and runs the missing generations benchmark by benchmark (:func:`run_worker`), its
spawned GPU form, and the peak GPU memory a pair's evaluation took."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ..decoding.methods import LEARNED_METHODS, load_learned_scheduler, parse_method
from ..decoding.sampling import SamplingConfig
from ..decoding.tree_decoder import TreeGraftDecoder
from ..devices import devices_of, peak_memory, reset_peak_memory
from ..front import decoder_for, engines_of, load_engine_pair
from ..machine import machine_info
from ..models import load_tokenizer
from ..settings import RunSettings
from .artifacts import atomic_write_json
from .common import pair_spec, stage_prompts, stage_records
from .equality import compare_outputs
from .evaluate_scope import method_prompts, rotated_order
from .record_files import run_key, saved_records, write_records
from .records import make_record

__all__ = ["PairJob", "learned_schedulers", "run_worker", "run_on_gpu", "record_gpu_peak"]


@dataclass
class PairJob:
    """One pair's part of an evaluate job. ``prompts``: benchmark -> this job's (question id, token ids);
    ``wanted[benchmark, method]``: the prompts the method runs on (:func:`method_prompts`); ``saved``: the
    records already on disk under ``keys[method]`` (the run key), by question id; ``paths``: the file each
    (benchmark, method) writes."""

    pair_name: str
    methods: list[str]
    prompts: dict[str, list]
    categories: dict[str, dict[int, str]]
    wanted: dict[tuple[str, str], list]
    saved: dict[tuple[str, str], dict[int, dict]]
    paths: dict[tuple[str, str], Path]
    keys: dict[str, str]
    artifacts: Path
    sampling: SamplingConfig

    @classmethod
    def of(cls, cfg, settings: RunSettings, pair_name: str, benchmarks: list[str], methods: list[str], shard,
           offset: int, out_dir: Path, artifacts: Path, sampling: SamplingConfig) -> "PairJob":
        """The job's prompts of ``benchmarks`` (tokenized without loading the models) and what is saved."""
        n = int(cfg.evaluation.prompts_per_benchmark)
        tokenizer = load_tokenizer(pair_spec(pair_name).target, cfg.paths.models_dir)
        prompts = {b: shard.take(stage_prompts(cfg, tokenizer, b, n, offset)) for b in benchmarks}
        categories = {b: {int(r["question_id"]): r["category"] for r in stage_records(cfg, b, n, offset)}
                      for b in benchmarks}
        jobs = [(b, m) for b in benchmarks for m in methods]
        # a sharded job writes files of its own (shard.suffix): two jobs never write the same file
        paths = {(b, m): Path(out_dir) / pair_name / b / f"{m}{shard.suffix}.jsonl" for b, m in jobs}
        keys = {m: run_key(cfg, pair_name, m, artifacts, settings) for m in methods}
        wanted = {(b, m): method_prompts(cfg, m, prompts[b]) for b, m in jobs}
        saved = {(b, m): saved_records(paths[b, m], keys[m], wanted[b, m]) for b, m in jobs}  # done before an interruption
        return cls(pair_name, methods, prompts, categories, wanted, saved, paths, keys, artifacts, sampling)

    def missing(self, bench: str, method: str) -> list[int]:
        """The question ids ``method`` still has to run on ``bench``."""
        return [q for q, _ in self.wanted[bench, method] if q not in self.saved[bench, method]]

    def units(self, bench: str) -> int:
        """The (prompt, method) generations left on ``bench``."""
        return sum(len(self.missing(bench, m)) for m in self.methods)

    def todo(self) -> list[str]:
        """The benchmarks with generations left, in order."""
        return [b for b in self.prompts if self.units(b)]

    def cost(self, bench: str) -> float:
        """A benchmark's work, for handing the benchmarks out to workers (generations, longer prompts dearer)."""
        return self.units(bench) * (1 + sum(len(ids) for _, ids in self.prompts[bench]) / 1000)


def learned_schedulers(methods: list[str], artifacts: Path) -> dict:
    """The learned policy of every learned method among ``methods``' bases (a missing artifact fails here)."""
    bases = dict.fromkeys(parse_method(m)[0] for m in methods)
    return {m: load_learned_scheduler(m, Path(artifacts)) for m in bases if m in LEARNED_METHODS}


def _warm_decoders(cfg, settings: RunSettings, pair, job: PairJob, benchmarks: list[str], schedulers) -> tuple[dict, dict]:
    """(method -> decoder, method -> its records' context) of every method with work left on ``benchmarks``:
    every warm-up before any timing, variants after their base."""
    p = cfg.pipeline
    todo = [m for m in job.methods if any(job.missing(b, m) for b in benchmarks)]
    warm_ids = job.prompts[benchmarks[0]][0][1]
    decoders, contexts = {}, {}
    for method in sorted(todo, key=lambda m: "@" in m):
        base, scales = parse_method(method)
        small = settings.small_for(method)
        dec = decoder_for(base, pair, settings.tree, job.sampling, schedulers.get(base), cfg.paths.cache_dir, small=small)
        if isinstance(dec, TreeGraftDecoder) and dec.middle is not None:
            if scales and base in decoders:  # a sensitivity variant: its base's calibrated context, rescaled
                dec.generate(warm_ids, int(p.warmup_tokens))
                dec.t_tgt_ms, dec.t_mid_ms = decoders[base].t_tgt_ms, decoders[base].t_mid_ms
            else:  # runtime context: medians over repeated all-call warm-ups, not scored
                dec.warm_up(warm_ids, int(p.warmup_tokens), repeats=int(p.warmup_repeats))
            dec.t_tgt_ms *= scales.get("t_tgt", 1.0)
            dec.t_mid_ms *= scales.get("t_mid", 1.0)
            sched = schedulers.get(base)
            if hasattr(sched, "for_context"):  # the cost-aware fallback: the schedule this context picks
                sched = sched.for_context(dec.t_tgt_ms, dec.t_mid_ms)
            contexts[method] = {"t_tgt_ms": dec.t_tgt_ms, "t_mid_ms": dec.t_mid_ms,
                                "scheduler_policy": getattr(sched, "policy_name", None)}
        if isinstance(dec, TreeGraftDecoder):  # which small drafter the tree method drafted with
            contexts.setdefault(method, {})["small_drafter"] = (small or {}).get("name", "ngram") + (
                f":{small['layers']}" if (small or {}).get("layers") else "")
        else:
            dec.generate(warm_ids, int(p.warmup_tokens))  # warm-up, not scored
        decoders[method] = dec
    return decoders, contexts


def run_worker(cfg, settings: RunSettings, pair, job: PairJob, benchmarks: list[str], pulled, schedulers,
               progress) -> None:
    """One worker: build and warm up every decoder that ``benchmarks`` (every benchmark with work left)
    need, then for each benchmark it pulls (``pulled``, shared with the other workers) run the missing
    (prompt, method) generations, methods interleaved prompt by prompt, compare each with ``ar``'s
    output and rewrite that method's records after every prompt (an interruption loses at most one
    prompt's generations)."""
    e, methods = cfg.evaluation, job.methods
    context = {"runtime": pair.runtime, "middle_runtime": pair.middle_runtime, **engines_of(pair).info(),
               "tree_shape": settings.tree_shape, "budget_setting": settings.budget_setting,
               # bfloat16_packed: products wider than this many rows ran on oneDNN's copy (None: one kernel)
               "bf16_onednn_above": getattr(pair.target, "treegraft_bf16_max_rows", None),
               **machine_info(devices_of(pair.target, pair.middle))}
    target_fp32 = pair.target if pair.runtime in ("float32", "float32_packed") else None
    on_llama = engines_of(pair).name == "llama_cpp"
    reuses = []
    if on_llama and e.get("share_prefill", True):  # one encoding of each prompt per model, charged to every method
        from ..engines.llama_cpp import PromptReuse

        for model in [pair.target] + [pair.middle] * (pair.middle is not None and pair.middle is not pair.target):
            model.prompt_reuse = PromptReuse()
            reuses.append(model.prompt_reuse)
    context["prefill_shared"] = bool(reuses)
    decoders, contexts = _warm_decoders(cfg, settings, pair, job, benchmarks, schedulers)
    for reuse in reuses:
        reuse.forget()  # every decoder's score request is known now; timed prompts are encoded afresh
    for bench in pulled:
        missing = {m: set(job.missing(bench, m)) for m in methods}
        records = {m: dict(job.saved[bench, m]) for m in methods}
        for k, (qid, ids) in enumerate(job.prompts[bench]):  # methods interleaved prompt by prompt: drift hits all alike
            fresh = [m for m in rotated_order(methods, k) if qid in missing[m]]
            for method in fresh:
                result = decoders[method].generate(ids, int(e.max_new_tokens))
                text = pair.tokenizer.decode(result.tokens, skip_special_tokens=True)
                record = make_record(job.pair_name, bench, method, qid, result, text,
                                     {**context, **contexts.get(method, {})}, job.categories[bench].get(qid, ""))
                record.update(prompt_ids=ids, run_key=job.keys[method])
                if method != "ar" and job.sampling.greedy:
                    rep = compare_outputs(records["ar"][qid]["tokens"], record["tokens"], ids, target_fp32,
                                          float(e.tie_tolerance))
                    record["matches_ar"], record["mismatch_explained"] = rep.equal, rep.explained_by_tie
                    if not rep.equal:
                        record["mismatch_position"] = rep.position
                        # a float32 near-tie check (PyTorch) is left to explain_mismatches, after the workers; on
                        # llama.cpp the exact kernels leave no mismatch to explain and the stock ones round by
                        # batch: a mismatch there is reported as it is
                        if target_fp32 is None and not on_llama:
                            record["mismatch_explained"] = None  # pending
                records[method][qid] = record
                progress(1)
            for method in fresh:
                write_records([records[method][q] for q, _ in job.wanted[bench, method] if q in records[method]],
                              job.paths[bench, method])


def record_gpu_peak(pair, folder: Path, console=None) -> None:
    """The peak GPU memory of a pair's evaluation, per device, in ``gpu_memory[.<gpus>].json`` (nothing on a CPU)."""
    peak = peak_memory(devices_of(pair.target, pair.middle))
    if not peak:
        return
    gpus = os.environ.get("CUDA_VISIBLE_DEVICES")
    info = {"pair": pair.spec.name, "peak_bytes": peak, "cuda_visible_devices": gpus,
            **machine_info(devices_of(pair.target, pair.middle))}
    atomic_write_json(info, folder / (f"gpu_memory.{gpus.replace(',', '-')}.json" if gpus else "gpu_memory.json"))
    if console is not None:
        console.print(f"{pair.spec.name}: peak GPU memory " + ", ".join(f"{d} {b / 1e9:.1f} GB" for d, b in peak.items()))


def run_on_gpu(context: tuple, pull, report) -> None:
    """One spawned GPU worker of the evaluate stage: its own pair on the GPUs it sees, then the benchmarks it
    pulls (the same :func:`run_worker` as a forked worker)."""
    from omegaconf import OmegaConf

    cfg_dict, settings, job, benchmarks = context
    cfg = OmegaConf.create(cfg_dict)
    schedulers = learned_schedulers(job.methods, job.artifacts)
    pair = load_engine_pair(pair_spec(job.pair_name), cfg, log=print, device=cfg.pipeline.device, dtype=cfg.pipeline.dtype)
    reset_peak_memory(devices_of(pair.target, pair.middle))
    run_worker(cfg, settings, pair, job, benchmarks, pull, schedulers, report)
    record_gpu_peak(pair, job.paths[benchmarks[0], job.methods[0]].parent.parent)
