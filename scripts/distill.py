"""Stage `distill`: margin teacher, distilled margin predictor and offline evaluation.

Run:
    make distill EXPERIMENT=smoke
    python scripts/distill.py experiment=cpu

Reads collect/ and fit/; writes outputs/pipeline/<experiment>/distill/ (scheduler.pt +
scheduler.meta.json, offline_eval.md, distill.json).
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from treegraft.config import CONF_DIR, check_config_choices
from treegraft.pipeline.common import run_stage_cli
from treegraft.pipeline.distill import run_distill


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="distill")
def main(cfg: DictConfig) -> None:
    run_stage_cli(run_distill, cfg)


if __name__ == "__main__":
    check_config_choices()
    main()
