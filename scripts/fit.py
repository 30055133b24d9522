"""Stage `fit`: grouped out-of-fold tree-signal selection and the four value heads.

Run:
    make fit EXPERIMENT=smoke
    python scripts/fit.py experiment=cpu scheduler.search=greedy

Reads outputs/pipeline/<experiment>/collect/; writes outputs/pipeline/<experiment>/fit/
(value_heads.pt + value_heads.meta.json, oof_table.csv, oof_summary.md, selection.json).
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from treegraft.config import CONF_DIR, check_config_choices
from treegraft.pipeline.common import run_stage_cli
from treegraft.pipeline.fit import run_fit


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="fit")
def main(cfg: DictConfig) -> None:
    run_stage_cli(run_fit, cfg)


if __name__ == "__main__":
    check_config_choices()
    main()
