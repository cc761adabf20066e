"""One lifecycle for the training-state targets (`--to universal`, `--to dcp`): the call
sequence of `zerosafe.targets.base`, written once.

`hold_target` holds the output folder and the work area around a `TargetRun`; the run's
`run_unit` writes (or keeps) one unit and `publish` checks every unit and publishes, the
marker last. `run_target` runs the units on threads in this process; the Prefect flow
(`zerosafe_app.flows.training_state`) runs each as a cached task between the same two calls.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

from zerosafe.errors import OutputExistsError, VerificationError
from zerosafe.formats.crc import CrcLedger
from zerosafe.io.lease import Lease, work_lease
from zerosafe.io.storage import JSON_MAX_BYTES, Storage, join_url, normalize_url
from zerosafe.pipeline import hold_destination, peak_rss_bytes
from zerosafe.run.unit_records import Stage, UnitRecords, unit_key
from zerosafe.stages.destination import check_output_apart, check_output_kind
from zerosafe.targets.base import OutputTarget, StateOptions, StateSummary, UnitSpec, UnitWork

__all__ = [
    "WORK_DIR_NAME",
    "TargetRun",
    "check_units",
    "files_intact",
    "hold_target",
    "read_marker",
    "run_target",
]

log = logging.getLogger(__name__)

WORK_DIR_NAME = ".zerosafe-work"
_MARKER = "a zerosafe completion marker (JSON)"


def files_intact(storage: Storage, out_url: str, written: Iterable[Mapping[str, Any]]) -> bool:
    """Whether every file a unit recorded (`path` under `out_url`, `size_bytes`) is there with
    its size: a recorded unit is kept only then (any storage error: it runs again)."""
    for w in written:
        try:
            if storage.identity(join_url(out_url, w["path"])).size_bytes != w["size_bytes"]:
                return False
        except Exception:  # noqa: BLE001 - any storage error: the unit runs again
            return False
    return True


def check_units(
    storage: Storage,
    out_url: str,
    records: UnitRecords,
    stage: Stage,
    units: Sequence[tuple[int, Sequence[Mapping[str, Any]]]],
    check: Callable[[Mapping[str, Any]], None],
    *,
    tasks: int = 1,
) -> None:
    """Check every file of every unit (`(index, files written)`) with `check`, the final
    re-read, `tasks` units at once. A unit with a file that fails is dropped, its record and
    its files, whether it ran now or was kept: a file damaged at its recorded size (a
    zero-filled block after a crash, bit rot on NFS) passes `files_intact`, and kept it would
    fail every later run.

    Raises:
        VerificationError: Naming the first failure and the units dropped; the next run of
            the command redoes them.
    """

    def first_failure(files: Sequence[Mapping[str, Any]]) -> Exception | None:
        for w in files:
            try:
                check(w)
            except (VerificationError, ValueError) as e:  # damaged: its CRC, zip or pickle
                return e
        return None

    with ThreadPoolExecutor(max(tasks, 1), thread_name_prefix=f"zerosafe-check-{stage}") as pool:
        found = list(pool.map(first_failure, [files for _, files in units]))
    failed = {index: e for (index, _), e in zip(units, found, strict=True) if e is not None}
    if not failed:
        return
    for index, files in units:
        if index in failed:
            records.drop(stage, index)
            for w in files:
                storage.remove(join_url(out_url, w["path"]))
    first = next(iter(failed.values()))
    raise VerificationError(
        f"{first}. {len(failed)} unit(s) of work failed this final check ({stage} "
        f"{', '.join(map(str, failed))}) and were dropped, their files removed: run the "
        "command again to redo them (the other units are kept)."
    ) from first


class TargetRun:
    """One run of a planned target into a held output folder (`hold_target`)."""

    def __init__(
        self,
        target: OutputTarget,
        storage: Storage,
        out_url: str,
        options: StateOptions,
        *,
        started: float,
        out_lease: Lease,
    ) -> None:
        self.target = target
        self.storage = storage
        self.out_url = out_url
        self.options = options
        self.chunk_bytes = options.chunk
        self.started = started
        self.out_lease = out_lease
        self.work_url = join_url(out_url, WORK_DIR_NAME, target.job_key[:16])
        self.records = UnitRecords(storage, self.work_url)
        self.summary = target.summary("converted", out_url)
        self.summary.parallel = options.tasks_at_once
        self.summary.chunk_bytes = self.chunk_bytes
        self._lock = threading.Lock()
        self._specs: list[UnitSpec] | None = None

    @property
    def complete(self) -> bool:
        return self.summary.status == "already-complete"

    def units(self) -> list[UnitSpec]:
        """Step 2: every unit, in order."""
        if self._specs is None:
            self._specs = list(self.target.units(self.options.unit_bytes))
        return self._specs

    def unit_key(self, unit: UnitSpec) -> str:
        """The unit's record key (also the flow's cache key)."""
        return unit_key(
            self.target.name, self.target.job_key, unit.index, unit.fingerprint,
            direct=None, allow_nonfinite=None,
        )  # fmt: skip

    def kept(self, unit: UnitSpec) -> UnitWork | None:
        """What a recorded unit wrote, if its record holds and its files are all there."""
        record = self.records.load(self.target.name, unit.index, self.unit_key(unit))
        files = record["result"].get("files") if record is not None else None
        if not isinstance(files, list) or not files_intact(self.storage, self.out_url, files):
            return None
        return UnitWork.from_record(record["result"])  # type: ignore[index]

    def run_unit(self, unit: UnitSpec) -> UnitWork:
        """Step 3: keep the unit if recorded and intact, else write and record it. Safe to call
        from several threads at once."""
        work = self.kept(unit)
        if work is not None:
            with self._lock:
                self.summary.units_kept += 1
            return work
        work = self.target.write_unit(self.storage, self.out_url, unit, self.chunk_bytes)
        self.records.save(self.target.name, unit.index, self.unit_key(unit), work.record(unit.kind))
        with self._lock:
            self.summary.units_run += 1
            self.summary.files_written += len(work.files)
            self.summary.bytes_read += work.bytes_read
            self.summary.bytes_written += work.bytes_written
        return work

    def count_kept(self) -> None:
        """Count a unit kept without `run_unit` (a cached Prefect task)."""
        with self._lock:
            self.summary.units_kept += 1

    def run_units(self) -> dict[int, UnitWork]:
        """Every unit, `options.tasks_at_once` at a time on threads."""
        units = self.units()
        tasks = min(self.options.tasks_at_once, max(len(units), 1))
        if tasks == 1:
            return {u.index: self.run_unit(u) for u in units}
        with ThreadPoolExecutor(tasks, thread_name_prefix=f"zerosafe-{self.target.name}") as pool:
            futures = {u.index: pool.submit(self.run_unit, u) for u in units}
            return {index: f.result() for index, f in futures.items()}

    def publish(self, done: Mapping[int, UnitWork]) -> None:
        """Steps 4 and 5: the source records against their CRC-32s, every file re-read (a
        failing unit dropped), then the target's files and, last, the marker."""
        storage, target, chunk = self.storage, self.target, self.chunk_bytes
        ledger = CrcLedger()
        for index in sorted(done):
            ledger.update(done[index].ledger)
        checked, read = target.check_source(storage, ledger, self.records)
        self.summary.source_records_checked = checked
        self.summary.bytes_read += read
        units = [(index, done[index].files) for index in sorted(done)]
        check_units(
            storage, self.out_url, self.records, target.name, units,
            lambda f: target.check_file(storage, self.out_url, f, chunk),
            tasks=self.options.tasks_at_once,
        )  # fmt: skip
        marker = target.publish(storage, self.out_url, [f for _, fs in units for f in fs], chunk)
        self.out_lease.check()
        storage.write_bytes(
            join_url(self.out_url, target.marker_name), json.dumps(marker, indent=1).encode()
        )

    def finish(self) -> StateSummary:
        """Step 6: the summary, with the time and peak memory so far."""
        self.summary.seconds = time.monotonic() - self.started
        self.summary.peak_rss_bytes = peak_rss_bytes()
        return self.summary


