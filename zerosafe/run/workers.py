"""Units of work in worker processes, so that N tasks use N cores, not one interpreter.

A merge or verify is a loop of reads, CRC-32s, casts, checksums and writes. Each of those
releases the GIL for a large buffer, but the Python between them (a chunk's bookkeeping, the
hand-offs between the reader, cast and writer threads, a verify's per-tensor checks) takes it,
so N tasks as threads of one process queue on it: measured on a 16-core machine, 16 tasks ran
at 1.5x one task's speed. `UnitPool` runs the same unit functions (`zerosafe.pipeline.merge_unit`,
`verify_unit`, `extract_unit`) in `workers` processes instead, each with its own interpreter.

- **Memory**: at most `workers` units run at once, one per process, and each holds what a task
  holds (`ConvertOptions.task_memory_bytes`: the budget divided among the tasks), plus the
  process itself (`WORKER_OVERHEAD_BYTES`, taken out of the budget first: `process_options`).
- **Start**: processes are forked from a server that has imported the engine once (and torch,
  where a cast needs it: `zerosafe.cast`), so a worker starts in milliseconds and shares those
  pages; the first pool of a process pays one interpreter start and import, which `prestart`
  overlaps with planning.
- **Arguments**: large, shared objects (the plan) are sent once per worker (`shared`, named by
  `Shared(name)` in a call); a `Storage` goes as its options (`Storage.__reduce__`), so the
  worker's own byte counter starts at zero: a unit's bytes are in its result.
- **Progress**: a unit's `on_bytes` is called in the calling process, from a thread that drains
  what the workers send (batched, so a small chunk is not a message).
- **Imports**: a worker's interpreter starts as `python -c`, which puts the current folder
  first on its module path; run from inside a checkpoint's folder (`zerosafe convert . out`),
  a `numpy/` there would be imported, and run, by the workers. They start with
  `PYTHONSAFEPATH` set, and the caller's own `zerosafe` first on their path
  (`_interpreters_without_current_folder`); on Python 3.10, which lacks it, a current folder
  holding modules keeps the units in threads (`_folder_is_safe`).
- **Failures**: a unit's exception is re-raised in the caller as it was (`ConversionError`s
  pickle with their message); a worker that dies (killed, out of memory) fails the call with
  a `ConversionError` naming it.

The command's default is `auto` (a job of 2 GB or more runs in workers); the flow and a
library call keep threads unless asked (`ZEROSAFE_WORKERS=auto|processes|threads`, read by
the command and the flow into `zerosafe.run.job.RunSettings`, or `workers=` in
`convert_checkpoint`). Once casts stopped importing torch (`zerosafe.cast`),
workers started cheaply and won: a whole 1B command on 2 cores 3.0-3.1 s against 4.2-4.7 s as
threads, a 2B one on 16 cores 4.0-4.5 s against 4.0-5.3 s (docs/performance.md). A worker dies
with the process that started it (`_die_with_caller`).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import resource
import select
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, replace
from typing import Any

from zerosafe.config import (
    MIN_CHUNK_BYTES,
    PIPELINE_BUFFERS,
    TASK_OVERHEAD_BYTES,
    ConvertOptions,
    environ_during,
    usable_cores,
)
from zerosafe.errors import ConfigError, ConversionError

__all__ = [
    "PROCESS_MIN_BYTES",
    "WORKER_OVERHEAD_BYTES",
    "WORKER_OVERHEAD_NO_TORCH_BYTES",
    "Shared",
    "UnitPool",
    "prestart",
    "process_options",
    "processes_note",
    "usable_cores",
]

PROCESS_MIN_BYTES = 2 * 10**9
"""Bytes to merge below which a job keeps threads: on 2 cores a whole 0.3B command (1.2 GB)
took 0.2-1.1 s longer with workers than with threads (measured when workers imported torch)."""
WORKER_OVERHEAD_BYTES = 300 * 2**20
"""What a worker process holds besides its task's buffers (interpreter, engine, torch), as RSS
counts it: on the 16-core device machine (torch 2.11) 4 workers under a 1 GB budget raised the
command's reported peak from 0.90 GB (threads) to 2.05 GB, about 290 MB each. Part of that is
torch's pages, shared with the forkserver but counted in every worker's RSS."""
WORKER_OVERHEAD_NO_TORCH_BYTES = 100 * 2**20
"""The same for a job whose casts need no torch (bfloat16 or float32 output: `zerosafe.cast`):
a fresh interpreter with the engine's imports and not torch held 42 MB; on 2 cores a 1B
command (1 GB budget) peaked at 443-452 MiB with 2 workers against 348-361 MiB as threads."""
_started: Any = None
"""The pool's barrier in a worker (`_rendezvous`)."""
_PROGRESS_BATCH = 16 * 2**20
"""Bytes a worker accumulates before it reports them."""
MODES = ("auto", "processes", "threads")


