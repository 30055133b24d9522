"""Build the project's C++ kernels ahead of time (what `make setup` runs), loudly.

Run:
    .venv/bin/python scripts/build_kernels.py

Each kernel of treegraft.models.runtime.kernels.KERNELS is compiled into PyTorch's extension cache
when this CPU can run it (skipped, with the reason, when it cannot). A kernel the CPU supports that
does not build is an error: one line on stderr and exit status 1, so `make setup`, `make test` and CI
stop there instead of running slower fallbacks, or skipping the kernels' tests, without a word.
"""

from __future__ import annotations

import sys
import time

from treegraft.machine import cpu_line
from treegraft.models.runtime.kernels import KERNELS, KernelBuildError, _cpu_flags, build_kernel


def main() -> int:
    print(f"kernels for {cpu_line()}")
    for kernel in KERNELS:
        if not kernel.supported():
            missing = sorted(set(kernel.cpu_flags) - _cpu_flags())
            print(f"  {kernel.source}: skipped, this CPU lacks {', '.join(missing) or 'x86-64'} ({kernel.without})")
            continue
        start = time.perf_counter()
        try:
            build_kernel(kernel, strict=True)
        except KernelBuildError as err:
            print(f"error: {err}", file=sys.stderr)
            return 1
        print(f"  {kernel.source}: built ({time.perf_counter() - start:.1f} s, cached after the first build)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
