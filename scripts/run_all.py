"""The whole scheduler pipeline with one progress bar and an ETA (what `make all` runs after `make models`).

Run:
    python scripts/run_all.py experiment=auto         # make all: cpu or cpu_llama, the faster engine here
    python scripts/run_all.py experiment=cpu          # the embedded pair on PyTorch (make all ALL_EXPERIMENT=cpu)
    python scripts/run_all.py experiment=cpu_llama    # ... on llama.cpp, exact kernels
    python scripts/run_all.py experiment=smoke        # the tiny pair, minutes

collect -> fit -> distill -> evaluate -> tables and figures, each the same library call as its own
entry point (so an interrupted run resumes), every stage composed from its own primary config with the
same overrides. Prints the wall time of every stage and where the tables and figures are.
"""

from __future__ import annotations

import sys
from pathlib import Path

from hydra import compose, initialize_config_dir

from treegraft.config import CONF_DIR, check_config_choices
from treegraft.pipeline.common import input_errors
from treegraft.pipeline.run_all import run_all


def main(overrides: list[str]) -> int:
    if "experiment=auto" in overrides:  # the experiment of the engine whose step is faster on this machine
        from treegraft.atomic import atomic_write_json
        from treegraft.pipeline.run_all import auto_experiment

        base = [o for o in overrides if o != "experiment=auto"]
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose(config_name="collect", overrides=base + ["experiment=cpu"])
        experiment, choice = auto_experiment(cfg, log=lambda line: print(line, file=sys.stderr))
        print(f"make all: experiment={experiment} (engine {choice['engine']}: {choice['reason']})", file=sys.stderr)
        overrides = base + [f"experiment={experiment}"]
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            out = compose(config_name="collect", overrides=overrides)
        atomic_write_json(choice, Path(out.paths.output_dir) / "pipeline" / out.pipeline.name / "engine_choice.json")
    check_config_choices(overrides)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfgs = {stage: compose(config_name=stage, overrides=overrides) for stage in ("collect", "fit", "distill", "evaluate")}
    try:
        run_all(cfgs)
    except input_errors() as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
