"""GPU smoke check (`make gpu-smoke`): the decoder and the pipeline where the paper's users run them.

Run on any CUDA machine (under 10 minutes; one summary table; exit status 1 if a check fails):
    make gpu-smoke
    python scripts/gpu_smoke.py --pairs tiny-random smollm2-135m__self qwen-coder-1.5b__0.5b
The same checks on a CPU (what the test suite runs, on the tiny pair):
    python scripts/gpu_smoke.py --device cpu --pairs tiny-random --no-pipeline
Without CUDA, `make gpu-smoke` prints one line and exits 0: it is no substitute for `make test`.

Per pair (tiny-random in float32; SmolLM2 self-draft and, where `make models` converted it, the Qwen pair
from its GGUF, in bfloat16), with the default tree config, placement device_map=auto:
  * every method (ar, all_small, all_mid, fixed, csd, treegraft with a scheduler, hf_assisted,
    hf_prompt_lookup), with and without a draft vocabulary: greedy output equal to ar's, or differing at a
    float32 near-tie (top-2 logit gap <= 0.5) only;
  * host-device synchronizations per turn under torch.cuda.set_sync_debug_mode("warn") (host reads and
    blocking copies warn), the clock's own waits for a busy stream, and host reads per turn (treegraft.hostreads);
  * the KV caches after many keep/rollback turns against a fresh forward over the emitted text;
  * the decoder's synchronized t_tgt (the scheduler's runtime context) against the same forward timed
    with CUDA events;
  * peak GPU memory over the pair's decoders;
  * on the tiny pair, the sampling check: the first token's distribution under all_mid equals the
    target's (chi-square, CUDA generator).
The tiny pair once more with its target split between the GPU and the CPU (max_memory with a cpu entry)
and the middle drafter spread by accelerate: every method against the unsplit ar. Then collect -> fit -> distill -> evaluate on EXPERIMENT=smoke with pipeline.device=cuda and
pipeline.dtype=bfloat16. Writes outputs/gpu_smoke/<gpu>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
SYNC_WARNING = re.compile("synchroniz", re.I)
METHODS = ["ar", "all_small", "all_mid", "fixed", "csd", "treegraft", "hf_assisted", "hf_prompt_lookup"]
TEXT_PROMPTS = ["Write a Python function that checks whether a number is prime.",
                "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
                "How many clips did Natalia sell altogether in April and May?",
                "Summarize: The city council met on Tuesday to discuss the new bridge. The council voted to fund it."]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", help="cuda (default; skipped without CUDA) or cpu (the proxy run)")
    ap.add_argument("--pairs", nargs="+", default=["tiny-random", "smollm2-135m__self", "qwen-coder-1.5b__0.5b"])
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--no-pipeline", action="store_true", help="skip collect/fit/distill/evaluate on EXPERIMENT=smoke")
    ap.add_argument("--out", default=str(REPO / "outputs" / "gpu_smoke"))
    return ap.parse_args(argv)


def random_scheduler(depth: int):
    """A distilled scheduler with random weights: it calls at some steps and not others (no artifacts needed)."""
    from treegraft.scheduling.learned import LearnedScheduler, MarginPredictor
    from treegraft.scheduling.signals import REFERENCE_SIGNALS

    return LearnedScheduler(MarginPredictor.untrained(depth, list(REFERENCE_SIGNALS)))


def count_syncs(device: torch.device):
    """A context counting blocking CUDA calls: ``.n``, those set_sync_debug_mode("warn") reports (host reads,
    blocking copies), and ``.clock``, the clock's own waits for a busy stream before a timed read
    (``torch.cuda.synchronize``, which that mode does not report)."""
    class Counter:
        n = clock = 0

        def __enter__(self):
            self._w = warnings.catch_warnings(record=True)
            self.caught = self._w.__enter__()
            warnings.simplefilter("always")
            self._sync = torch.cuda.synchronize

            def counted(*args, **kwargs):
                self.clock += 1
                return self._sync(*args, **kwargs)

            torch.cuda.synchronize = counted
            if device.type == "cuda":
                torch.cuda.set_sync_debug_mode("warn")
            return self

        def __exit__(self, *exc):
            if device.type == "cuda":
                torch.cuda.set_sync_debug_mode("default")
            torch.cuda.synchronize = self._sync
            self.n = sum(1 for w in self.caught if SYNC_WARNING.search(str(w.message)))
            return self._w.__exit__(*exc)

    return Counter()


def prompts_for(pair, name: str) -> list[list[int]]:
    if name == "tiny-random":
        return [list(range(5, 45)) + list(range(5, 25)), list(range(60, 90)) * 2, [7, 8, 9, 10] * 6]
    tok = pair.tokenizer
    out = []
    for text in TEXT_PROMPTS:
        if getattr(tok, "chat_template", None):
            ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
            ids = ids["input_ids"] if isinstance(ids, dict) else ids
        else:
            ids = tok(text).input_ids
        out.append(list(ids))
    return out


def event_forward_ms(model, context: list[int], rows: int, device: torch.device) -> float:
    """A verification-shaped forward (``rows`` tree rows on a cache of ``context``, the LM head on one row)
    timed with CUDA events (or the host clock on a CPU): the separate measurement of t_tgt."""
    from treegraft.devices import Clock, device_tensor, input_device
    from treegraft.model_io import forward_hidden, lm_logits, new_cache, truncate_cache

    dev = input_device(model)
    cache = new_cache()
    with torch.inference_mode():
        forward_hidden(model, cache, device_tensor(context, dev), torch.arange(len(context), device=dev), None)
        tokens = device_tensor(context[-rows:] if len(context) >= rows else [1] * rows, dev)
        pos = torch.arange(len(context), len(context) + rows, device=dev)
        allowed = torch.ones(rows, len(context) + rows, dtype=torch.bool, device=dev)
        allowed[:, len(context):] = torch.tril(allowed[:, len(context):])
        times = []
        for i in range(6):
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                lm_logits(model, forward_hidden(model, cache, tokens, pos, allowed)[:1])
                end.record()
                end.synchronize()
                ms = start.elapsed_time(end)
            else:
                clock = Clock.of(model)
                t0 = clock.now()
                lm_logits(model, forward_hidden(model, cache, tokens, pos, allowed)[:1])
                ms = 1000 * (clock.now() - t0)
            truncate_cache(cache, len(context))
            if i:
                times.append(ms)
    return statistics.median(times)


def check_offloaded(device: torch.device, max_new: int, rows: list[dict]) -> None:
    """The tiny target split between the GPU and the CPU (accelerate's hooks, max_memory with a cpu entry), the
    middle drafter spread by accelerate: every method against the unsplit ar (the split and offload paths on
    a machine of one GPU)."""
    from treegraft.engines.torch import TorchEngines
    from treegraft.front import decoder_for
    from treegraft.models import PairSpec, load_pair
    from treegraft.models.placement import Placement

    spec = PairSpec(name="tiny-split", target="tiny-random:0", middle="tiny-random:1")
    whole = load_pair(spec, device=device)
    prompt = list(range(5, 45)) + list(range(5, 25))
    reference = decoder_for("ar", TorchEngines(whole.target, None, whole.tokenizer)).generate(prompt, max_new).tokens
    pair = load_pair(spec, device="cuda", placement=Placement("auto", {0: "300KB", "cpu": "2GB"}, middle="auto"))
    where = sorted(set(map(str, pair.target.hf_device_map.values())))
    bad = []
    for method in METHODS:
        for draft_vocab in (None, 64):
            dec = decoder_for(method, TorchEngines(pair.target, pair.middle, pair.tokenizer), {"draft_vocab": draft_vocab},
                              scheduler=random_scheduler(5) if method == "treegraft" else None)
            if dec.generate(prompt, max_new).tokens != reference:
                bad.append(f"{method}/{draft_vocab}")
    rows.append({"pair": "tiny-random", "check": "offload", "method": "all", "ok": not bad and len(where) > 1,
                 "detail": f"target over {where}: {'every method equals ar' if not bad else 'differ: ' + ', '.join(bad)}"})
    print(f"  {'ok  ' if rows[-1]['ok'] else 'FAIL'} offload    all                    {rows[-1]['detail']}", flush=True)


def check_pair(name: str, device: torch.device, max_new: int, rows: list[dict]) -> None:
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from treegraft.decoding import SamplingConfig, TreeConfig
    from treegraft.pipeline.equality import compare_outputs
    from treegraft.engines.torch import TorchEngines
    from treegraft.front import decoder_for
    from treegraft.devices import devices_of, peak_memory, reset_peak_memory
    from treegraft.hostreads import count_host_reads
    from treegraft.model_io import forward_hidden, new_cache
    from treegraft.models import load_model, load_pair
    from treegraft.models.loading import ModelLoadError
    from treegraft.models.placement import Placement

    def row(check: str, method: str, ok: bool, detail: str) -> None:
        rows.append({"pair": name, "check": check, "method": method, "ok": bool(ok), "detail": detail})
        print(f"  {'ok  ' if ok else 'FAIL'} {check:<10} {method:<22} {detail}", flush=True)

    spec = instantiate(OmegaConf.load(REPO / "conf" / "pair" / f"{name}.yaml"))
    dtype = "float32" if name == "tiny-random" else "bfloat16"
    try:
        pair = load_pair(spec, dtype=dtype, device=device, placement=Placement("auto"))
    except ModelLoadError as err:
        row("load", "-", True, f"skipped: {str(err).splitlines()[0]}")
        return
    fp32 = pair.target if dtype == "float32" else load_model(spec.target, "float32", device)
    devices = devices_of(pair.target, pair.middle)
    reset_peak_memory(devices)
    prompts = prompts_for(pair, name)
    small_vocab = 64 if name == "tiny-random" else 4096
    depth = TreeConfig().depth
    reference = [decoder_for("ar", TorchEngines(pair.target, None, pair.tokenizer)).generate(p, max_new).tokens for p in prompts]
    print(f"{name} ({dtype}, {pair.target.hf_device_map if hasattr(pair.target, 'hf_device_map') else device})", flush=True)
    for method in METHODS:
        for draft_vocab in ((None, small_vocab) if method not in ("ar", "hf_assisted", "hf_prompt_lookup") else (None,)):
            label = method + (f" vocab={draft_vocab}" if draft_vocab else "")
            scheduler = random_scheduler(depth) if method == "treegraft" else None
            dec = decoder_for(method, TorchEngines(pair.target, pair.middle, pair.tokenizer), {"draft_vocab": draft_vocab},
                              SamplingConfig(), scheduler=scheduler)
            dec.generate(prompts[0], 8)  # warm-up: kernels, the verification curve, the frequent tokens
            unexplained, gaps, syncs, waits, reads, turns = 0, [], 0, 0, 0, 0
            for prompt, ref in zip(prompts, reference):
                with count_syncs(device) as s, count_host_reads() as r:
                    out = dec.generate(prompt, max_new)
                syncs, waits, reads = syncs + s.n, waits + s.clock, reads + r.total
                turns += max(1, len(out.turns) or len(out.tokens))
                rep = compare_outputs(ref, out.tokens, prompt, fp32, 0.5)
                unexplained += not rep.explained_by_tie
                if not rep.equal:
                    gaps.append(rep.top2_gap)
            row("equality", label, unexplained == 0,
                f"{len(prompts) - len(gaps)}/{len(prompts)} equal, near-ties {gaps}; syncs/turn {syncs / turns:.1f} "
                f"(+ clock waits {waits / turns:.1f}), host reads/turn {reads / turns:.1f}")
    # KV caches after many keep/rollback turns
    dec = decoder_for("all_mid", TorchEngines(pair.target, pair.middle, pair.tokenizer), {"budget": 20})
    final = {}
    out = dec.generate(prompts[1], max_new, on_tokens=lambda _: final.update(
        target=dec.engine.cache, middle=dec.middle.cache, committed=dec.middle.committed))
    context = prompts[1] + out.tokens[:-1]
    worst = 0.0
    tol = 1e-3 if dtype == "float32" else 5e-2
    for model, cache, tokens in ((pair.target, final["target"], context),
                                 (pair.middle, final["middle"], context[: final["committed"]])):
        fresh = new_cache()
        with torch.inference_mode():
            dev = dec.engine.device
            forward_hidden(model, fresh, torch.tensor(tokens, device=dev), torch.arange(len(tokens), device=dev), None)
        for got, want in zip(cache.layers, fresh.layers):
            worst = max(worst, float((got.keys.float() - want.keys.float().to(got.keys.device)).abs().max()),
                        float((got.values.float() - want.values.float().to(got.values.device)).abs().max()))
    row("kv-cache", "all_mid", worst <= tol, f"max |cached - fresh| {worst:.2e} (tolerance {tol:g}) over {len(out.turns)} turns")
    # t_tgt: the decoder's synchronized verification time against CUDA events on the same shape
    dec = decoder_for("fixed", TorchEngines(pair.target, pair.middle, pair.tokenizer), {})
    dec.warm_up(prompts[0], 16, repeats=2)
    res = dec.generate(prompts[0], 32)
    size = int(statistics.median(t["verified_nodes"] for t in res.turns)) + 1
    event_ms = event_forward_ms(pair.target, prompts[0], size, device)
    ratio = dec.t_tgt_ms / event_ms if event_ms else float("nan")
    row("timing", "fixed", 0.5 <= ratio <= 3.0,
        f"t_tgt {dec.t_tgt_ms:.2f} ms vs events {event_ms:.2f} ms at {size} rows (ratio {ratio:.2f}; unsynchronized "
        "timing would read the launch alone, far below 1)")
    peak = peak_memory(devices)
    row("memory", "all", True, ", ".join(f"{d} {b / 1e9:.2f} GB" for d, b in peak.items()) or "n/a on a CPU")
    if name == "tiny-random":  # the sampling check, with the generator on the logits' device
        from scipy.stats import chisquare

        from treegraft.decoding.sampling import target_distribution

        prompt = [70, 71, 72, 73]
        with torch.inference_mode():
            dev = dec.engine.device
            probs = target_distribution(pair.target(torch.tensor([prompt], device=dev)).logits[0, -1],
                                        SamplingConfig(temperature=1.0)).cpu()
        samples = []
        for seed in range(800):
            d = decoder_for("all_mid", TorchEngines(pair.target, pair.target, None), {"depth": 1, "top_m": 6, "shape": "paper", "budget": 63},
                            SamplingConfig(temperature=1.0, seed=seed), eos_ids=set())
            samples.append(d.generate(prompt, 1).tokens[0])
        counts = torch.bincount(torch.tensor(samples), minlength=probs.numel()).double()
        expected = probs.double() * len(samples)
        big = expected >= 5
        obs = torch.cat([counts[big], counts[~big].sum()[None]])
        exp = torch.cat([expected[big], expected[~big].sum()[None]])
        p = chisquare(obs.numpy(), (exp * obs.sum() / exp.sum()).numpy()).pvalue
        row("sampling", "all_mid", p > 1e-3, f"chi-square p = {p:.3g} over {len(samples)} first tokens")
    del pair, fp32
    if device.type == "cuda":
        torch.cuda.empty_cache()


def check_pipeline(device: torch.device, rows: list[dict]) -> None:
    out = tempfile.mkdtemp(prefix="gpu-smoke-")
    common = ["experiment=smoke", f"paths.output_dir={out}", f"pipeline.device={device}", "pipeline.dtype=bfloat16"]
    for stage in ("collect", "fit", "distill", "evaluate"):
        proc = subprocess.run([sys.executable, str(REPO / "scripts" / f"{stage}.py"), *common], capture_output=True,
                              text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or [""]
        rows.append({"pair": "smoke", "check": "pipeline", "method": stage, "ok": proc.returncode == 0,
                     "detail": f"exit {proc.returncode}: {tail[0][:140]}"})
        print(f"  {'ok  ' if proc.returncode == 0 else 'FAIL'} pipeline   {stage:<22} exit {proc.returncode}", flush=True)
        if proc.returncode:
            print(proc.stderr[-3000:], file=sys.stderr)
            return
    summary = Path(out) / "pipeline" / "smoke" / "evaluate" / "summary.parquet"
    if summary.exists():
        import pandas as pd

        s = pd.read_parquet(summary)
        rows.append({"pair": "smoke", "check": "pipeline", "method": "mismatches", "ok": int(s["mismatches_unexplained"].sum()) == 0,
                     "detail": f"{int(s['mismatches'].sum())} outputs differ from ar, "
                               f"{int(s['mismatches_unexplained'].sum())} not explained by a near-tie"})


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu-smoke: skipped: no CUDA device here (torch.cuda.is_available() is False); the CPU checks are `make test`")
        return 0
    from rich.console import Console
    from rich.table import Table

    from treegraft.devices import device_line
    from treegraft.machine import machine_line

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    line = machine_line([device])
    print(f"gpu-smoke on {line}", flush=True)
    rows: list[dict] = []
    for name in args.pairs:
        check_pair(name, device, args.max_new_tokens, rows)
    if device.type == "cuda":
        check_offloaded(device, args.max_new_tokens, rows)
    if not args.no_pipeline:
        check_pipeline(device, rows)
    table = Table(title=f"gpu-smoke: {line}")
    for col in ("pair", "check", "method", "ok", "detail"):
        table.add_column(col)
    for r in rows:
        table.add_row(r["pair"], r["check"], r["method"], "ok" if r["ok"] else "FAIL", r["detail"])
    Console(width=220).print(table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = re.sub(r"[^A-Za-z0-9_.-]+", "_", device_line([device]) or "cpu")
    (out / f"{tag}.json").write_text(json.dumps({"machine": line, "rows": rows}, indent=1))
    failed = [r for r in rows if not r["ok"]]
    print(f"gpu-smoke: {len(rows) - len(failed)} checks ok, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
