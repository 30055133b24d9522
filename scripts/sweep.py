"""Every stage of an experiment as Hydra multiruns, sharded where the work is (collect, evaluate).

Run:
    python scripts/sweep.py experiment=paper launcher=slurm shards=4      # the paper's sweep on a SLURM cluster
    python scripts/sweep.py experiment=smoke_sweep launcher=local         # the same on a laptop (CI runs it)
    python scripts/sweep.py experiment=paper launcher=slurm dry_run=true  # print the multiruns and each pair's GPUs

Stages run in order (collect -> fit -> distill -> evaluate -> report); each job writes atomically under
outputs/pipeline/<experiment>/, and the same command after an interruption redoes only what is missing.
"""

from __future__ import annotations

import sys

import hydra
import pandas as pd
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from treegraft.config import CONF_DIR, check_config_choices
from treegraft.pipeline.common import input_errors, print_table
from treegraft.pipeline.sweep import run_sweep


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="sweep")
def main(cfg: DictConfig) -> None:
    overrides = list(HydraConfig.get().overrides.task)
    try:
        rows = run_sweep(cfg, overrides, log=lambda line: print(line, flush=True))
    except (*input_errors(), RuntimeError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    print_table(pd.DataFrame(rows), f"sweep ({cfg.pipeline.name}, launcher={cfg.launcher}, shards={cfg.shards})")


if __name__ == "__main__":
    check_config_choices()
    main()
