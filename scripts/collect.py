"""Stage `collect`: enumerate all 2^D drafting schedules at sampled turns of real prompts.

Run:
    make collect EXPERIMENT=smoke                      # tiny random pair, a minute
    python scripts/collect.py experiment=cpu
    python scripts/collect.py pipeline.pairs=[smollm2-135m__self] pipeline.prompts_per_benchmark=1

Writes outputs/pipeline/<experiment>/collect/<pair>/<benchmark>/q<id>.parquet (one shard per prompt,
atomic; an interrupted run resumes), <pair>/runtime.json, <pair>/cost_model.json, summary.md.
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from treegraft.config import CONF_DIR, check_config_choices
from treegraft.pipeline.common import run_stage_cli
from treegraft.pipeline.collect import run_collect


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="collect")
def main(cfg: DictConfig) -> None:
    run_stage_cli(run_collect, cfg)


if __name__ == "__main__":
    check_config_choices()
    main()
