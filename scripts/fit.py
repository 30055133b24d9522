"""Stage `fit`: grouped out-of-fold tree-signal selection and the four value heads (SPEC 5.3).

Run:
    make fit EXPERIMENT=smoke
    python scripts/fit.py experiment=cpu scheduler.search=greedy

Reads outputs/pipeline/<experiment>/collect/; writes outputs/pipeline/<experiment>/fit/
(value_heads.pt + value_heads.meta.json, oof_table.csv, oof_summary.md, selection.json).
"""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from treegraft.config import CONF_DIR
from treegraft.pipeline.artifacts import MissingArtifactError
from treegraft.pipeline.fit import run_fit


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="fit")
def main(cfg: DictConfig) -> None:
    try:
        run_fit(cfg)
    except (MissingArtifactError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
