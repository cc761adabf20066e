"""What each step of a job decides or produces, as frozen dataclasses.

`JobPlan` is what inspect decides (the output's state, the job key, the work area, and per
extract part and output shard the bytes and dependencies the scheduler needs). `ExtractResult`,
`MergeResult` and `VerifyResult` are the results of one unit of work of a stage,
`PublishResult` of publishing, and `RunSummary` of the whole run, with `RunStats` (bytes,
memory, tasks) as written into the manifest.

The engine's lifecycle functions (`zerosafe.pipeline`) pass these between each other. Only
the Prefect tasks and the unit records turn them into JSON (`to_json`, `from_json`, derived
from the fields by `zerosafe.records`), where results are cached and shipped between
processes. The JSON keys are the ones task results and run summaries always had, so results
cached by an earlier run still resume.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from zerosafe.formats.base import SourceDescription
from zerosafe.formats.crc import IntegrityReport
from zerosafe.records import JsonObject, Record, from_json, json_meta, to_json

__all__ = [
    "ExtractResult",
    "JobPlan",
    "MergeResult",
    "PartWork",
    "PublishResult",
    "RunStats",
    "RunSummary",
    "ShardWork",
    "TensorRecords",
    "VerifyResult",
]

Ledger = dict[str, list[list[int]]]
"""A CRC ledger as JSON (`zerosafe.formats.crc.CrcLedger.to_json`)."""
TensorRecords = dict[str, dict[str, Any]]
"""Tensor name -> {checksum algorithm: digest, dtype, shape, ...}: what the manifest records."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PartWork(Record):
    """One extract part (staged mode), as the scheduler sees it."""

    index: int
    rank: int
    label: str
    """The part's number among its rank's parts (shown in the task run name)."""
    size_bytes: int = field(metadata=json_meta(key="bytes"))


@dataclass(frozen=True, kw_only=True, slots=True)
class ShardWork(Record):
    """One output shard, as the scheduler sees it."""

    index: int
    file_name: str = field(metadata=json_meta(key="file"))
    data_bytes: int = field(metadata=json_meta(key="bytes"))
    """Tensor bytes the shard holds (what verify reads)."""
    source_bytes: int
    """Bytes its merge reads."""
    parts: tuple[int, ...]
    """The extract parts (staged mode) its merge reads: it waits for these."""


@dataclass(frozen=True, kw_only=True, slots=True)
class JobPlan(Record):
    """What inspect decided: whether there is anything to do, and the units of work."""

    state: str
    """The output folder's state (`zerosafe.stages.output.OutputState.kind`): `done` means
    it already holds this conversion; `empty` or `partial` mean convert (or resume)."""
    job_key: str
    destination: str = field(metadata=json_meta(absent=""))
    work_url: str = field(default="", metadata=json_meta(key="work"))
    """The job's work area (plan, intermediates, results, journal); empty when `done`."""
    source: SourceDescription | None = field(default=None, metadata=json_meta(skip=True))
    """The plan's source description (checkpoint, tag, format details); None when `done`.
    Its JSON (`source`, and `reader` to read it back) leaves out the file list."""
    parts: tuple[PartWork, ...] = ()
    shards: tuple[ShardWork, ...] = ()
    aliases: dict[str, str] = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    fp32_bytes: int = 0
    metadata_bytes_read: int = 0
    """Source bytes planning read (pickles, zip directories)."""
    source_bytes_needed: int = 0
    """The least any conversion reads: the bytes it copies plus metadata."""
    task_memory_bytes: int = 0
    serial_merges: str = ""
    """Why merges run one at a time (`zerosafe.io.residency.serial_merge_reason`), or "" when
    they may run as many at once as the parallel tasks allow."""

    @property
    def is_done(self) -> bool:
        return self.state == "done"

    def to_json(self) -> JsonObject:
        fields = to_json(self)
        keys = list(fields)
        at = keys.index("work") + 1
        return {
            **{k: fields[k] for k in keys[:at]},
            "source": self.source.to_json(with_files=False) if self.source else {},
            "reader": self.source.reader_json() if self.source else {},
            **{k: fields[k] for k in keys[at:]},
        }

    @classmethod
    def from_json(cls, data: object) -> JobPlan:
        plan = from_json(cls, data)
        assert isinstance(data, Mapping)  # from_json refused anything else
        block, reader = data.get("source"), data.get("reader")
        if not block:
            return plan
        return replace(plan, source=SourceDescription.from_json(block, reader or None))


@dataclass(frozen=True, kw_only=True, slots=True)
class ExtractResult(Record):
    """One extract part copied into an intermediate file."""

    part: int
    rank: int
    file: str
    """The intermediate's URL."""
    file_bytes: int
    bytes_read: int
    """Source bytes read."""
    content_sha256: str
    """Hash of the intermediate's tensor bytes: merges that read it are cached by it."""
    ledger: Ledger
    seconds: float = field(metadata=json_meta(absent=0.0))


