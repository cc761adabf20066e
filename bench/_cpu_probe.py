"""What the machine's cores give: topology, a pure-CPU loop in 1..N processes, and where the
time of a command went by /proc/stat (user, system, idle, iowait, steal).

    python bench/_cpu_probe.py                 # topology and pure-CPU scaling
    python bench/_cpu_probe.py -- CMD ARGS...  # also /proc/stat across CMD

A memory-bound conversion cannot scale past the cores' own scaling: 16 vCPUs that are 8
cores' hyper-threads, or that the hypervisor gives less than whole (steal), show here.
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import time

_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def proc_stat() -> list[int]:
    """The machine's CPU time so far, in ticks, per field of `_FIELDS` (zeros where there is
    no /proc/stat)."""
    try:
        with open("/proc/stat") as f:
            return [int(x) for x in f.readline().split()[1:9]]
    except OSError:
        return [0] * len(_FIELDS)


def stat_cpus(before: list[int], after: list[int], seconds: float) -> dict[str, float]:
    """CPUs each field of `_FIELDS` took on average over `seconds`, the whole machine."""
    ticks = os.sysconf("SC_CLK_TCK")
    return {
        k: round((b - a) / ticks / seconds, 2)
        for k, a, b in zip(_FIELDS, before, after, strict=True)
        if k != "nice"
    }


def _spin(seconds: float, out: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    n, end = 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(10_000):
            n += 1
    out.put(n)


def cpu_scaling(counts: list[int], seconds: float = 1.5) -> dict[int, float]:
    """Loop iterations per second, all processes together, for each count."""
    rates = {}
    for n in counts:
        q: multiprocessing.Queue = multiprocessing.Queue()  # type: ignore[type-arg]
        procs = [multiprocessing.Process(target=_spin, args=(seconds, q)) for _ in range(n)]
        for p in procs:
            p.start()
        total = sum(q.get() for _ in procs)
        for p in procs:
            p.join()
        rates[n] = total / seconds
    return rates


def topology() -> str:
    cpu = "/sys/devices/system/cpu"
    siblings = set()
    for name in os.listdir(cpu):
        path = f"{cpu}/{name}/topology/thread_siblings_list"
        if name.startswith("cpu") and os.path.exists(path):
            with open(path) as f:
                siblings.add(f.read().strip())
    model = ""
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return f"{os.cpu_count()} CPUs, {len(siblings)} cores (thread siblings: {sorted(siblings)}); {model}"


def main() -> int:
    print(topology(), flush=True)
    cmd = sys.argv[sys.argv.index("--") + 1 :] if "--" in sys.argv else []
    if not cmd:
        n = os.cpu_count() or 1
        rates = cpu_scaling(sorted({1, max(1, n // 2), n}))
        one = rates[1]
        print("pure-CPU loop: " + ", ".join(f"{k} procs {v / one:.2f}x" for k, v in rates.items()))
        return 0
    before, t0 = proc_stat(), time.perf_counter()
    rc = subprocess.call(cmd)
    wall = time.perf_counter() - t0
    parts = ", ".join(f"{k} {v:.1f}" for k, v in stat_cpus(before, proc_stat(), wall).items())
    print(f"/proc/stat over {wall:.1f} s, in CPUs: {parts}", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
