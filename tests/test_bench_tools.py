"""scripts/bench_llama_engine.py's stock llama.cpp peers: which flags each mode gets and how its times are read
(fake tools that print what the real ones print)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from bench_llama_engine import ToolPeer  # noqa: E402

PLAIN_LOG = """llama_perf_context_print: prompt eval time =     250.00 ms /   190 tokens (    1.32 ms per token)
llama_perf_context_print:        eval time =    4000.00 ms /   127 runs   (   31.50 ms per token)"""
SPEC_LOG = """encoded  190 tokens in    0.300 seconds, speed:  633.333 t/s
decoded  128 tokens in    3.200 seconds, speed:   40.000 t/s"""


def _tools(tmp_path: Path) -> Path:
    bins = tmp_path / "bin"
    bins.mkdir()
    for name, log in (("llama-completion", PLAIN_LOG), ("llama-speculative-simple", SPEC_LOG)):
        tool = bins / name
        tool.write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path / (name + '.args')}\ncat >&2 <<'LOG'\n{log}\nLOG\n")
        tool.chmod(0o755)
    return bins


def _peer(spec: str, tmp_path: Path) -> ToolPeer:
    return ToolPeer(spec, _tools(tmp_path), Path("t.gguf"), Path("d.gguf"), 2, tmp_path)


def test_plain_reads_the_prompt_and_the_decoding_times(tmp_path):
    r = _peer("plain", tmp_path).generate("hello", 128)
    assert (r["n_tokens"], r["prefill_time_s"], r["decode_s"]) == (127, 0.25, 4.0)
    assert r["wall_time_s"] == pytest.approx(4.25)  # end to end without loading the model


@pytest.mark.parametrize("spec, flags", [
    ("draft-simple:8:0.6", ["--spec-type draft-simple", "--spec-draft-n-max 8", "-md d.gguf", "--spec-draft-p-min 0.6"]),
    ("ngram-mod:12", ["--spec-type ngram-mod", "--spec-ngram-mod-n-max 12"]),
    ("ngram-map-k:6", ["--spec-type ngram-map-k", "--spec-ngram-map-k-size-m 6"]),
    ("ngram-mod:8+nr+fa=off", ["--spec-ngram-mod-n-max 8", "--no-repack", "-fa off"]),
])
def test_each_speculative_mode_gets_its_own_draft_length_flag(tmp_path, spec, flags):
    r = _peer(spec, tmp_path).generate("hello", 128)
    args = (tmp_path / "llama-speculative-simple.args").read_text()
    assert all(f in args for f in flags), args
    assert (r["n_tokens"], r["prefill_time_s"], r["decode_s"]) == (128, 0.3, 3.2)


@pytest.mark.parametrize("spec", ["plain:4", "ngram-simple", "magic:4", "ngram-mod:4:0.5", "draft-simple:x", "plain+fast"])
def test_a_bad_mode_is_refused_in_one_line(tmp_path, spec):
    with pytest.raises(ValueError, match="tool method"):
        _peer(spec, tmp_path)


def test_output_ending_inside_a_multibyte_character_is_read(tmp_path):
    bins = _tools(tmp_path)
    tool = bins / "llama-completion"  # prints a UTF-8 character cut after its first two bytes, then the timings
    tool.write_text(f"#!/bin/sh\nprintf '\\344\\270'\ncat >&2 <<'LOG'\n{PLAIN_LOG}\nLOG\n")
    r = ToolPeer("plain", bins, Path("t.gguf"), Path("d.gguf"), 2, tmp_path).generate("hello", 128)
    assert r["n_tokens"] == 127
