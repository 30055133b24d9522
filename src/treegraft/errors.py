"""Errors that cross layers (raised low, reported as one line by the entry points)."""

from __future__ import annotations

__all__ = ["MissingArtifactError"]


class MissingArtifactError(FileNotFoundError):
    """An input artifact of a stage does not exist; the message names the stage that writes it."""
