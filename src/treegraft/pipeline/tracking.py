"""Optional experiment tracking for the stages (`logger=wandb`; default `logger=none`).

``stage_logger(cfg, stage)`` returns a logger with ``log_metrics``, ``log_table``, ``log_figure``
and ``finish``; with ``logger=none`` every call is a no-op. W&B runs are grouped by experiment and
stage (``group=<experiment>/<stage>``, ``job_type=<stage>``), carry the resolved config, and run in
offline mode when there is no login, so nothing is lost on a machine without network.
"""

from __future__ import annotations

import os
from pathlib import Path

import pandas as pd
from omegaconf import DictConfig, OmegaConf

__all__ = ["stage_logger", "NullLogger", "WandbLogger"]


class NullLogger:
    def log_metrics(self, metrics: dict) -> None: ...

    def log_table(self, name: str, df: pd.DataFrame) -> None: ...

    def log_figure(self, name: str, path: Path) -> None: ...

    def finish(self) -> None: ...


class WandbLogger(NullLogger):
    def __init__(self, cfg: DictConfig, stage: str):
        import wandb

        lg = cfg.logger
        mode = lg.get("mode", "auto")
        if mode == "auto":
            mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"
        directory = Path(lg.get("dir") or cfg.paths.output_dir)
        directory.mkdir(parents=True, exist_ok=True)
        experiment = cfg.pipeline.name if "pipeline" in cfg else "default"
        self.wandb = wandb
        self.run = wandb.init(
            project=lg.get("project", "treegraft"), entity=lg.get("entity"), mode=mode, dir=str(directory),
            group=f"{experiment}/{stage}", job_type=stage, name=f"{experiment}-{stage}",
            tags=list(lg.get("tags") or []), config=OmegaConf.to_container(cfg, resolve=True), reinit="finish_previous",
        )

    def log_metrics(self, metrics: dict) -> None:
        self.run.log({k: v for k, v in metrics.items() if isinstance(v, (int, float))})

    def log_table(self, name: str, df: pd.DataFrame) -> None:
        self.run.log({name: self.wandb.Table(dataframe=df.reset_index(drop=True))})

    def log_figure(self, name: str, path: Path) -> None:
        self.run.log({name: self.wandb.Image(str(path))})

    def finish(self) -> None:
        self.run.finish()


def stage_logger(cfg: DictConfig, stage: str):
    name = cfg.logger.name if "logger" in cfg else "none"
    if name == "none":
        return NullLogger()
    if name == "wandb":
        return WandbLogger(cfg, stage)
    raise ValueError(f"unknown logger {name!r}; expected none or wandb")
