"""`make gpu-smoke`'s script: a clean skip without CUDA, and its checks themselves, run on a CPU on the
tiny pair (the GPU run is the same code with --device cuda)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from .conftest import REPO_ROOT

SCRIPT = REPO_ROOT / "scripts" / "gpu_smoke.py"


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine runs the real check")
def test_without_cuda_the_smoke_check_is_one_line_and_exit_0(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path)], capture_output=True, text=True)
    assert proc.returncode == 0
    assert proc.stdout.strip().splitlines() == [
        "gpu-smoke: skipped: no CUDA device here (torch.cuda.is_available() is False); the CPU checks are `make test`"]
    assert not list(tmp_path.iterdir())


def test_the_smoke_checks_pass_on_the_tiny_pair_on_a_cpu(tmp_path):
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import gpu_smoke
    finally:
        sys.path.remove(str(SCRIPT.parent))
    assert gpu_smoke.main(["--device", "cpu", "--pairs", "tiny-random", "--no-pipeline", "--max-new-tokens", "24",
                           "--out", str(tmp_path)]) == 0
    rows = json.loads(next(tmp_path.glob("*.json")).read_text())["rows"]
    checks = {(r["check"], r["method"]) for r in rows}
    methods = {"ar", "all_small", "all_mid", "fixed", "csd", "treegraft", "hf_assisted", "hf_prompt_lookup"}
    assert {m for c, m in checks if c == "equality"} >= methods | {"fixed vocab=64", "treegraft vocab=64"}
    assert {"kv-cache", "timing", "memory", "sampling"} <= {c for c, _ in checks}
    assert all(r["ok"] for r in rows)
