"""Tables and figures from the saved artifacts alone (no model runs): `make tables`, `make figures`.

Run:
    make tables figures EXPERIMENT=smoke
    python scripts/report.py experiment=cpu figures=false

Reads outputs/pipeline/<experiment>/{evaluate,distill,fit,collect}; writes
outputs/pipeline/<experiment>/report/ (CSV + Markdown + LaTeX tables, PNG + PDF figures).
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig
from rich.console import Console

from treegraft.config import CONF_DIR, check_config_choices
from treegraft.pipeline.artifacts import MissingArtifactError, stage_dir
from treegraft.pipeline.common import fold_intervals, print_table
from treegraft.pipeline.report import headline_metrics, make_figures, make_tables
from treegraft.pipeline.tracking import stage_logger


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="report")
def main(cfg: DictConfig) -> None:
    console = Console(width=200)
    exp_dir = stage_dir(cfg.paths.output_dir, cfg.pipeline.name, "report").parent
    log = stage_logger(cfg, "report")
    try:
        if cfg.tables:
            tables = make_tables(exp_dir, list(cfg.pipeline.held_out_pairs or []), list(cfg.pipeline.held_out_benchmarks),
                                 n_resamples=int(cfg.pipeline.bootstrap_resamples))
            for name in ("main", "gain", "ablation", "scheduling", "held_out", "offline_scheduler", "offline_contrasts"):
                if name in tables and not tables[name].empty:
                    print_table(fold_intervals(tables[name]), f"{name} (95% CIs over prompts)", console)
                    log.log_table(name, tables[name])
            log.log_metrics(headline_metrics(tables))
        if cfg.figures:
            for path in make_figures(exp_dir):
                if path.suffix == ".png":
                    console.print(f"figure: {path}")
                    log.log_figure(path.stem, path)
    except (MissingArtifactError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    log.finish()
    console.print(f"written under {Path(exp_dir) / 'report'}")


if __name__ == "__main__":
    check_config_choices()
    main()
