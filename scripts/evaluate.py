"""Stage `evaluate`: every method on every pair x benchmark, Spec-Bench style records.

Run:
    make evaluate EXPERIMENT=smoke
    python scripts/evaluate.py experiment=cpu
    python scripts/evaluate.py experiment=cpu "evaluation.methods=[ar,all_small,treegraft]"

Needs `make collect fit distill` for the learned methods (treegraft, direct_planner). Writes
outputs/pipeline/<experiment>/evaluate/<pair>/<benchmark>/<method>.jsonl and summary.parquet.
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from treegraft.config import CONF_DIR, check_config_choices
from treegraft.pipeline.common import run_stage_cli
from treegraft.pipeline.evaluate import run_evaluate


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="evaluate")
def main(cfg: DictConfig) -> None:
    run_stage_cli(run_evaluate, cfg)


if __name__ == "__main__":
    check_config_choices()
    main()