def read_marker(storage: Storage, marker_url: str) -> dict[str, Any]:
    """An output's completion marker (JSON), read within `JSON_MAX_BYTES`."""
    marker: dict[str, Any] = json.loads(
        storage.read_small(marker_url, limit_bytes=JSON_MAX_BYTES, what=_MARKER)
    )
    return marker


def _settle_output(run: TargetRun) -> bool:
    """Step 1 after the lease: True when the output already holds this conversion; else
    another source's complete output is refused (or removed with `--overwrite`) and the
    target removes what a reader could take for its output."""
    storage, target, out_url = run.storage, run.target, run.out_url
    marker_url = join_url(out_url, target.marker_name)
    marker: dict[str, Any] | None = None
    if storage.exists(marker_url):
        marker = read_marker(storage, marker_url)
        if marker.get("job_key") != target.job_key:
            if not run.options.overwrite:
                source = marker.get("source")
                source = source.get("checkpoint") if isinstance(source, dict) else source
                raise OutputExistsError(
                    f"{out_url}: holds a complete {target.label} of another source ({source}); "
                    "choose another output folder or pass --overwrite"
                )
            target.clear(storage, out_url)
            marker = None
    return target.prepare(storage, out_url, marker, overwrite=run.options.overwrite)


@contextlib.contextmanager
def hold_target(
    name: Literal["universal", "dcp"],
    open_target: Callable[[], OutputTarget],
    storage: Storage,
    source: str,
    out_url: str,
    options: StateOptions,
) -> Iterator[TargetRun]:
    """Step 1 and the leases around a run: plan (`open_target`, reading the source only), hold
    the output folder (a second run is refused in one line naming the holder), refuse another
    kind's output, settle the output, then hold the work area while the caller runs the units and publishes. The work
    records are removed after (unless `keep_work`). A run whose output is already complete
    (`run.complete`) holds no work area: the caller has nothing to do."""
    started = time.monotonic()
    check_output_apart(storage, source, out_url)
    out_url = normalize_url(out_url)
    target = open_target()  # reads the source only: a refused source leaves no output folder
    with hold_destination(storage, source, out_url) as out_lease:
        check_output_kind(storage, out_url, name, overwrite=options.overwrite)
        run = TargetRun(target, storage, out_url, options, started=started, out_lease=out_lease)
        if _settle_output(run):
            run.summary.status = "already-complete"
            yield run
            return
        clean = target.temp_folders(storage, out_url)
        with work_lease(storage, run.work_url, clean=clean):
            if options.overwrite:  # a killed attempt's units are not kept either: start clean
                run.records.clear()
            yield run
    if not options.keep_work:
        storage.remove_tree(join_url(out_url, WORK_DIR_NAME))


def run_target(
    name: Literal["universal", "dcp"],
    open_target: Callable[[], OutputTarget],
    source: str,
    out_url: str,
    options: StateOptions,
    *,
    storage: Storage | None = None,
) -> StateSummary:
    """The whole call sequence in this process: the units on `options.tasks_at_once` threads,
    each reading and writing `options.chunk` bytes at a time."""
    storage = storage or Storage()
    with hold_target(name, open_target, storage, source, out_url, options) as run:
        if not run.complete:
            run.publish(run.run_units())
    return run.finish()
