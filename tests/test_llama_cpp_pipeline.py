"""The scheduler pipeline on engine=llama_cpp (SmolLM2's GGUF, the whole file as its own drafter): collect,
fit, distill and evaluate end to end through the one engine dispatch, records that say which engine and
build they ran on, every method's greedy output equal to this engine's `ar`; and engine=auto's choice."""

from __future__ import annotations

import json

import pytest

from .conftest import compose, require_embedded
from .test_llama_cpp import _require_llama_cpp

# the smoke experiment, smaller still: SmolLM2 drafts for itself here, so a middle call costs a target step
OVERRIDES = ["experiment=smoke", "engine=llama_cpp", "pipeline.pairs=[smollm2-135m__self]",
             "pipeline.fit_benchmarks=[gsm8k,humaneval]", "pipeline.max_new_tokens=10",
             "pipeline.max_enumerated_turns=1", "pipeline.warmup_repeats=1", "pipeline.max_prompt_tokens=48",
             "tree.budget=6", "tree.width=2", "tree.top_m=2",
             "evaluation.methods=[ar,all_small,treegraft]", "evaluation.max_new_tokens=12",
             "engine.n_ctx=1024", "pipeline.collect_schedule=[0,0,0,0,0]"]  # as cpu_llama decodes between enumerations


@pytest.fixture(scope="module")
def llama_smoke(tmp_path_factory):
    _require_llama_cpp()
    require_embedded("smollm2-135m")
    from treegraft.pipeline.collect import run_collect
    from treegraft.pipeline.distill import run_distill
    from treegraft.pipeline.evaluate import run_evaluate
    from treegraft.pipeline.fit import run_fit

    out = tmp_path_factory.mktemp("llama-pipeline")
    args = OVERRIDES + [f"paths.output_dir={out}"]
    run_collect(compose("collect", args))
    run_fit(compose("fit", args))
    run_distill(compose("distill", args))
    run_evaluate(compose("evaluate", args))
    return out / "pipeline" / "smoke"


def test_collect_records_the_engine_and_its_build(llama_smoke):
    from treegraft.engines.llama_cpp.build import patch_id

    runtime = json.loads((llama_smoke / "collect" / "smollm2-135m__self" / "runtime.json").read_text())
    assert runtime["engine"] == "llama_cpp" and runtime["engine_exact"] is True
    assert runtime["engine_build"] == patch_id() and runtime["runtime"] == "llama.cpp exact"
    assert runtime["t_tgt_ms"] > 0 and runtime["t_mid_ms"] > 0  # the runtime context, measured on this engine
    assert runtime["collect_schedule"] == [0, 0, 0, 0, 0]  # the collecting decoder's own schedule, not tree.schedule
    shards = list((llama_smoke / "collect" / "smollm2-135m__self").glob("*/q*.parquet"))
    assert len(shards) == 2  # one prompt of each fitting benchmark


def test_every_method_on_llama_cpp_equals_its_ar(llama_smoke):
    from treegraft.pipeline.records import read_records

    records = read_records(llama_smoke / "evaluate")
    assert set(records["method"]) == {"ar", "all_small", "treegraft"}
    assert (records["engine"] == "llama_cpp").all()
    assert records["engine_exact"].all()
    others = records[records["method"] != "ar"]
    assert others["matches_ar"].all(), others[~others["matches_ar"]][["benchmark", "method", "question_id"]]
    assert (records["new_tokens"] > 0).all()


def test_the_records_of_another_engine_are_not_reused(llama_smoke):
    from treegraft.pipeline.evaluate import run_key

    torch_cfg = compose("evaluate", [o for o in OVERRIDES if not o.startswith("engine")])
    llama_cfg = compose("evaluate", OVERRIDES)
    artifacts = llama_smoke
    assert run_key(torch_cfg, "p", "all_small", artifacts) != run_key(llama_cfg, "p", "all_small", artifacts)


def test_engine_auto_picks_by_the_measured_step_and_says_why(monkeypatch):
    from treegraft import front as select
    from treegraft.models import PairSpec

    cfg = compose("generate", ["pair=tiny-random", "engine=auto", "runtime=float32"])
    spec = PairSpec(name="tiny-random", target="tiny-random:0", middle="tiny-random:1")
    choice = select.choose_engine(spec, cfg, "cpu")
    assert choice["engine"] == "torch" and "not GGUF" in choice["reason"]  # a Hugging Face pair: PyTorch

    _require_llama_cpp()
    require_embedded("smollm2-135m")
    gguf = PairSpec(name="smol", target="embedded:smollm2-135m", self_draft_layers=28)
    curves = {"llama": 0.010, "torch": 0.020}
    monkeypatch.setattr(select.LlamaEngines, "verify_curve", lambda self, cache, max_size=64: {1: curves["llama"]})
    monkeypatch.setattr(select.TorchEngines, "verify_curve", lambda self, cache, max_size=64: {1: curves["torch"]})
    assert select.choose_engine(gguf, cfg, "cpu")["engine"] == "llama_cpp"
    curves["llama"] = 0.030
    choice = select.choose_engine(gguf, cfg, "cpu")
    assert choice["engine"] == "torch" and choice["llama_step_ms"] == pytest.approx(30.0)
    assert select.choose_engine(gguf, cfg, "cuda")["engine"] == "torch"  # not on a GPU


def test_make_all_auto_runs_the_experiment_of_the_faster_engine(monkeypatch):
    from treegraft.config import CONF_DIR
    from treegraft import front as select
    from treegraft.pipeline.run_all import AUTO_EXPERIMENTS, auto_experiment

    cfg = compose("collect", ["experiment=cpu"])
    for engine, experiment in (("llama_cpp", "cpu_llama"), ("torch", "cpu")):
        monkeypatch.setattr(select, "choose_engine", lambda *a, engine=engine, **k: {"engine": engine, "reason": "test"})
        assert auto_experiment(cfg, log=lambda *_: None) == (experiment, {"engine": engine, "reason": "test"})
    for experiment in AUTO_EXPERIMENTS.values():
        assert (CONF_DIR / "experiment" / f"{experiment}.yaml").is_file()
        assert compose("evaluate", [f"experiment={experiment}"]).engine.name == (
            "llama_cpp" if experiment == "cpu_llama" else "torch")


def test_generate_finds_the_scheduler_the_pipeline_just_fitted_on_this_engine(llama_smoke, capsys):
    """`make all` then `python -m treegraft.generate engine=llama_cpp method=treegraft`: method.artifacts=auto
    finds the experiment that fitted this pair on this engine, and its output is the engine's own `ar`."""
    from treegraft.generate import run

    common = ["pair=smollm2-135m__self", "engine=llama_cpp", "engine.n_ctx=1024", "prompt=Add two numbers.",
              "max_new_tokens=12", f"paths.output_dir={llama_smoke.parent.parent}"]
    assert run(compose("generate", common + ["method=ar"])) == 0
    ar_text = capsys.readouterr().out
    assert run(compose("generate", common + ["method=treegraft"])) == 0
    out = capsys.readouterr()
    assert f"[treegraft] policy from {llama_smoke}" in out.err
    assert out.out == ar_text
