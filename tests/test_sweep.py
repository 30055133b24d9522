"""Sharded stages: prompt ranges, the paper's pair set, the sweep through submitit's local launcher against a
single-job run on the same prompts, a killed job that resumes, and merges that say what is missing."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from treegraft.pipeline.shards import Coverage, Shard

from .conftest import REPO_ROOT, compose

JOB_ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def test_prompt_ranges_cover_every_prompt_once():
    items = list(range(11))
    for count in (1, 2, 3, 4, 11, 15):
        parts = [Shard(i, count).take(items) for i in range(count)]
        assert sum(parts, []) == items  # in order, each once
        assert max(map(len, parts)) - min(map(len, parts)) <= 1
    assert Shard().whole and Shard().suffix == "" and Shard(1, 3).suffix == ".shard1of3"
    for bad in ((2, 2), (-1, 2), (0, 0)):
        with pytest.raises(ValueError, match=r"bad shard index=.* count=.*; expected count >= 1"):
            Shard(*bad)


def test_coverage_names_what_is_missing_and_how_to_fill_it():
    cov = Coverage("collect", {("a", "gsm8k"): [1, 2, 3], ("b", "nq"): [4]}, {("a", "gsm8k"): [2], ("b", "nq"): [4]},
                   {("a", "gsm8k"): "python scripts/collect.py pair=a data=gsm8k"})
    assert (cov.n_expected, cov.n_present, cov.complete) == (4, 2, False)
    assert cov.missing == {("a", "gsm8k"): [1, 3]}
    assert "2 of 4 prompts present" in cov.line() and "a/gsm8k q1, q3 (rerun: python scripts/collect.py pair=a data=gsm8k)" in cov.line()
    assert cov.to_dict()["missing"] == [{"unit": "a/gsm8k", "question_ids": [1, 3],
                                         "rerun": "python scripts/collect.py pair=a data=gsm8k"}]


def test_the_paper_experiment_fits_six_pairs_and_holds_out_four_that_never_reach_collect_fit_or_distill(monkeypatch):
    from treegraft.pipeline.collect import collect_pairs
    from treegraft.pipeline.common import fit_pairs
    from treegraft.pipeline.evaluate import eval_pairs

    paper_pairs = {p.stem for p in (REPO_ROOT / "conf" / "pair").glob("*.yaml") if "paper" in p.read_text().split("tags:")[-1]}
    assert len(paper_pairs) == 10
    cfgs = {stage: compose(stage, ["experiment=paper"]) for stage in ("collect", "fit", "distill", "evaluate", "sweep")}
    fitted, held = list(cfgs["fit"].pipeline.pairs), list(cfgs["fit"].pipeline.held_out_pairs)
    assert len(fitted) == 6 and len(held) == 4 and set(fitted) | set(held) == paper_pairs
    assert {p.split("__")[0].split("-")[0][:5] for p in held} == {"llama", "qwen3"}  # both families
    for stage in ("collect", "fit", "distill"):
        assert fit_pairs(cfgs[stage]) == fitted
    assert collect_pairs(cfgs["collect"]) == fitted
    assert set(eval_pairs(cfgs["evaluate"])) == paper_pairs  # evaluated: all ten
    # a sweep job asked for a held-out pair refuses in one line, before anything is loaded
    job = compose("collect", ["experiment=paper", f"pair={held[0]}"])
    with pytest.raises(ValueError, match=f"pair {held[0]} is held out"):
        collect_pairs(job)
    # the sweep's collect never names a held-out pair, its evaluate names all ten; each job asks for the GPUs
    # its pair needs on 80 GiB GPUs (from the published shapes: no hub here)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from treegraft.pipeline.sweep import gpus_for_pair, plan_sweep

    runs = plan_sweep(cfgs["sweep"], ["experiment=paper"])
    collected = {p for r in runs if r.stage == "collect" for p in r.pairs}
    evaluated = {p for r in runs if r.stage == "evaluate" for p in r.pairs}
    assert collected == set(fitted) and evaluated == paper_pairs
    gpus = {p: gpus_for_pair(p, cfgs["sweep"]) for p in paper_pairs}
    assert gpus["llama3.3-70b__3.1-8b"] == 3 and gpus["qwen3-8b__0.6b"] == 1 and gpus["qwen3-32b__8b"] == 2
    for r in runs:
        if r.stage in ("collect", "evaluate"):
            assert f"hydra.launcher.gpus_per_node={r.gpus}" in r.argv and all(gpus[p] == r.gpus for p in r.pairs)
            assert r.jobs == len(r.pairs) * (5 if r.stage == "collect" else 6)


def test_the_sweep_forwards_only_what_a_stage_takes():
    from treegraft.pipeline.sweep import forwarded_overrides

    overrides = ["experiment=smoke", "paths.output_dir=/x", "evaluation.methods=[ar]", "placement.kv_tokens=8",
                 "launcher=slurm", "shards=4", "tree.budget=7"]
    assert forwarded_overrides(overrides, "fit") == ["experiment=smoke", "paths.output_dir=/x", "tree.budget=7"]
    assert forwarded_overrides(overrides, "evaluate") == ["experiment=smoke", "paths.output_dir=/x", "evaluation.methods=[ar]",
                                                          "placement.kv_tokens=8", "tree.budget=7"]


def _collect_rows(exp: Path) -> pd.DataFrame:
    keys = ["pair", "benchmark", "question_id", "turn", "schedule", "step"]
    frames = [pd.read_parquet(p) for p in sorted((exp / "collect").glob("*/*/q*.parquet"))]
    return pd.concat(frames).sort_values(keys).reset_index(drop=True)


def _raw_records(exp: Path) -> dict:
    out = {}
    for path in (exp / "evaluate").glob("*/*/*.jsonl"):
        for line in path.read_text().splitlines():
            r = json.loads(line)
            out[r["pair"], r["benchmark"], r["method"], r["question_id"]] = r
    return out


@pytest.fixture(scope="module")
def sweep_and_single(tmp_path_factory):
    """The smoke sweep through submitit's local launcher (one job per pair x benchmark), and the same
    experiment as one job per stage in this process, each into its own outputs folder."""
    from treegraft.pipeline.collect import run_collect
    from treegraft.pipeline.distill import run_distill
    from treegraft.pipeline.evaluate import run_evaluate
    from treegraft.pipeline.fit import run_fit

    sharded, single = tmp_path_factory.mktemp("sharded"), tmp_path_factory.mktemp("single")
    cmd = [sys.executable, str(REPO_ROOT / "scripts" / "sweep.py"), "experiment=smoke_sweep", "launcher=local",
           f"paths.output_dir={sharded}", "poll_s=5"]
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, env=JOB_ENV, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    minutes = (time.monotonic() - start) / 60
    args = ["experiment=smoke_sweep", f"paths.output_dir={single}"]
    run_collect(compose("collect", args))
    run_fit(compose("fit", args))
    run_distill(compose("distill", args))
    run_evaluate(compose("evaluate", args))
    return sharded / "pipeline" / "smoke_sweep", single / "pipeline" / "smoke_sweep", proc.stdout, minutes


def test_the_sharded_sweep_merges_to_the_single_job_run(sweep_and_single):
    from treegraft.pipeline.report import make_tables

    sharded, single, log, minutes = sweep_and_single
    # every stage went through submitit, collect and evaluate as one job per pair x benchmark
    for stage, jobs in (("collect", 4), ("fit", 1), ("distill", 1), ("evaluate", 4), ("report", 1)):
        assert len(list((sharded / "multirun" / stage / ".submitit").glob("[0-9]*"))) == jobs, stage
    assert "collect: 8 of 8 prompts present (4 units), nothing missing" in log
    assert "evaluate: 40 of 40 prompts present (20 units), nothing missing" in log
    assert (sharded / "report" / "main.md").exists()  # the report job
    # What may differ: what a clock decides (treegraft's runtime context, every wall time) and what a decoder
    # carried over from the prompts it ran before in the same process (the n-gram drafter's acceptance counts,
    # kept across prompts by design). A job of the first benchmark runs that benchmark's prompts after the same
    # warm-up as the single job, so there everything the trees decide is equal; elsewhere the history differs.
    first = "gsm8k"
    # collect: the same enumerated turns and schedules; on the first benchmark the same outcomes
    a, b = _collect_rows(sharded), _collect_rows(single)
    keys = ["pair", "benchmark", "question_id", "turn", "schedule", "step", "action"]
    assert len(a) > 0 and a[keys].equals(b[keys])
    decided = keys + ["accepted", "tree_nodes", "verified_nodes", "small_calls", "middle_calls", "middle_tokens"]
    assert a.loc[a["benchmark"] == first, decided].equals(b.loc[b["benchmark"] == first, decided])
    # evaluate: the same records and outputs everywhere; the same accepted lengths where neither a clock nor an
    # earlier prompt decides them (ar and all_mid: no n-gram drafter; every method but treegraft on the first benchmark)
    ra, rb = _raw_records(sharded), _raw_records(single)
    assert set(ra) == set(rb) and len(ra) == 2 * 2 * 5 * 2
    for key in ra:
        assert ra[key]["tokens"] == rb[key]["tokens"], key
        if key[2] in ("ar", "all_mid") or (key[1] == first and key[2] != "treegraft"):
            assert ra[key]["accepted"] == rb[key]["accepted"], key
    # the merged report: the same tables, rows and prompt counts; the same AL where no clock or history decides
    ta = make_tables(sharded, n_resamples=200, out_dir=sharded / "report_check")
    tb = make_tables(single, n_resamples=200, out_dir=single / "report_check")
    for name in ("main", "gain", "scheduling", "held_out"):
        assert list(ta[name].columns) == list(tb[name].columns), name
        assert len(ta[name]) == len(tb[name]), name
    main_a, main_b = ta["main"].set_index("method"), tb["main"].set_index("method")
    assert (main_a["n prompts"] == main_b["n prompts"]).all() and (main_a["mismatches"] == 0).all()
    assert main_a.loc["all_mid", "mean AL"] == pytest.approx(main_b.loc["all_mid", "mean AL"])
    for method in ("all_small", "all_mid", "fixed"):
        assert main_a.loc[method, f"{first} AL"] == pytest.approx(main_b.loc[method, f"{first} AL"])
    print(f"sharded smoke sweep: {minutes:.1f} min")


def test_a_removed_shard_is_named_by_the_merge_and_refilled_by_its_job(sweep_and_single, tmp_path):
    import shutil

    from treegraft.pipeline.collect import collect_coverage, merge_collect
    from treegraft.pipeline.evaluate import evaluate_coverage

    sharded, *_ = sweep_and_single
    exp = tmp_path / "pipeline" / "smoke_sweep"
    shutil.copytree(sharded, exp)
    (exp / "collect" / "tiny-random__self" / "humaneval" / "q1.parquet").unlink()
    record_file = next((exp / "evaluate" / "tiny-random" / "mt_bench").glob("fixed*.jsonl"))
    lines = record_file.read_text().splitlines()
    dropped = json.loads(lines[-1])["question_id"]
    record_file.write_text("".join(line + "\n" for line in lines[:-1]))
    args = ["experiment=smoke_sweep", f"paths.output_dir={tmp_path}"]
    _, coverage = merge_collect(compose("fit", args), exp / "collect")
    assert coverage.missing == {("tiny-random__self", "humaneval"): [1]}
    assert json.loads((exp / "collect" / "coverage.json").read_text())["missing"][0]["rerun"] == (
        "python scripts/collect.py experiment=smoke_sweep pair=tiny-random__self data=humaneval")
    ev = evaluate_coverage(compose("evaluate", args), exp / "evaluate")
    assert ev.missing == {("tiny-random", "mt_bench", "fixed"): [dropped]}
    # the job the merge names fills in exactly that prompt
    from treegraft.pipeline.collect import run_collect

    before = {p: p.stat().st_mtime_ns for p in (exp / "collect").glob("*/*/q*.parquet")}
    run_collect(compose("collect", args + ["pair=tiny-random__self", "data=humaneval"]))
    after = {p: p.stat().st_mtime_ns for p in (exp / "collect").glob("*/*/q*.parquet")}
    assert set(after) - set(before) == {exp / "collect" / "tiny-random__self" / "humaneval" / "q1.parquet"}
    assert all(after[p] == m for p, m in before.items())
    assert collect_coverage(compose("collect", args), exp / "collect").complete


def test_a_killed_collect_job_resumes_where_it_stopped(tmp_path):
    """A collect job killed (SIGKILL) after its first prompt: the merge names the prompts it did not finish, and
    the same command again collects exactly those, leaving the finished one untouched."""
    from treegraft.pipeline.collect import collect_coverage, run_collect

    args = ["experiment=smoke_sweep", f"paths.output_dir={tmp_path}", "pipeline.prompts_per_benchmark=4",
            "pipeline.max_enumerated_turns=3"]
    job = args + ["pair=tiny-random", "data=gsm8k", "shard.count=2", "shard.index=1"]  # the second prompt range
    folder = tmp_path / "pipeline" / "smoke_sweep" / "collect" / "tiny-random" / "gsm8k"
    proc = subprocess.Popen([sys.executable, str(REPO_ROOT / "scripts" / "collect.py"), *job], env=JOB_ENV,
                            cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while not list(folder.glob("q*.parquet")) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert proc.poll() is None, "the job ended before it could be killed"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    done = {p: p.stat().st_mtime_ns for p in folder.glob("q*.parquet")}
    assert len(done) == 1
    cfg = compose("collect", args)
    coverage = collect_coverage(cfg, tmp_path / "pipeline" / "smoke_sweep" / "collect")
    ids = coverage.expected["tiny-random", "gsm8k"]
    second_range = Shard(1, 2).take(ids)
    assert Path(next(iter(done))).stem == f"q{second_range[0]}"
    assert coverage.missing["tiny-random", "gsm8k"] == [q for q in ids if f"q{q}" != Path(next(iter(done))).stem]
    run_collect(compose("collect", job))  # the same job again
    after = {p: p.stat().st_mtime_ns for p in folder.glob("q*.parquet")}
    assert sorted(p.stem for p in after) == sorted(f"q{q}" for q in second_range)  # only its own range
    assert all(after[p] == m for p, m in done.items())  # the finished prompt is not redone
    assert collect_coverage(cfg, tmp_path / "pipeline" / "smoke_sweep" / "collect").missing["tiny-random", "gsm8k"] == \
        Shard(0, 2).take(ids)  # what the other range's job has yet to do


def test_records_of_one_prompt_in_several_files_count_once_the_newest(tmp_path):
    from treegraft.pipeline.records import read_records

    folder = tmp_path / "p" / "gsm8k"
    folder.mkdir(parents=True)

    def record(q, wall, tstamp):
        return json.dumps({"pair": "p", "benchmark": "gsm8k", "method": "fixed", "question_id": q,
                           "choices": [{"new_tokens": [4], "wall_time": [wall]}], "turns": 2, "accepted": [1, 1],
                           "middle_calls": 0, "steps": 2, "time_split": {"small_s": 0.0}, "tstamp": tstamp}) + "\n"

    (folder / "fixed.shard0of2.jsonl").write_text(record(0, 1.0, 1.0))
    (folder / "fixed.shard1of2.jsonl").write_text(record(1, 2.0, 1.0))
    (folder / "fixed.jsonl").write_text(record(0, 3.0, 2.0) + record(1, 4.0, 0.5))  # q0 redone later, q1 older
    df = read_records(tmp_path).set_index("question_id")
    assert len(df) == 2 and df.loc[0, "wall_time"] == 3.0 and df.loc[1, "wall_time"] == 2.0


def test_generate_finds_the_newest_policy_fitted_on_its_pair_and_engine(sweep_and_single, tmp_path):
    """`make all` then `generate method=treegraft`: method.artifacts=auto finds the experiment whose scheduler
    was fitted on this pair with this engine, the newest of several, and says in one line when none was."""
    import shutil

    from treegraft.decoding.methods import find_artifacts
    from treegraft.errors import MissingArtifactError

    from .test_generate_cli import run_generate

    _, single, *_ = sweep_and_single
    for name in ("older", "newer", "other_pair", "other_engine"):
        shutil.copytree(single / "distill", tmp_path / "pipeline" / name / "distill")
    meta = tmp_path / "pipeline" / "other_pair" / "distill" / "scheduler.meta.json"
    meta.write_text(json.dumps({**json.loads(meta.read_text()), "pairs": ["smollm2-135m__self"]}))
    config = tmp_path / "pipeline" / "other_engine" / "distill" / "config.yaml"
    config.write_text(config.read_text().replace("engine:\n  name: torch", "engine:\n  name: llama_cpp"))
    for name, when in (("older", 1_000_000), ("newer", 2_000_000), ("other_pair", 3_000_000), ("other_engine", 3_000_000)):
        os.utime(tmp_path / "pipeline" / name / "distill" / "scheduler.pt", (when, when))
    assert find_artifacts("treegraft", "tiny-random", "torch", tmp_path) == tmp_path / "pipeline" / "newer"
    assert find_artifacts("treegraft", "tiny-random", "llama_cpp", tmp_path) == tmp_path / "pipeline" / "other_engine"
    with pytest.raises(MissingArtifactError, match=r"no treegraft policy fitted on pair qwen3-8b__0.6b with engine torch .*"
                                                   r"\(looked at newer, older, other_engine, other_pair\)"):
        find_artifacts("treegraft", "qwen3-8b__0.6b", "torch", tmp_path)
    proc = run_generate("pair=tiny-random", "method=treegraft", f"paths.output_dir={tmp_path}", "chat_template=false",
                        "prompt=hello world", "max_new_tokens=8", "runtime=float32")
    assert proc.returncode == 0, proc.stderr
    assert f"[treegraft] policy from {tmp_path / 'pipeline' / 'newer'}" in proc.stderr
    ar = run_generate("pair=tiny-random", "method=ar", "chat_template=false", "prompt=hello world", "max_new_tokens=8",
                      "runtime=float32")
    assert proc.stdout == ar.stdout  # lossless, with the policy it found