@dataclass(frozen=True, slots=True)
class Shared:
    """Stands, in a call's arguments, for the pool's shared object `name`."""

    name: str


_START_LOCK = threading.Lock()
_MODULE_SUFFIXES = (".py", ".pyc", ".so", ".pyd")


@contextlib.contextmanager
def _interpreters_without_current_folder() -> Iterator[None]:
    """While worker interpreters start here: `PYTHONSAFEPATH=1` in the environment they
    inherit, so that `python -c` leaves the current folder off their module path (Python 3.11+;
    a checkpoint folder's `numpy/__init__.py` ran in the forkserver without it, checked), and
    the folder this process imported `zerosafe` from first on `PYTHONPATH`, so that the
    workers run the caller's engine wherever it came from (a checkout run from its own folder
    had it from the current folder). Set only meanwhile, under a lock: `PYTHONSAFEPATH` would
    also drop a script's own folder from the path of any Python the caller starts later."""
    with _START_LOCK:  # another start's PYTHONPATH is not read as the caller's
        root, path = _engine_folder(), os.environ.get("PYTHONPATH")
        first = None if root is None else os.pathsep.join([root, *([path] if path else [])])
        with environ_during({"PYTHONSAFEPATH": "1", "PYTHONPATH": first}):
            yield


def _engine_folder() -> str | None:
    """The folder this process imported `zerosafe` from, unless it is one of the interpreter's
    own package folders, which the workers search anyway (put first, a package there could
    shadow the standard library in them)."""
    import site
    import sysconfig

    import zerosafe

    root = os.path.realpath(os.path.dirname(os.path.dirname(os.path.abspath(zerosafe.__file__))))
    own = {sysconfig.get_path(name) for name in ("purelib", "platlib")}
    own.update(getattr(site, "getsitepackages", list)())
    return None if root in {os.path.realpath(p) for p in own if p} else root


def modules_in(folder: str) -> list[str]:
    """What in `folder` a Python started there with `-c` would import before the installed
    modules: modules (`.py`, `.pyc`, extensions) and packages (folders with `__init__.py`)."""
    found = []
    with contextlib.suppress(OSError), os.scandir(folder) as entries:
        for entry in entries:
            if entry.name.endswith(_MODULE_SUFFIXES) or (
                entry.is_dir() and os.path.exists(os.path.join(entry.path, "__init__.py"))
            ):
                found.append(entry.name)
    return sorted(found)


def _folder_is_safe(mode: str) -> bool:
    """Whether worker interpreters may start from the current folder: always on Python 3.11+
    (`_interpreters_without_current_folder`); on 3.10 only where it holds no modules.

    Raises:
        ConfigError: If `mode` is `processes` and they may not.
    """
    if sys.version_info >= (3, 11):
        return True
    found = modules_in(os.getcwd())
    if found and mode == "processes":
        raise ConfigError(
            f"ZEROSAFE_WORKERS=processes: the current folder {os.getcwd()} holds Python "
            f"modules ({', '.join(found[:3])}) that worker processes would import on Python "
            f"{'.'.join(map(str, sys.version_info[:2]))}; run from another folder, on Python "
            "3.11+, or with ZEROSAFE_WORKERS=threads"
        )
    return not found


def prestart(mode: str, *, torch: bool = False) -> bool:
    """Start the worker processes' forkserver now, where `mode` may use it, so that its
    interpreter start and its import of the engine and torch (about 2 s) run on a spare core
    while the caller plans, not when the first unit is submitted. `auto` starts it only with
    more than 2 cores (`usable_cores`): on 2 it would take a core from planning for a pool that
    a small job never starts. Returns whether it started one; an unused server exits with the
    caller."""
    if mode == "threads" or (mode == "auto" and usable_cores() <= 2):
        return False
    ctx = _context(torch=torch)
    if ctx.get_start_method() != "forkserver" or not _folder_is_safe(mode):
        return False
    _start_servers(ctx)
    return True


def _start_servers(ctx: Any) -> None:
    """Start the interpreters multiprocessing itself starts with `python -c`, without the
    current folder on their path (`_interpreters_without_current_folder`): its resource
    tracker (the pool's queue and barrier start it) and the forkserver the workers fork from."""
    from multiprocessing import resource_tracker

    with _interpreters_without_current_folder():
        resource_tracker.ensure_running()
        if ctx.get_start_method() == "forkserver":
            from multiprocessing import forkserver

            forkserver.ensure_running()


