"""Helpers shared by the stages: pair configs by name, prompts, summary tables."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from rich.console import Console
from rich.table import Table

from ..config import CONF_DIR
from ..data import BenchmarkConfig, format_prompt, load_benchmark
from ..models import PairSpec
from ..stats import Interval

__all__ = ["pair_spec", "stage_prompts", "print_table", "fit_pairs", "run_stage_cli", "to_markdown", "fold_intervals"]


def pair_spec(name: str) -> PairSpec:
    """The :class:`PairSpec` of ``conf/pair/<name>.yaml``."""
    path = Path(CONF_DIR) / "pair" / f"{name}.yaml"
    if not path.exists():
        known = sorted(p.stem for p in path.parent.glob("*.yaml"))
        raise ValueError(f"unknown pair {name!r}; expected one of {known}")
    return instantiate(OmegaConf.load(path))


def fit_pairs(cfg: DictConfig) -> list[str]:
    """The pairs the value system is fitted on: all collected pairs minus the held-out ones."""
    held = set(cfg.pipeline.held_out_pairs or [])
    pairs = [p for p in cfg.pipeline.pairs if p not in held]
    if not pairs:
        raise ValueError(f"every pair of pipeline.pairs={list(cfg.pipeline.pairs)} is held out: nothing to fit on")
    return pairs


def stage_records(cfg: DictConfig, benchmark: str, num_prompts: int, offset: int):
    """The benchmark records a stage uses (their question ids need no tokenizer)."""
    return load_benchmark(BenchmarkConfig(name=benchmark, benchmarks_dir=cfg.paths.benchmarks_dir,
                                          num_prompts=num_prompts, offset=offset))


def stage_prompts(cfg: DictConfig, tokenizer, benchmark: str, num_prompts: int, offset: int) -> list[tuple[int, list[int]]]:
    """(question_id, prompt token ids) of one benchmark, chat-formatted, cut to ``max_prompt_tokens``."""
    out = []
    for rec in stage_records(cfg, benchmark, num_prompts, offset):
        ids = tokenizer(format_prompt(tokenizer, rec["turns"][0]), add_special_tokens=False).input_ids
        if cfg.pipeline.max_prompt_tokens:
            ids = ids[-int(cfg.pipeline.max_prompt_tokens):]
        out.append((int(rec["question_id"]), ids))
    return out


def print_table(df: pd.DataFrame, title: str, console: Console | None = None, floats: str = "{:.3f}") -> None:
    console = console or Console(width=200)
    table = Table(title=title)
    for c in df.columns:
        table.add_column(str(c))
    for _, r in df.iterrows():
        table.add_row(*[floats.format(v) if isinstance(v, float) else str(v) for v in r.tolist()])
    console.print(table)


def to_markdown(df: pd.DataFrame, floats: str = "{:.3f}") -> str:
    """A GitHub-flavoured Markdown table (no extra dependency)."""
    cols = [str(c) for c in df.columns]
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    for _, r in df.iterrows():
        lines.append("| " + " | ".join(floats.format(v) if isinstance(v, float) else str(v) for v in r.tolist()) + " |")
    return "\n".join(lines) + "\n"


def fold_intervals(df: pd.DataFrame, floats: str = "{:.2f}") -> pd.DataFrame:
    """For display: every ``X`` with ``X lo`` / ``X hi`` (or ``X_lo`` / ``X_hi``) columns becomes one text
    column ``X [lo, hi]``; other floats are formatted with ``floats``."""
    out = {}
    cols = list(df.columns)
    for c in cols:
        if any(c == f"{b}{sep}{end}" for b in cols for sep in (" ", "_") for end in ("lo", "hi")):
            continue
        lo = next((f"{c}{sep}lo" for sep in (" ", "_") if f"{c}{sep}lo" in df), None)
        hi = next((f"{c}{sep}hi" for sep in (" ", "_") if f"{c}{sep}hi" in df), None)
        if lo and hi:
            out[c] = [Interval(v, a, b, 0).format(floats) for v, a, b in zip(df[c], df[lo], df[hi])]
        else:
            out[c] = [floats.format(v) if isinstance(v, float) and v == v else ("--" if isinstance(v, float) else v)
                      for v in df[c]]
    return pd.DataFrame(out, index=df.index)


def input_errors() -> tuple[type[BaseException], ...]:
    """The errors a bad input raises (missing model or artifact, tokenizer mismatch, unavailable runtime,
    a llama.cpp load failure, a bad value): the entry points report them as one line, exit status 2."""
    from ..engines.llama_cpp import LlamaCppError
    from ..models import ModelLoadError, TokenizerMismatchError
    from ..models.runtime import RuntimeUnavailable

    return (ModelLoadError, TokenizerMismatchError, RuntimeUnavailable, LlamaCppError, ValueError, FileNotFoundError)


def run_stage_cli(run, cfg: DictConfig) -> None:
    """What every stage entry point does: run the stage; a bad input (:func:`input_errors`) is one line
    on stderr and exit status 2."""
    import sys

    try:
        run(cfg)
    except input_errors() as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
