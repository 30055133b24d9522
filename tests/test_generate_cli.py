"""`python -m treegraft.generate`: text on stdout, one stats line on stderr, one-line errors."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from treegraft.models import build_tiny_model, build_tiny_tokenizer

from .conftest import REPO_ROOT
from .conftest import ar_decoder


def run_generate_process(*overrides: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """``python -m treegraft.generate`` in a process of its own (the real command line)."""
    return subprocess.run(
        [sys.executable, "-m", "treegraft.generate", *overrides],
        capture_output=True, text=True, cwd=REPO_ROOT, env={**os.environ, **(env or {})}, timeout=300,
    )


def run_generate(*overrides: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """The command line's steps in this process (the config-name check, the composed config, `cli`), its
    stdout, stderr and exit status captured: what :func:`run_generate_process` gives, without the ~10 s of
    imports a new interpreter costs on a slow CPU. The tests that start a real process keep the two equal."""
    import contextlib
    import io

    from treegraft.config import check_config_choices
    from treegraft.generate import cli

    from .conftest import compose

    out, err = io.StringIO(), io.StringIO()
    saved = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                check_config_choices(list(overrides))
                code = cli(compose("generate", list(overrides)))
            except SystemExit as exit_:
                code = exit_.code
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return subprocess.CompletedProcess(list(overrides), code, out.getvalue(), err.getvalue())


def test_generate_prints_text_and_stats_line():
    args = ("pair=tiny-random", "chat_template=false", "prompt=hello world again", "max_new_tokens=16", "runtime=float32")
    proc = run_generate_process(*args)
    assert proc.returncode == 0, proc.stderr
    same = run_generate(*args)  # the in-process runner the other tests use prints the same
    assert (same.returncode, same.stdout) == (0, proc.stdout)
    assert same.stderr.split(" time=")[0] == proc.stderr.split(" time=")[0]
    tok = build_tiny_tokenizer()
    expected = ar_decoder(build_tiny_model(0), {2}).generate(tok("hello world again").input_ids, 16)
    assert proc.stdout == tok.decode(expected.tokens, skip_special_tokens=True) + "\n"
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("[ar]")  # exactly one stats line
    assert "new_tokens=16" in lines[0] and "tokens/s=" in lines[0]


def test_generate_reads_prompt_file_with_any_characters(tmp_path):
    prompt = tmp_path / "p.txt"
    prompt.write_text("x = {'a': [1, 2]}  # = , ' \" $ \\")
    proc = run_generate("pair=tiny-random", "chat_template=false", f"prompt_file={prompt}", "max_new_tokens=4",
                        "temperature=0.7", "seed=3", "dtype=bfloat16")
    assert proc.returncode == 0, proc.stderr
    assert "new_tokens=4" in proc.stderr


def test_generate_missing_embedded_model_is_one_line(tmp_path):
    proc = run_generate("pair=qwen-coder-1.5b__0.5b", "prompt=hi", env={"TREEGRAFT_MODELS": str(tmp_path)})
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"error: embedded model qwen-coder-1.5b not converted: run `make models` (looked in {tmp_path}/qwen-coder-1.5b)"
    ]


def test_generate_empty_prompt_is_an_error():
    proc = run_generate("pair=tiny-random", "prompt=' '")
    assert proc.returncode == 2 and "empty prompt" in proc.stderr


def test_generate_speculative_methods_print_the_same_text_as_ar():
    args = ["pair=tiny-random", "chat_template=false", "prompt=abc abc abc abc", "max_new_tokens=24", "runtime=float32"]
    ar = run_generate(*args, "method=ar")
    assert ar.returncode == 0, ar.stderr
    for method in ("all_small", "all_mid", "hf_prompt_lookup"):
        proc = run_generate(*args, f"method={method}", "tree.budget=12")
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout == ar.stdout, method
        assert f"[{method}]" in proc.stderr
        if method == "all_small":
            assert "mean_AL=" in proc.stderr


def test_runtime_auto_prints_its_choice_once(tmp_path):
    args = ["pair=tiny-random", "chat_template=false", "prompt=hello", "max_new_tokens=4", "runtime=auto"]
    env = {"TREEGRAFT_CACHE": str(tmp_path)}
    first = run_generate(*args, env=env)
    assert first.returncode == 0, first.stderr
    lines = first.stderr.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("runtime auto -> ") and " | " in lines[0]  # with the CPU line
    chosen = lines[0].split("-> ")[1].split(" ")[0]
    assert f"runtime={chosen}" in lines[1]
    second = run_generate(*args, env=env)  # cached per machine and model: only the stats line
    assert len(second.stderr.strip().splitlines()) == 1 and f"runtime={chosen}" in second.stderr
    assert first.stdout == second.stdout


def test_unknown_runtime_is_one_line():
    proc = run_generate("pair=tiny-random", "prompt=hi", "runtime=int3")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: unknown runtime 'int3'; expected auto or one of float32, bfloat16, float32_packed, bfloat16_packed, int4, int8"
    ]


def test_unknown_config_names_are_one_line_with_the_available_names():
    proc = run_generate_process("pair=nope", "prompt=hi")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: unknown pair 'nope'; available: ")
    assert "qwen-coder-1.5b__0.5b" in lines[0] and "tiny-random" in lines[0]
    proc = run_generate("pair=tiny-random", "method=magic", "prompt=hi")
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[0].startswith("error: unknown method 'magic'")
    for script, arg in (("evaluate.py", "experiment=nope"), ("collect.py", "data=nope")):
        proc = subprocess.run([sys.executable, f"scripts/{script}", arg], capture_output=True, text=True,
                              cwd=REPO_ROOT, timeout=300)
        assert proc.returncode == 2
        assert len(proc.stderr.strip().splitlines()) == 1 and f"unknown {arg.split('=')[0]} 'nope'" in proc.stderr


def test_a_misspelt_tree_setting_is_one_line_naming_the_known_ones():
    for arg in ("tree.bugdet=8", "+tree.bugdet=8"):  # Hydra's own message, or the library's check
        proc = run_generate("pair=tiny-random", "prompt=hi", "max_new_tokens=2", arg)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1, proc.stderr
        assert lines[0].startswith("error: unknown tree setting 'bugdet'; expected one of ") and "budget" in lines[0]
    proc = run_generate("pair=tiny-random", "prompt=hi", "max_new_tokens=2", "tree.ngram.max_x=3")
    assert proc.returncode == 2 and "unknown tree.ngram setting 'max_x'" in proc.stderr


def test_bench_engine_learned_method_without_artifacts_names_the_stage(tmp_path):
    proc = subprocess.run(
        [sys.executable, "scripts/bench_engine.py", "pair=tiny-random", "methods=[ar,treegraft]", f"artifacts={tmp_path}",
         "prompts_per_benchmark=1", "max_new_tokens=4", "max_prompt_tokens=64", f"out_dir={tmp_path / 'bench'}"],
        capture_output=True, text=True, cwd=REPO_ROOT, timeout=600)
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: missing ") and "make collect fit distill" in last
    assert "Traceback" not in proc.stderr


def _bench_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_engine", REPO_ROOT / "scripts" / "bench_engine.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_engine_method_variants_split_tree_and_policy_overrides():
    bench = _bench_module()
    tree_overrides, policy = bench.method_overrides("treegraft:artifacts=/a/b,threshold=-1,schedule=[1,0],ngram.copy_len=0")
    assert tree_overrides == ["schedule=[1,0]", "ngram.copy_len=0"]
    assert policy == {"artifacts": "/a/b", "threshold": "-1"}
    tree = {"depth": 5, "ngram": {"copy_len": 24}}
    assert bench.variant_tree(tree, "treegraft:artifacts=/a/b") is tree  # a policy override leaves the tree alone
    assert bench.variant_tree(tree, "all_mid:ngram.copy_len=0")["ngram"] == {"copy_len": 0}
    assert bench.method_overrides("all_mid") == ([], {})


def test_bench_engine_policy_override_loads_the_other_artifacts_or_says_what_is_wrong(tmp_path):
    def bench(method):
        return subprocess.run(
            [sys.executable, "scripts/bench_engine.py", "pair=tiny-random", f"methods=[ar,{method}]", f"artifacts={tmp_path}",
             "prompts_per_benchmark=1", "max_new_tokens=4", "max_prompt_tokens=64", f"out_dir={tmp_path / 'bench'}"],
            capture_output=True, text=True, cwd=REPO_ROOT, timeout=600)

    proc = bench(f'"treegraft:artifacts={tmp_path / "other"}"')
    assert proc.returncode == 2 and str(tmp_path / "other" / "distill" / "scheduler.pt") in proc.stderr.strip().splitlines()[-1]
    proc = bench('"all_mid:threshold=-1"')
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 2 and last.startswith("error: method 'all_mid:threshold=-1': threshold= applies to treegraft only")
