"""Benchmark prompt loading (see `treegraft.data.benchmarks`)."""

from treegraft.data.benchmarks import (
    BENCHMARKS,
    BenchmarkConfig,
    BenchmarkFormatError,
    format_prompt,
    load_benchmark,
    read_question_file,
    spec_bench_category,
)

__all__ = [
    "BENCHMARKS",
    "BenchmarkConfig",
    "BenchmarkFormatError",
    "format_prompt",
    "load_benchmark",
    "read_question_file",
    "spec_bench_category",
]
