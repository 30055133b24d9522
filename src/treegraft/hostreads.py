"""Counting host reads: every place the host waits for a tensor's value.

On a GPU each ``.item()``, ``.tolist()``, ``.cpu()``, ``.numpy()`` or Python scalar conversion of a tensor
(``float(t)``, ``int(t)``, ``bool(t)``, ``t`` as a list index) waits until the device has computed it:
a host-device synchronization of ~10-20 us plus the pipeline bubble it leaves. A CPU cannot show the
waits, but it can count where they would happen: :func:`count_host_reads` patches those methods for the
duration of a ``with`` block and counts every call on any tensor (CPU ones included, so the count is the
same on either device: the decoder keeps its host-side bookkeeping in Python lists and numbers, and
reads a tensor only where a value must cross to the host).

    with count_host_reads() as reads:
        decoder.generate(prompt, 64)
    reads.total, reads.by_site.most_common(5)
"""

from __future__ import annotations

import contextlib
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch

__all__ = ["HostReads", "count_host_reads", "READ_METHODS"]

READ_METHODS = ("item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__", "__index__", "__complex__")
_SRC = str(Path(__file__).resolve().parent)


@dataclass
class HostReads:
    """What :func:`count_host_reads` saw: the total, by method, and by the first treegraft frame that
    asked (``module.py:line``; ``<outside>`` when no treegraft code is on the stack)."""

    total: int = 0
    by_method: Counter = field(default_factory=Counter)
    by_site: Counter = field(default_factory=Counter)
    paused: int = 0

    def _site(self) -> str:
        frame = sys._getframe(2)
        while frame is not None:
            name = frame.f_code.co_filename
            if name.startswith(_SRC) and not name.endswith("hostreads.py"):
                return f"{Path(name).relative_to(_SRC)}:{frame.f_lineno}"
            frame = frame.f_back
        return "<outside>"

    @contextlib.contextmanager
    def pause(self) -> Iterator[None]:
        """Reads inside this block are not counted (a caller's own bookkeeping, e.g. a test's checks)."""
        self.paused += 1
        try:
            yield
        finally:
            self.paused -= 1


@contextlib.contextmanager
def count_host_reads() -> Iterator[HostReads]:
    """Count every host read of a tensor (:data:`READ_METHODS`) made inside the block, in this thread
    and process. Not reentrant."""
    reads = HostReads()
    originals = {name: getattr(torch.Tensor, name) for name in READ_METHODS}

    def wrap(name, original):
        def counted(self, *args, **kwargs):
            if not reads.paused:
                reads.total += 1
                reads.by_method[name] += 1
                reads.by_site[reads._site()] += 1
            reads.paused += 1  # a read implemented through another (tolist -> item) counts once
            try:
                return original(self, *args, **kwargs)
            finally:
                reads.paused -= 1

        counted.__name__ = name
        return counted

    for name, original in originals.items():
        setattr(torch.Tensor, name, wrap(name, original))
    try:
        yield reads
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