@dataclass(frozen=True, kw_only=True, slots=True)
class MergeResult(Record):
    """One output shard written (or, in a repair, a published shard kept)."""

    shard: int
    file: str
    """The shard's file name."""
    file_bytes: int
    data_bytes: int
    bytes_read: int
    tensors: TensorRecords
    """What the writer recorded per tensor: verify checks the file against it."""
    ledger: Ledger
    seconds: float = field(metadata=json_meta(absent=0.0))
    reused: bool = field(default=False, metadata=json_meta(omit_default=True))
    """A repair kept the published shard: nothing was read or written."""


@dataclass(frozen=True, kw_only=True, slots=True)
class VerifyResult(Record):
    """One shard checked by the independent reader (`zerosafe.verify.tensors`).

    Its JSON has `ok` after `file` (read back from the failures, not from the key)."""

    file: str
    num_tensors: int
    tensors: TensorRecords
    metadata: dict[str, str] = field(metadata=json_meta(absent={}))
    failures: tuple[dict[str, str], ...] = field(metadata=json_meta(absent=()))
    """`{file, tensor, check, detail}` per failed check (`zerosafe.verify.tensors.Failure`)."""
    bytes_read: int = field(metadata=json_meta(absent=0))
    shard: int
    seconds: float = field(metadata=json_meta(absent=0.0))
    sha256: str | None = field(default=None, metadata=json_meta(omit_default=True))
    """SHA-256 of the whole file as re-read, with `file_sha256` on (publish records it)."""

    @property
    def ok(self) -> bool:
        return not self.failures

    def to_json(self) -> JsonObject:
        fields = to_json(self)
        return {"file": fields.pop("file"), "ok": self.ok, **fields}


@dataclass(frozen=True, kw_only=True, slots=True)
class RunStats(Record):
    """What a run read, wrote and used: the manifest's `stats` and part of the run summary."""

    mode: str
    """`direct` or `staged`."""
    mode_reason: str
    source_bytes_read: int
    """Bytes read from the checkpoint's files: metadata, copies, and the CRC checks' gaps."""
    source_bytes_needed: int
    intermediate_bytes_written: int
    output_bytes_written: int
    bytes_read: int
    """Every byte the stages read: source, intermediates, and the outputs verified."""
    bytes_written: int
    """Intermediates plus output shards."""
    fp32_bytes: int
    rss_growth_bytes_by_stage: dict[str, int] = field(default_factory=dict)
    """Each stage's own peak: the most one of its tasks raised the worker's RSS (measured by
    the flow's tasks; empty from the sequential driver and when every task was cached)."""
    rss_baseline_bytes: int = 0
    tasks_executed: dict[str, int] = field(default_factory=dict)
    """Tasks of each stage that ran (not cached, not reused)."""
    peak_rss_bytes: int = 0
    """The process's lifetime peak RSS (`ru_maxrss`); with several workers, the largest."""
    seconds: float = 0.0
    """Seconds from the start of the run to publishing."""
    source_read_ratio: float | None = field(default=None, metadata=json_meta(omit_default=True))
    """`source_bytes_read / source_bytes_needed` (1.0 is the least possible)."""


def _integrity_json(report: IntegrityReport | None) -> JsonObject:
    return report.to_json() if report is not None else {}


def _integrity_from_json(data: object) -> IntegrityReport | None:
    return IntegrityReport.from_json(data) if data else None


INTEGRITY_JSON = json_meta(encode=_integrity_json, decode=_integrity_from_json, absent=None)
"""An optional `IntegrityReport` field, `{}` in JSON where there is none."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PublishResult(Record):
    """A verified output published: the marker is written."""

    files: tuple[str, ...]
    num_tensors: int
    integrity: IntegrityReport
    """What the CRC checks covered."""
    stats: RunStats
    """The run's stats as the manifest records them (with the bytes the CRC checks read)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RunSummary(Record):
    """What a run did: the same from the flow and from the sequential driver.

    `to_json()` is what `zerosafe convert --json` prints and the flow returns: the fields
    below with `stats` flattened in (before `seconds`), or only the first three when there was
    nothing to do.
    """

    status: Literal["converted", "already-complete"]
    output: str
    job_key: str
    files: tuple[str, ...] = ()
    num_tensors: int = 0
    aliases: dict[str, str] = field(default_factory=dict)
    integrity: IntegrityReport | None = field(default=None, metadata=INTEGRITY_JSON)
    """What the CRC checks covered (`{}` in JSON where nothing says)."""
    notes: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    checks_passed: int = 0
    """Tensors verified."""
    stats: RunStats | None = field(default=None, metadata=json_meta(skip=True))
    """None when there was nothing to do."""
    seconds: float = 0.0
    throughput_bytes_per_second: int = 0
    """Source bytes read per second of the whole run."""

    @classmethod
    def already_complete(cls, output: str, job_key: str) -> RunSummary:
        return cls(status="already-complete", output=output, job_key=job_key)

    def to_json(self) -> JsonObject:
        fields = to_json(self)
        if self.stats is None:
            return {k: fields[k] for k in ("status", "output", "job_key")}
        tail = {k: fields.pop(k) for k in ("seconds", "throughput_bytes_per_second")}
        return {**fields, **self.stats.to_json(), **tail}

    @classmethod
    def from_json(cls, data: object) -> RunSummary:
        summary = from_json(cls, data)
        if summary.status != "converted":
            return cls.already_complete(summary.output, summary.job_key)
        return replace(summary, stats=RunStats.from_json(data))
