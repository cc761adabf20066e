"""Run one command as a measured process tree: wall time, sampled memory, I/O, and a watchdog.

Memory is sampled from `/proc/<pid>/status` of the command and all its descendants every
`interval_s` (50 ms by default) and summed over the tree: `VmRSS` (what `ps` shows, including
file-backed pages such as a memory-mapped checkpoint) and `RssAnon + RssShmem` (what the kernel
cannot reclaim without killing someone). The watchdog kills the whole process group when that
non-reclaimable sum passes `limit_bytes`, or when the machine's `MemAvailable` falls under
`floor_bytes`, and records why instead of letting the machine swap or the OOM killer pick.

I/O comes from `/proc/<pid>/io` of the command, read once it has exited but before it is reaped
(`waitid(WNOWAIT)`): the kernel adds every reaped descendant's counts into its parent's, so
that one read covers the tree. `rchar`/`wchar` count bytes through read/write system calls
(page-cache hits included, mmap page faults not); `read_bytes`/`write_bytes` count what went
to or came from the block device.

A `zerosafe convert` of a checkout from before 2026-11-26 (a `before` variant) may be served
by the warm process such checkouts kept beside a local Prefect server (`zerosafe_app.warm`,
since removed): the conversion then runs in a child of that process, outside the
command's tree. `run_measured` names a stats file in the command's environment
(`ZEROSAFE_WARM_STATS`); the command writes the child's pid there, the sampler adds that
child's tree to every sample, and the child's own CPU seconds and I/O counts (which it writes
to `<stats>.child` as it ends) are added to the command's; `served_warm` says it happened.

The command is started through `/bin/sh -c` without `exec`, so it is a grandchild of this
process: Linux carries a parent's peak RSS (`ru_maxrss`) across fork and exec, and this keeps
ours out of the command's own report.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["Measured", "run_measured", "meminfo_bytes"]

_PAGE = os.sysconf("SC_PAGE_SIZE")


def meminfo_bytes(key: str) -> int:
    """A `/proc/meminfo` field in bytes (`MemAvailable`, `Cached`...)."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _status(pid: int) -> tuple[int, int] | None:
    """(VmRSS, RssAnon + RssShmem) of one process in bytes, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            text = f.read()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    vals = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssShmem"):
            vals[key] = int(rest.split()[0]) * 1024
    return vals.get("VmRSS", 0), vals.get("RssAnon", 0) + vals.get("RssShmem", 0)


def _children(pid: int) -> list[int]:
    """Direct children of `pid` (all its threads' children)."""
    out: list[int] = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out.extend(int(x) for x in f.read().split())
        except (FileNotFoundError, ProcessLookupError):
            continue
    return out


def _tree(root: int) -> list[int]:
    pids, todo = [], [root]
    while todo:
        pid = todo.pop()
        pids.append(pid)
        todo.extend(_children(pid))
    return pids


def _cpu_s(pid: int) -> float:
    """utime + stime + cutime + cstime of a process (its reaped descendants included)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return 0.0
    # fields[0] is the state (field 3); utime..cstime are fields 14..17
    return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def _io(pid: int) -> dict[str, int]:
    try:
        with open(f"/proc/{pid}/io") as f:
            return {k: int(v) for k, v in (line.split(": ") for line in f.read().splitlines())}
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return {}


def _warm_child(stats_path: str) -> list[int]:
    """The pid of the warm process's child serving the command, once the command wrote it."""
    try:
        with open(stats_path) as f:
            return [int(json.load(f)["pid"])]
    except (OSError, ValueError, KeyError):
        return []


def _child_stats(stats_path: str) -> dict[str, Any]:
    """What the warm child wrote as it ended: its CPU seconds and /proc I/O counts."""
    try:
        with open(stats_path + ".child") as f:
            stats = json.load(f)
    except (OSError, ValueError):
        return {}
    return stats if isinstance(stats, dict) else {}


@dataclass
class Measured:
    """What one measured command did."""

    argv: list[str]
    returncode: int | None = None
    wall_s: float = 0.0
    peak_rss_bytes: int = 0
    """Peak of the tree's summed VmRSS (file-backed pages included)."""
    peak_anon_bytes: int = 0
    """Peak of the tree's summed RssAnon + RssShmem."""
    peak_procs: int = 0
    samples: int = 0
    rchar: int = 0
    wchar: int = 0
    read_bytes: int = 0
    write_bytes: int = 0
    cpu_s: float = 0.0
    """CPU seconds (user + system) of the whole tree."""
    load_before: float = 0.0
    """The machine's 1-minute load average when it started (others' work shows here)."""
    load_after: float = 0.0
    killed: str | None = None
    """Why the watchdog stopped it, if it did."""
    served_warm: bool = False
    """Whether a warm zerosafe process ran it (its child is counted in every figure)."""
    stdout: str = field(default="", repr=False)
    stderr: str = field(default="", repr=False)

    def as_dict(self, *, tail: int = 4000) -> dict[str, Any]:
        d = asdict(self)
        d["stdout"] = self.stdout[-tail:]
        d["stderr"] = self.stderr[-tail:]
        return d


def run_measured(
    argv: list[str],
    *,
    env: dict[str, str] | None = None,
    cwd: str | None = None,
    interval_s: float = 0.05,
    limit_bytes: int = 18 * 10**9,
    floor_bytes: int = 1536 * 2**20,
    timeout_s: float | None = None,
) -> Measured:
    """Run `argv` (via /bin/sh, in a new session) and measure it; see the module docstring."""
    result = Measured(argv=list(argv))
    out_path = f"/tmp/zerosafe-bench-{os.getpid()}-{time.monotonic_ns()}"
    stats_path = out_path + ".warm"
    env = {**(os.environ if env is None else env), "ZEROSAFE_WARM_STATS": stats_path}
    warm_child: list[int] = []
    result.load_before = os.getloadavg()[0]
    with open(out_path + ".out", "w+b") as out_f, open(out_path + ".err", "w+b") as err_f:
        started = time.perf_counter()
        proc = subprocess.Popen(
            ["/bin/sh", "-c", '"$0" "$@"; exit $?', *argv],
            stdout=out_f,
            stderr=err_f,
            env=env,
            cwd=cwd,
            start_new_session=True,
        )
        done = threading.Event()
        exited_at: list[float] = []

        def wait_exit() -> None:
            os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)
            exited_at.append(time.perf_counter())
            done.set()

        waiter = threading.Thread(target=wait_exit, daemon=True)
        waiter.start()
        while not done.is_set():
            pids = _tree(proc.pid)
            if not warm_child and os.path.exists(stats_path):
                warm_child.extend(_warm_child(stats_path))
            for child in warm_child:
                pids.extend(_tree(child))
            rss = anon = 0
            for pid in pids:
                st = _status(pid)
                if st is not None:
                    rss += st[0]
                    anon += st[1]
            result.samples += 1
            result.peak_rss_bytes = max(result.peak_rss_bytes, rss)
            result.peak_anon_bytes = max(result.peak_anon_bytes, anon)
            result.peak_procs = max(result.peak_procs, len(pids))
            reason = None
            if anon > limit_bytes:
                reason = (
                    f"process tree held {anon / 1e9:.2f} GB of anonymous memory, over the "
                    f"{limit_bytes / 1e9:.0f} GB limit"
                )
            elif meminfo_bytes("MemAvailable") < floor_bytes:
                reason = (
                    f"machine MemAvailable fell under {floor_bytes / 2**30:.1f} GiB "
                    f"(tree RSS {rss / 1e9:.2f} GB, anonymous {anon / 1e9:.2f} GB)"
                )
            elif timeout_s is not None and time.perf_counter() - started > timeout_s:
                reason = f"ran past {timeout_s:.0f} s"
            if reason is not None and result.killed is None:
                result.killed = reason
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            done.wait(interval_s)
        io = _io(proc.pid)  # a zombie still reports its own and its reaped children's counts
        result.cpu_s = _cpu_s(proc.pid)
        result.load_after = os.getloadavg()[0]
        proc.wait()
        try:  # anything the command left behind (a server it started) goes too
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        result.wall_s = (exited_at[0] if exited_at else time.perf_counter()) - started
        result.returncode = proc.returncode
        child_stats = _child_stats(stats_path) if warm_child else {}
        result.served_warm = bool(warm_child)
        result.cpu_s += float(child_stats.get("cpu_s", 0.0))
        for key in ("rchar", "wchar", "read_bytes", "write_bytes"):
            setattr(result, key, io.get(key, 0) + int(child_stats.get("io", {}).get(key, 0)))
        out_f.seek(0)
        err_f.seek(0)
        result.stdout = out_f.read().decode(errors="replace")
        result.stderr = err_f.read().decode(errors="replace")
    for suffix in (".out", ".err", ".warm", ".warm.child"):
        try:
            os.unlink(out_path + suffix)
        except FileNotFoundError:
            pass
    return result