def process_options(
    options: ConvertOptions, *, units: int, nbytes: int, mode: str, torch: bool = True
) -> ConvertOptions | None:
    """The options a job's units run with in worker processes, or None to keep threads.

    `mode` (`MODES`, `zerosafe.run.job.RunSettings.workers`): `threads` never; `auto` takes processes where more than one task
    may run (`options.parallel_tasks`), there is more than one unit of real work (`units`) and
    enough bytes (`nbytes`, `PROCESS_MIN_BYTES`) to pay for starting workers; `processes`
    skips the size test. The workers' own overhead (`WORKER_OVERHEAD_BYTES` each, or
    `WORKER_OVERHEAD_NO_TORCH_BYTES` where their casts need no torch) comes out of
    the budget before it is divided among the tasks, so the job still holds at most
    `options.memory`: fewer workers than tasks where the budget cannot hold them all (1 GB holds
    2 that import torch, 6 that do not), threads where it cannot hold two.
    On a 16-core machine (2B ZeRO-3 -> bf16, warm, units alone) processes ran 8 tasks at 3.1x
    one task's speed into tmpfs against 2.1x as threads (docs/performance.md).
    """
    if mode not in MODES:
        raise ConfigError(f"worker mode {mode!r}: expected one of {', '.join(MODES)}")
    tasks = options.parallel_tasks
    if mode == "threads" or tasks < 2 or units < 2 or not _folder_is_safe(mode):
        return None
    if mode == "auto" and nbytes < PROCESS_MIN_BYTES:
        return None
    floor = TASK_OVERHEAD_BYTES + PIPELINE_BUFFERS * MIN_CHUNK_BYTES
    overhead = WORKER_OVERHEAD_BYTES if torch else WORKER_OVERHEAD_NO_TORCH_BYTES
    tasks = min(tasks, options.memory // (overhead + floor))
    if tasks < 2:
        return None
    memory = options.memory - tasks * overhead
    return replace(options, memory=memory, max_parallel_tasks=tasks)


def processes_note(workers: int) -> str:
    """The summary's note for a run whose units ran in `workers` processes."""
    return (
        f"units ran in {workers} worker processes, one interpreter each "
        "(ZEROSAFE_WORKERS=threads runs them as threads of this process)"
    )


# -- in the worker --------------------------------------------------------------------------------

_shared: dict[str, Any] = {}
_reports: Any = None


def _die_with_caller(caller: int) -> None:
    """Kill this worker as soon as the process that started the pool (`caller`) is gone, so
    a command killed with SIGKILL leaves no worker writing a shard after it. Its parent is the
    forkserver, which outlives the caller while a worker holds the caller's end of its pipe,
    so the worker watches the caller itself: a pidfd (Linux 5.3+) that becomes readable when
    the caller exits, else a check every second."""

    def watch() -> None:
        try:
            fd = os.pidfd_open(caller)
        except (AttributeError, OSError):
            fd = None
        if fd is not None:
            select.select([fd], [], [])
        else:
            while True:
                try:
                    os.kill(caller, 0)
                except (ProcessLookupError, PermissionError):  # gone, or its number reused
                    break  # by another user's process (the caller ran as this worker's user)
                time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="zerosafe-watch-caller", daemon=True).start()


def _init_worker(shared: dict[str, Any], reports: Any, caller: int, started: Any) -> None:
    global _reports, _started
    _die_with_caller(caller)
    _started = started
    _shared.update(shared)
    _reports = reports
    from zerosafe.cast import serial_torch

    serial_torch()  # this process runs its own reader/cast/writer threads, one task at a time


class _Reporter:
    """`on_bytes` in a worker: sends `(call, bytes)` every `_PROGRESS_BATCH` bytes."""

    def __init__(self, call: int) -> None:
        self.call, self.pending = call, 0
        self.lock = threading.Lock()

    def __call__(self, n: int) -> None:
        with self.lock:
            self.pending += n
            if self.pending < _PROGRESS_BATCH:
                return
            n, self.pending = self.pending, 0
        _reports.put((self.call, n))

    def flush(self) -> None:
        with self.lock:
            n, self.pending = self.pending, 0
        if n:
            _reports.put((self.call, n))


def _rendezvous(timeout: float) -> int:
    """Wait until every worker of the pool runs this (`UnitPool.start`)."""
    _started.wait(timeout)
    return os.getpid()


def _resolve(value: Any) -> Any:
    return _shared[value.name] if isinstance(value, Shared) else value


