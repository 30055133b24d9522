"""Tables and figures from the saved artifacts alone (no model runs): `make tables`, `make figures`.

Run:
    make tables figures EXPERIMENT=smoke
    python scripts/report.py experiment=cpu figures=false

Reads outputs/pipeline/<experiment>/{evaluate,distill,fit,collect}; writes
outputs/pipeline/<experiment>/report/ (CSV + Markdown + LaTeX tables, PNG + PDF figures, README.md: the
index of what was written and of the studies this experiment did not run).
"""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig
from rich.console import Console

from treegraft.config import CONF_DIR, check_config_choices
from treegraft.pipeline.artifacts import MissingArtifactError, stage_dir
from treegraft.pipeline.report import run_report


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="report")
def main(cfg: DictConfig) -> None:
    console = Console(width=200)
    try:
        run_report(cfg, console)
    except (MissingArtifactError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    report = stage_dir(cfg.paths.output_dir, cfg.pipeline.name, "report")
    console.print(f"written under {report} (index: {report / 'README.md'})")


if __name__ == "__main__":
    check_config_choices()
    main()
