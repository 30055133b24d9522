"""Benchmark prompts: FastChat question files -> `datasets.Dataset`, and chat-template formatting.

Each benchmark lives in `<benchmarks_dir>/<name>/question.jsonl`, one JSON object per line:
`{"question_id": int, "category": str, "turns": [str, ...], "reference": [str, ...]?}`.
`benchmarks_dir` defaults to `treegraft.paths.default_benchmarks_dir()` ($TREEGRAFT_BENCHMARKS,
else <repo>/data/benchmarks); `scripts/build_benchmarks.py` builds the files from the public
Hugging Face datasets.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets

from treegraft.paths import default_benchmarks_dir

BENCHMARKS: tuple[str, ...] = ("gsm8k", "alpaca", "nq", "humaneval", "cnndm", "mt_bench")
TURNS_MODES: tuple[str, ...] = ("first", "all")
QUESTION_FILE = "question.jsonl"

FEATURES = datasets.Features(
    {
        "question_id": datasets.Value("int64"),
        "category": datasets.Value("string"),
        "turns": datasets.List(datasets.Value("string")),
        "reference": datasets.List(datasets.Value("string")),
        "benchmark": datasets.Value("string"),
    }
)


class BenchmarkFormatError(ValueError):
    """A line of a benchmark question file is not a valid FastChat question record."""


@dataclass
class BenchmarkConfig:
    """Which prompts of one benchmark to load (Hydra config group `data`).

    name: one of `BENCHMARKS`.
    benchmarks_dir: folder holding `<name>/question.jsonl`; None = `default_benchmarks_dir()`.
    num_prompts: how many prompts to keep after `offset`; None = all the rest.
    offset: how many prompts to skip first.
    seed: None = file order; an int = shuffle deterministically with that seed before offset/num_prompts.
    turns: "first" keeps only the first user turn in the `turns` column, "all" keeps every turn.
    """

    name: str
    benchmarks_dir: str | None = None
    num_prompts: int | None = None
    offset: int = 0
    seed: int | None = None
    turns: str = "first"

    def __post_init__(self) -> None:
        if self.name not in BENCHMARKS:
            raise ValueError(f"unknown benchmark name {self.name!r}; expected one of {list(BENCHMARKS)}")
        if self.turns not in TURNS_MODES:
            raise ValueError(f"turns={self.turns!r} is not valid; expected 'first' or 'all'")
        if not _is_int(self.offset) or self.offset < 0:
            raise ValueError(f"offset={self.offset!r} is not valid; expected an integer >= 0")
        if self.num_prompts is not None and (not _is_int(self.num_prompts) or self.num_prompts < 1):
            raise ValueError(f"num_prompts={self.num_prompts!r} is not valid; expected an integer >= 1 or None (all)")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed={self.seed!r} is not valid; expected an integer or None (file order)")
        if self.benchmarks_dir is not None and not isinstance(self.benchmarks_dir, (str, os.PathLike)):
            raise ValueError(f"benchmarks_dir={self.benchmarks_dir!r} is not valid; expected a path or None")

    @property
    def question_file(self) -> Path:
        """The question file this config reads."""
        root = Path(self.benchmarks_dir) if self.benchmarks_dir is not None else default_benchmarks_dir()
        return root / self.name / QUESTION_FILE


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_str_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _parse_record(obj: Any, where: str) -> dict[str, Any]:
    """Check one decoded line and return it with `reference` filled in; `where` is "path:line"."""
    if not isinstance(obj, dict):
        raise BenchmarkFormatError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    for key in ("question_id", "category", "turns"):
        if key not in obj:
            raise BenchmarkFormatError(f"{where}: missing field {key!r}")
    qid, category, turns = obj["question_id"], obj["category"], obj["turns"]
    if not _is_int(qid):
        raise BenchmarkFormatError(f"{where}: question_id must be an int, got {_short(qid)}")
    if not isinstance(category, str):
        raise BenchmarkFormatError(f"{where}: category must be a string, got {_short(category)}")
    if not _is_str_list(turns) or not turns:
        raise BenchmarkFormatError(f"{where}: turns must be a non-empty list of strings, got {_short(turns)}")
    reference = obj.get("reference", [])
    if reference is None:
        reference = []
    if not _is_str_list(reference):
        raise BenchmarkFormatError(f"{where}: reference must be a list of strings, got {_short(reference)}")
    return {"question_id": qid, "category": category, "turns": list(turns), "reference": list(reference)}


def read_question_file(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Read and validate a FastChat question file; blank lines are skipped.

    Raises FileNotFoundError if it is missing and BenchmarkFormatError (naming the file and the
    1-based line number) on the first malformed line or a repeated question_id.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"benchmark question file not found: {path}; set benchmarks_dir or TREEGRAFT_BENCHMARKS "
            f"to the folder holding <name>/{QUESTION_FILE} (or run scripts/build_benchmarks.py)"
        )
    records: list[dict[str, Any]] = []
    seen: dict[int, int] = {}
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise BenchmarkFormatError(f"{where}: bad JSON ({e.msg} at column {e.colno})") from None
            rec = _parse_record(obj, where)
            if rec["question_id"] in seen:
                raise BenchmarkFormatError(
                    f"{where}: duplicate question_id {rec['question_id']} (first on line {seen[rec['question_id']]})"
                )
            seen[rec["question_id"]] = lineno
            records.append(rec)
    return records


def load_benchmark(cfg: BenchmarkConfig) -> datasets.Dataset:
    """Load the prompts selected by `cfg` as a Dataset.

    Columns: question_id (int), category (str), turns (list[str]), reference (list[str], empty when
    the file has none), benchmark (str, = cfg.name). Order: file order, or a deterministic shuffle
    with `cfg.seed`; then `cfg.offset` prompts are skipped and `cfg.num_prompts` kept (asking for
    more than remain is a ValueError).
    """
    path = cfg.question_file
    records = read_question_file(path)
    if cfg.seed is not None:
        random.Random(cfg.seed).shuffle(records)
    available = len(records) - cfg.offset
    if available < 0:
        raise ValueError(f"offset={cfg.offset} is past the end of {path}, which has {len(records)} prompts")
    if cfg.num_prompts is not None:
        if cfg.num_prompts > available:
            raise ValueError(
                f"num_prompts={cfg.num_prompts} requested but only {available} prompts remain in {path} "
                f"({len(records)} in total, offset={cfg.offset})"
            )
        selected = records[cfg.offset : cfg.offset + cfg.num_prompts]
    else:
        selected = records[cfg.offset :]
    for rec in selected:
        if cfg.turns == "first":
            rec["turns"] = rec["turns"][:1]
        rec["benchmark"] = cfg.name
    return datasets.Dataset.from_list(selected, features=FEATURES)


def format_prompt(
    tokenizer: Any,
    user_turn: str,
    history: list[tuple[str, str]] | None = None,
    system: str | None = None,
) -> str:
    """Build the text prompt for `user_turn`, after earlier (user, assistant) pairs in `history`.

    With a chat template (`tokenizer.chat_template` set) this is
    `tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)` on
    [system?] + history + the new user message.

    Without one (base models) we fall back to a plain transcript rather than failing, so that base
    models can be benchmarked too: an optional "System: {system}" line, then one
    "User: {u}\\nAssistant: {a}\\n" block per history pair, ending with "User: {user_turn}\\nAssistant:"
    (no trailing space or newline; the model continues after "Assistant:"), preceded by the BOS token
    when the tokenizer adds one to plain text by default.

    Raises ValueError("empty prompt: ...") if `user_turn` is empty or whitespace only.
    """
    if not isinstance(user_turn, str) or not user_turn.strip():
        raise ValueError(f"empty prompt: user_turn must be a non-empty string, got {_short(user_turn)}")
    pairs = list(history or [])
    for i, pair in enumerate(pairs):
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2 and all(isinstance(p, str) for p in pair)):
            raise ValueError(f"history[{i}]={_short(pair)} is not valid; expected a (user, assistant) pair of strings")

    if getattr(tokenizer, "chat_template", None):
        messages: list[dict[str, str]] = []
        if system:
            messages.append({"role": "system", "content": system})
        for user, assistant in pairs:
            messages.append({"role": "user", "content": user})
            messages.append({"role": "assistant", "content": assistant})
        messages.append({"role": "user", "content": user_turn})
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    parts = [f"System: {system}\n"] if system else []
    parts += [f"User: {user}\nAssistant: {assistant}\n" for user, assistant in pairs]
    parts.append(f"User: {user_turn}\nAssistant:")
    return _leading_bos(tokenizer) + "".join(parts)


def _leading_bos(tokenizer: Any) -> str:
    """The BOS text a tokenizer puts before plain text by default (Gemma, Llama base models), else "".

    Prompts are tokenized with ``add_special_tokens=False`` (chat templates write their own BOS), so
    the plain transcript must carry it: Gemma 3 270M without BOS answers "Assistant: Assistant: ..."""
    bos = getattr(tokenizer, "bos_token", None)
    if not bos:
        return ""
    ids = tokenizer("a").input_ids
    return bos if ids and ids[0] == tokenizer.bos_token_id else ""


# Spec-Bench's task names (its evaluation/speed.py filters records by `category`): MT-Bench keeps its
# own categories (writing, roleplay, ...); the others map to the task Spec-Bench files them under, or,
# with no such task, to the benchmark's own name (counted in Spec-Bench's "overall").
SPEC_BENCH_CATEGORY = {"gsm8k": "math_reasoning", "cnndm": "summarization", "nq": "qa", "alpaca": "alpaca",
                       "humaneval": "humaneval"}


def spec_bench_category(benchmark: str, question_category: str) -> str:
    """The ``category`` of an answer record: see :data:`SPEC_BENCH_CATEGORY`."""
    if benchmark in SPEC_BENCH_CATEGORY:
        return SPEC_BENCH_CATEGORY[benchmark]
    return question_category or benchmark
