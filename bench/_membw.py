"""How the machine's memory copy bandwidth scales with processes: the ceiling for a conversion.

A merge is a few passes over memory per byte (the CRC over the mapped source, the cast's read
and write, the kernel's copy of the output into the page cache, the verify's re-read), so where
one core already moves what the memory system gives to several, more tasks cannot scale past
what more copiers get. `copy_scaling(n)` runs 1 and then `n` processes, each copying a 256 MiB
buffer (numpy `copyto`) 20 times after a barrier, and returns the total GB/s of each.

    .venv/bin/python bench/_membw.py 2      # also run by bench/scaling.py, per its largest N
"""

from __future__ import annotations

import multiprocessing
import sys
import time
from typing import Any

_BYTES = 256 * 2**20
_REPS = 20


def _copier(barrier: Any, results: Any) -> None:
    import numpy as np

    src = np.ones(_BYTES // 4, np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # fault the pages in before the clock starts
    barrier.wait()
    t = time.perf_counter()
    for _ in range(_REPS):
        np.copyto(dst, src)
    results.put(_REPS * _BYTES / (time.perf_counter() - t))


def _total(n: int) -> float:
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(n), ctx.SimpleQueue()
    procs = [ctx.Process(target=_copier, args=(barrier, results)) for _ in range(n)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    return sum(results.get() for _ in range(n)) / 1e9


def copy_scaling(n: int) -> dict[str, float]:
    """GB/s copied by 1 process and by `n` at once (in that order), and their ratio."""
    one = _total(1)
    many = _total(n) if n > 1 else one
    return {"processes": n, "one_gbps": one, "many_gbps": many, "scaling": many / one}


if __name__ == "__main__":
    print(copy_scaling(int(sys.argv[1]) if len(sys.argv) > 1 else 2))
