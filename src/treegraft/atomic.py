"""Atomic file writes (temp file in the same folder + rename): an interruption never leaves half a file.

The lowest layer of the package: stages, caches and checkpoints all write through these.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Callable

__all__ = ["atomic_write", "atomic_write_text", "atomic_write_json", "atomic_torch_save", "read_json"]


def atomic_write(path: str | os.PathLike, write: Callable[[str], None]) -> None:
    """Call ``write(tmp_path)`` and rename the result to ``path`` (parents created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp creates 0600; give the file the usual permissions
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def atomic_write_text(text: str, path: str | os.PathLike) -> None:
    atomic_write(path, lambda tmp: Path(tmp).write_text(text))


def atomic_write_json(obj, path: str | os.PathLike) -> None:
    atomic_write_text(json.dumps(obj, indent=2, default=str) + "\n", path)


def atomic_torch_save(obj, path: str | os.PathLike) -> None:
    import torch

    atomic_write(path, lambda tmp: torch.save(obj, tmp))


def read_json(path: str | os.PathLike, default=None):
    """The JSON in ``path``, or ``default`` when the file is missing or unreadable (a cache may be cold)."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return default