def _run_unit(
    call: int, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Any, int, int]:
    reporter = _Reporter(call) if call >= 0 else None
    if reporter is not None:
        kwargs = {**kwargs, "on_bytes": reporter}
    try:
        result = fn(*(_resolve(a) for a in args), **{k: _resolve(v) for k, v in kwargs.items()})
    finally:
        if reporter is not None:
            reporter.flush()
    return result, os.getpid(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# -- in the caller --------------------------------------------------------------------------------


def _context(*, torch: bool) -> Any:
    """forkserver where the platform has it (Linux): workers fork from a clean server that
    preloaded the engine (and torch, where the units cast through it); spawn elsewhere."""
    if "forkserver" in multiprocessing.get_all_start_methods():
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(
            ["zerosafe.pipeline", "zerosafe.stages.streaming", *(["torch"] if torch else [])]
        )
        return ctx
    return multiprocessing.get_context("spawn")


class UnitPool:
    """`workers` processes that run unit functions; `run` blocks the calling thread only, so
    several threads of the caller can keep all workers busy (at most `workers` units run)."""

    def __init__(
        self, workers: int, shared: dict[str, Any] | None = None, *, torch: bool = False
    ) -> None:
        self.workers = workers
        ctx = _context(torch=torch)
        _start_servers(ctx)
        self._reports = ctx.SimpleQueue()
        self._started = ctx.Barrier(workers)
        self._executor = ProcessPoolExecutor(
            workers, mp_context=ctx, initializer=_init_worker,
            initargs=(dict(shared or {}), self._reports, os.getpid(), self._started),
        )  # fmt: skip
        self.pids: frozenset[int] = frozenset()
        """The workers' process ids, once `start` has brought them up."""
        self._lock = threading.Lock()
        self._callbacks: dict[int, Callable[[int], None]] = {}
        self._next_call = 0
        self._peaks: dict[int, int] = {}
        self._drain = threading.Thread(
            target=self._drain_reports, name="zerosafe-units", daemon=True
        )
        self._drain.start()

    def start(self, timeout: float = 120.0) -> None:
        """Start every worker now, before the units. The executor would otherwise start one
        per submit, in the submitting thread and under a lock the other submits wait on: on
        the 16-core machine, 16 tasks' first units waited about 0.4 s each for their
        siblings' workers to fork while 15 others loaded the cores (bench/scaling.py's
        profile). Each worker runs `_rendezvous` and waits there for the others, so no
        worker is idle until all are up and every submit here starts a new one."""
        with _interpreters_without_current_folder():  # the submits start the workers
            waits = [self._executor.submit(_rendezvous, timeout) for _ in range(self.workers)]
        try:
            pids = {wait.result() for wait in waits}
        except Exception as e:  # a broken pool, or the barrier broken by its timeout
            raise ConversionError(
                f"worker processes failed to start ({type(e).__name__}: {e}); "
                "run with ZEROSAFE_WORKERS=threads"
            ) from e
        if len(pids) != self.workers:
            raise ConversionError(
                f"{len(pids)} of {self.workers} worker processes started within {timeout} s; "
                "run with ZEROSAFE_WORKERS=threads"
            )
        self.pids = frozenset(pids)

    def run(
        self,
        fn: Callable[..., Any],
        *args: Any,
        on_bytes: Callable[[int], None] | None = None,
        **kwargs: Any,
    ) -> Any:
        """`fn(*args, **kwargs)` in a worker (`Shared` arguments resolved there); its
        `on_bytes` progress reaches `on_bytes` here."""
        call = -1
        if on_bytes is not None:
            with self._lock:
                call, self._next_call = self._next_call, self._next_call + 1
                self._callbacks[call] = on_bytes
        try:
            future = self._executor.submit(_run_unit, call, fn, args, kwargs)
            try:
                result, pid, peak = future.result()
            except BrokenProcessPool as e:
                raise ConversionError(
                    f"a worker process running {getattr(fn, '__name__', fn)} died ({e}); "
                    "it may have been killed for memory: give a smaller --memory per task or "
                    "fewer --parallel tasks, or run with ZEROSAFE_WORKERS=threads"
                ) from e
        finally:
            if call >= 0:
                self._wait_reports(call)
        with self._lock:
            self._peaks[pid] = max(peak, self._peaks.get(pid, 0))
        return result

    def _wait_reports(self, call: int) -> None:
        """Let the drain thread deliver what the call sent before it returned."""
        done = threading.Event()
        with self._lock:  # registered before the marker, which the drain may read at once
            self._callbacks[-2 - call] = lambda _n: done.set()
        self._reports.put((call, -1))  # a marker behind the call's last report
        done.wait()
        with self._lock:
            self._callbacks.pop(call, None)
            self._callbacks.pop(-2 - call, None)

    def _drain_reports(self) -> None:
        while True:
            item = self._reports.get()
            if item is None:
                return
            call, n = item
            if n < 0:
                call = -2 - call
            with self._lock:
                callback = self._callbacks.get(call)
            if callback is not None:
                callback(n)

    @property
    def peak_rss_bytes(self) -> int:
        """The workers' peak resident memory, added up (an upper bound: torch's shared pages
        count in each)."""
        with self._lock:
            return sum(self._peaks.values())

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
        self._reports.put(None)
        self._drain.join()

    def __enter__(self) -> UnitPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
