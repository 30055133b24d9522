"""Sharded stages: `collect` and `evaluate` split into independent jobs, and what the merging stages say.

A job of a sharded stage is one pair (``pair=<name>``), one benchmark (``data=<name>``) and one prompt
range of it (``shard.index=i shard.count=n``: the i-th of n contiguous parts of the benchmark's
prompts). A Hydra multirun over those three sends the jobs to SLURM through submitit
(``hydra/launcher=slurm``), to local subprocesses (``hydra/launcher=local``) or runs them one after the
other (Hydra's basic launcher); :mod:`treegraft.pipeline.sweep` writes those multiruns for a whole
experiment. Every job writes its own files atomically under the experiment's folder (collect: one Parquet
file per prompt; evaluate: one record file per method and prompt range) and skips what is already there,
so a killed job is rerun by the same command and redoes at most the prompt it was on.

The merging stages (`fit`, `distill`, `report`) read whatever the jobs wrote and say what is missing
(:class:`Coverage`): the prompts the experiment asks for that no job has written yet, per pair x
benchmark (x method), with the command that fills them in.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

__all__ = ["Shard", "shard_from", "Coverage"]


@dataclass(frozen=True)
class Shard:
    """The ``index``-th of ``count`` contiguous parts of a benchmark's prompts (``count`` = 1: all of them)."""

    index: int = 0
    count: int = 1

    def __post_init__(self) -> None:
        if int(self.count) < 1 or not 0 <= int(self.index) < int(self.count):
            raise ValueError(f"bad shard index={self.index} count={self.count}; expected count >= 1 and "
                             "0 <= index < count (shard.index=0..count-1)")

    @property
    def whole(self) -> bool:
        return self.count == 1

    def take(self, items: Sequence) -> list:
        """This shard's part of ``items``: parts differ in length by at most one, in order, and the parts of
        every index together are ``items`` once each."""
        n = len(items)
        return list(items[self.index * n // self.count:(self.index + 1) * n // self.count])

    @property
    def suffix(self) -> str:
        """What a sharded job adds to the name of a file it alone writes (nothing for the whole range)."""
        return "" if self.whole else f".shard{self.index}of{self.count}"

    def __str__(self) -> str:
        return "all prompts" if self.whole else f"prompt range {self.index + 1} of {self.count}"


def shard_from(cfg) -> Shard:
    """The :class:`Shard` of a composed stage config (its ``shard`` node; absent = the whole range)."""
    node = cfg.get("shard") or {}
    return Shard(int(node.get("index", 0)), int(node.get("count", 1)))


@dataclass
class Coverage:
    """Which prompts of a stage's work are on disk. ``expected`` and ``present`` map a unit key (``(pair,
    benchmark)`` for collect, ``(pair, benchmark, method)`` for evaluate) to question ids; ``rerun`` maps a
    unit key to the command that fills it in."""

    stage: str
    expected: dict[tuple, list[int]]
    present: dict[tuple, list[int]]
    rerun: dict[tuple, str] = field(default_factory=dict)

    @property
    def missing(self) -> dict[tuple, list[int]]:
        out = {}
        for key, ids in self.expected.items():
            have = set(self.present.get(key, ()))
            lost = [q for q in ids if q not in have]
            if lost:
                out[key] = lost
        return out

    @property
    def n_expected(self) -> int:
        return sum(len(v) for v in self.expected.values())

    @property
    def n_present(self) -> int:
        return sum(len(set(v) & set(self.present.get(k, ()))) for k, v in self.expected.items())

    @property
    def complete(self) -> bool:
        return not self.missing

    @property
    def head(self) -> str:
        """How much is present, in a few words (the progress of a running sweep)."""
        return f"{self.stage}: {self.n_present} of {self.n_expected} prompts present ({len(self.expected)} units)"

    @property
    def status(self) -> str:
        """:attr:`head`, and ", nothing missing" once complete."""
        return self.head + (", nothing missing" if self.complete else "")

    def line(self, limit: int = 6) -> str:
        """One line: how much is present and, when something is missing, the first ``limit`` units that lack
        prompts, with the command that fills each in."""
        head = self.head
        missing = self.missing
        if not missing:
            return self.status
        parts = []
        for key, ids in list(missing.items())[:limit]:
            shown = ", ".join(f"q{q}" for q in ids[:4]) + (f" and {len(ids) - 4} more" if len(ids) > 4 else "")
            fix = f" (rerun: {self.rerun[key]})" if key in self.rerun else ""
            parts.append(f"{'/'.join(map(str, key))} {shown}{fix}")
        more = f"; and {len(missing) - limit} more units" if len(missing) > limit else ""
        return f"{head}; missing {self.n_expected - self.n_present} in {len(missing)} units: " + "; ".join(parts) + more

    def to_dict(self) -> dict:
        return {"stage": self.stage, "expected_prompts": self.n_expected, "present_prompts": self.n_present,
                "complete": self.complete,
                "missing": [{"unit": "/".join(map(str, k)), "question_ids": v, "rerun": self.rerun.get(k)}
                            for k, v in self.missing.items()]}

    def write(self, path: Path) -> None:
        from ..atomic import atomic_write_json

        atomic_write_json(self.to_dict(), Path(path))

    @staticmethod
    def read(path: Path) -> dict | None:
        path = Path(path)
        return json.loads(path.read_text()) if path.exists() else None
