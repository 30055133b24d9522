"""Tests for treegraft.data.benchmarks: question-file loading, config validation, prompt formatting.

The reference question files are read from $TREEGRAFT_BENCHMARKS (CI: ../shared/data/benchmarks,
relative to the repository root); when it is unset, /work/shared/data/benchmarks is used if it
exists, else the tests that need the files are skipped.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from treegraft.data import BENCHMARKS, BenchmarkConfig, BenchmarkFormatError, format_prompt, load_benchmark
from treegraft.paths import REPO_ROOT

FALLBACK_BENCHMARKS_DIR = Path("/work/shared/data/benchmarks")
EXPECTED_CATEGORY = {"gsm8k": "math", "alpaca": "", "nq": "qa", "humaneval": "code", "cnndm": "summarization"}
FIRST_ID = {"gsm8k": 0, "alpaca": 0, "nq": 321, "humaneval": 0, "cnndm": 241, "mt_bench": 81}


@pytest.fixture(scope="session")
def bench_dir() -> Path:
    env = os.environ.get("TREEGRAFT_BENCHMARKS")
    if env:
        path = Path(env)
        if not path.is_absolute() and not path.is_dir():
            path = REPO_ROOT / path  # CI gives it relative to the repository root
        if not path.is_dir():
            pytest.fail(f"TREEGRAFT_BENCHMARKS={env!r} is set but is not a directory")
        return path
    if FALLBACK_BENCHMARKS_DIR.is_dir():
        return FALLBACK_BENCHMARKS_DIR
    pytest.skip(f"benchmark files not found: TREEGRAFT_BENCHMARKS is unset and {FALLBACK_BENCHMARKS_DIR} does not exist")


def write_questions(root: Path, name: str, lines: list[str]) -> Path:
    path = root / name / "question.jsonl"
    path.parent.mkdir(parents=True)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def good_line(qid: int, **extra) -> str:
    return json.dumps({"question_id": qid, "category": "c", "turns": [f"question {qid}?"], **extra})


# ---------------------------------------------------------------- the reference files


@pytest.mark.parametrize("name", BENCHMARKS)
def test_each_benchmark_loads_80_records(bench_dir: Path, name: str) -> None:
    ds = load_benchmark(BenchmarkConfig(name=name, benchmarks_dir=str(bench_dir)))
    assert len(ds) == 80
    assert ds.column_names == ["question_id", "category", "turns", "reference", "benchmark"]
    rows = ds.to_list()
    ids = [r["question_id"] for r in rows]
    assert ids == list(range(FIRST_ID[name], FIRST_ID[name] + 80))
    for r in rows:
        assert isinstance(r["question_id"], int)
        assert isinstance(r["category"], str)
        assert isinstance(r["turns"], list) and len(r["turns"]) == 1  # turns="first"
        assert isinstance(r["turns"][0], str) and r["turns"][0].strip()
        assert isinstance(r["reference"], list) and all(isinstance(x, str) for x in r["reference"])
        assert r["benchmark"] == name
        if name in EXPECTED_CATEGORY:
            assert r["category"] == EXPECTED_CATEGORY[name]
    if name == "nq":
        assert all(r["reference"] == [] for r in rows)  # no "reference" key in the file -> empty list
    if name == "gsm8k":
        assert all("####" in r["reference"][0] for r in rows)
    if name == "humaneval":
        assert all(r["turns"][0].startswith("Complete the code I provided.") for r in rows)
    if name == "cnndm":
        assert all(r["turns"][0].startswith("Summarize: ") for r in rows)


def test_default_dir_comes_from_env(bench_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TREEGRAFT_BENCHMARKS", str(bench_dir))
    ds = load_benchmark(BenchmarkConfig(name="nq", num_prompts=3))
    assert ds["question_id"] == [321, 322, 323]


def test_offset_and_num_prompts(bench_dir: Path) -> None:
    full = load_benchmark(BenchmarkConfig(name="gsm8k", benchmarks_dir=str(bench_dir)))
    part = load_benchmark(BenchmarkConfig(name="gsm8k", benchmarks_dir=str(bench_dir), offset=10, num_prompts=5))
    assert part["question_id"] == full["question_id"][10:15]
    assert part["turns"] == full["turns"][10:15]
    tail = load_benchmark(BenchmarkConfig(name="gsm8k", benchmarks_dir=str(bench_dir), offset=75))
    assert tail["question_id"] == full["question_id"][75:]


def test_too_many_prompts_names_both_numbers(bench_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"num_prompts=10 requested but only 5 prompts remain"):
        load_benchmark(BenchmarkConfig(name="alpaca", benchmarks_dir=str(bench_dir), offset=75, num_prompts=10))
    with pytest.raises(ValueError, match=r"offset=81 is past the end .* 80 prompts"):
        load_benchmark(BenchmarkConfig(name="alpaca", benchmarks_dir=str(bench_dir), offset=81))


def test_seeded_shuffle_is_deterministic_and_not_file_order(bench_dir: Path) -> None:
    def ids(seed, **kw):
        return load_benchmark(BenchmarkConfig(name="humaneval", benchmarks_dir=str(bench_dir), seed=seed, **kw))[
            "question_id"
        ]

    file_order = ids(None)
    a, b, c = ids(1234), ids(1234), ids(99)
    assert a == b
    assert a != file_order and c != a
    assert sorted(a) == file_order  # a permutation: nothing lost or repeated
    # the shuffle happens before offset/num_prompts
    assert ids(1234, offset=20, num_prompts=10) == a[20:30]


def test_turns_all_keeps_both_mt_bench_turns(bench_dir: Path) -> None:
    first = load_benchmark(BenchmarkConfig(name="mt_bench", benchmarks_dir=str(bench_dir)))
    every = load_benchmark(BenchmarkConfig(name="mt_bench", benchmarks_dir=str(bench_dir), turns="all"))
    assert all(len(t) == 2 for t in every["turns"])
    assert [t[0] for t in every["turns"]] == [t[0] for t in first["turns"]]
    assert len(set(every["category"])) == 8


# ---------------------------------------------------------------- malformed files


def test_bad_json_names_file_and_line(tmp_path: Path) -> None:
    path = write_questions(tmp_path, "gsm8k", [good_line(0), good_line(1), '{"question_id": 2, "turns": [', good_line(3)])
    with pytest.raises(BenchmarkFormatError, match="bad JSON") as info:
        load_benchmark(BenchmarkConfig(name="gsm8k", benchmarks_dir=str(tmp_path)))
    msg = str(info.value)
    assert f"{path}:3:" in msg and "\n" not in msg
    assert isinstance(info.value, ValueError)


def test_missing_turns(tmp_path: Path) -> None:
    path = write_questions(tmp_path, "nq", [good_line(0), json.dumps({"question_id": 1, "category": "qa"})])
    with pytest.raises(BenchmarkFormatError, match=r"missing field 'turns'") as info:
        load_benchmark(BenchmarkConfig(name="nq", benchmarks_dir=str(tmp_path)))
    assert f"{path}:2:" in str(info.value)


@pytest.mark.parametrize("turns", ["just a string", [], ["ok", 3]])
def test_turns_not_a_list_of_strings(tmp_path: Path, turns) -> None:
    bad = json.dumps({"question_id": 1, "category": "qa", "turns": turns})
    path = write_questions(tmp_path, "nq", [good_line(0), bad])
    with pytest.raises(BenchmarkFormatError, match="turns must be a non-empty list of strings") as info:
        load_benchmark(BenchmarkConfig(name="nq", benchmarks_dir=str(tmp_path)))
    assert f"{path}:2:" in str(info.value)


@pytest.mark.parametrize(
    "record, expected",
    [
        ({"question_id": "7", "category": "c", "turns": ["q"]}, "question_id must be an int"),
        ({"question_id": True, "category": "c", "turns": ["q"]}, "question_id must be an int"),
        ({"question_id": 7, "category": None, "turns": ["q"]}, "category must be a string"),
        ({"question_id": 7, "category": "c", "turns": ["q"], "reference": "r"}, "reference must be a list of strings"),
        (["not", "an", "object"], "expected a JSON object"),
    ],
)
def test_ill_typed_fields(tmp_path: Path, record, expected: str) -> None:
    path = write_questions(tmp_path, "alpaca", [json.dumps(record)])
    with pytest.raises(BenchmarkFormatError, match=expected) as info:
        load_benchmark(BenchmarkConfig(name="alpaca", benchmarks_dir=str(tmp_path)))
    assert f"{path}:1:" in str(info.value)


def test_duplicate_question_id(tmp_path: Path) -> None:
    write_questions(tmp_path, "alpaca", [good_line(0), good_line(1), good_line(0)])
    with pytest.raises(BenchmarkFormatError, match=r":3: duplicate question_id 0 \(first on line 1\)"):
        load_benchmark(BenchmarkConfig(name="alpaca", benchmarks_dir=str(tmp_path)))


def test_blank_lines_skipped_and_no_trailing_newline(tmp_path: Path) -> None:
    path = tmp_path / "cnndm" / "question.jsonl"
    path.parent.mkdir()
    path.write_text(good_line(5, reference=["r"]) + "\n\n   \n" + good_line(6), encoding="utf-8")
    ds = load_benchmark(BenchmarkConfig(name="cnndm", benchmarks_dir=str(tmp_path)))
    assert ds["question_id"] == [5, 6]
    assert ds["reference"] == [["r"], []]


def test_missing_file_message(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError) as info:
        load_benchmark(BenchmarkConfig(name="mt_bench", benchmarks_dir=str(tmp_path / "nowhere")))
    msg = str(info.value)
    assert str(tmp_path / "nowhere" / "mt_bench" / "question.jsonl") in msg
    assert "TREEGRAFT_BENCHMARKS" in msg and "benchmarks_dir" in msg and "build_benchmarks.py" in msg
    assert "\n" not in msg


# ---------------------------------------------------------------- config validation


@pytest.mark.parametrize(
    "kwargs, expected",
    [
        ({"name": "squad"}, r"unknown benchmark name 'squad'; expected one of \['gsm8k'"),
        ({"name": "nq", "turns": "last"}, r"turns='last' is not valid; expected 'first' or 'all'"),
        ({"name": "nq", "offset": -1}, r"offset=-1 is not valid; expected an integer >= 0"),
        ({"name": "nq", "num_prompts": 0}, r"num_prompts=0 is not valid; expected an integer >= 1"),
        ({"name": "nq", "num_prompts": -3}, r"num_prompts=-3 is not valid"),
        ({"name": "nq", "seed": "x"}, r"seed='x' is not valid; expected an integer or None"),
    ],
)
def test_config_validation(kwargs, expected: str) -> None:
    with pytest.raises(ValueError, match=expected) as info:
        BenchmarkConfig(**kwargs)
    assert "\n" not in str(info.value)


def test_config_defaults() -> None:
    cfg = BenchmarkConfig(name="gsm8k")
    assert (cfg.benchmarks_dir, cfg.num_prompts, cfg.offset, cfg.seed, cfg.turns) == (None, None, 0, None, "first")


# ---------------------------------------------------------------- format_prompt


@pytest.fixture()
def tiny_tokenizer():
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend)


TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def test_format_prompt_without_chat_template(tiny_tokenizer) -> None:
    assert not getattr(tiny_tokenizer, "chat_template", None)
    assert format_prompt(tiny_tokenizer, "What is 2+2?") == "User: What is 2+2?\nAssistant:"
    out = format_prompt(tiny_tokenizer, "And 3+3?", history=[("What is 2+2?", "4")], system="Be brief.")
    assert out == "System: Be brief.\nUser: What is 2+2?\nAssistant: 4\nUser: And 3+3?\nAssistant:"


def test_format_prompt_without_chat_template_keeps_the_tokenizers_bos() -> None:
    """Base models whose tokenizer adds BOS (Gemma, Llama) get it in the transcript too, since
    prompts are tokenized with add_special_tokens=False."""
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel({"[UNK]": 0, "a": 1, "<s>": 2}, unk_token="[UNK]"))
    backend.post_processor = tokenizers.processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 2)])
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>")
    assert tok("a").input_ids == [2, 1]
    text = format_prompt(tok, "What is 2+2?")
    assert text == "<s>User: What is 2+2?\nAssistant:"
    assert tok(text, add_special_tokens=False).input_ids[0] == 2


def test_format_prompt_with_chat_template(tiny_tokenizer) -> None:
    tiny_tokenizer.chat_template = TEMPLATE
    assert format_prompt(tiny_tokenizer, "hi") == "<|user|>hi<|end|>\n<|assistant|>"
    out = format_prompt(tiny_tokenizer, "and 3+3?", history=[("2+2?", "4"), ("5+5?", "10")], system="sys")
    assert out == (
        "<|system|>sys<|end|>\n"
        "<|user|>2+2?<|end|>\n<|assistant|>4<|end|>\n"
        "<|user|>5+5?<|end|>\n<|assistant|>10<|end|>\n"
        "<|user|>and 3+3?<|end|>\n<|assistant|>"
    )


@pytest.mark.parametrize("turn", ["", "   \n\t"])
def test_format_prompt_empty(tiny_tokenizer, turn: str) -> None:
    with pytest.raises(ValueError, match=r"^empty prompt: "):
        format_prompt(tiny_tokenizer, turn)
    tiny_tokenizer.chat_template = TEMPLATE
    with pytest.raises(ValueError, match=r"^empty prompt: "):
        format_prompt(tiny_tokenizer, turn, history=[("q", "a")])


def test_format_prompt_bad_history(tiny_tokenizer) -> None:
    with pytest.raises(ValueError, match=r"history\[0\]=.* expected a \(user, assistant\) pair"):
        format_prompt(tiny_tokenizer, "q", history=[("only one",)])


def test_make_benchmarks_builds_only_what_is_missing_or_says_in_one_line_what_to_do(tmp_path):
    """`make all` runs `make benchmarks` first: nothing to do where the six question files are; where they are
    missing and no hub is reachable, one line naming the folder and what to do, exit status 2."""
    import os
    import shutil
    import subprocess

    from .conftest import REPO_ROOT

    shared = Path(os.environ["TREEGRAFT_BENCHMARKS"])
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(["make", "-s", "benchmarks", f"TREEGRAFT_BENCHMARKS={shared}"], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout == "" and done.stderr == ""
    partial = tmp_path / "bench"
    shutil.copytree(shared / "gsm8k", partial / "gsm8k")
    missing = subprocess.run(["make", "-s", "benchmarks", f"TREEGRAFT_BENCHMARKS={partial}"], cwd=REPO_ROOT, env=env,
                             capture_output=True, text=True, timeout=300)
    assert missing.returncode == 2
    assert "benchmarks missing in" in missing.stdout and "alpaca nq humaneval cnndm mt_bench" in missing.stdout
    errors = [line for line in missing.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: no question files for alpaca nq humaneval cnndm mt_bench in {partial} and no hub to build "
                      "them from: set TREEGRAFT_BENCHMARKS to a folder of <name>/question.jsonl, or run make benchmarks "
                      "where a network is available"]
