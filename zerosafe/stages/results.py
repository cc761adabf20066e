"""What each step of a job decides or produces, as frozen dataclasses.

`JobPlan` is what inspect decides (the output's state, the job key, the work area, and per
extract part and output shard the bytes and dependencies the scheduler needs). `ExtractResult`,
`MergeResult` and `VerifyResult` are the results of one unit of work of a stage,
`PublishResult` of publishing, and `RunSummary` of the whole run, with `RunStats` (bytes,
memory, tasks) as written into the manifest.

The engine's lifecycle functions (`zerosafe.pipeline`) pass these between each other. Only
the Prefect tasks turn them into JSON-able dicts (`to_json`, `from_json`), at the task edge,
where results are cached and shipped between processes. The JSON keys are the ones task
results and run summaries always had, so results cached by an earlier run still resume.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from zerosafe.formats.base import SourceDescription

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
class PartWork:
    """One extract part (staged mode), as the scheduler sees it."""

    index: int
    rank: int
    label: str
    """The part's number among its rank's parts (shown in the task run name)."""
    size_bytes: int


@dataclass(frozen=True, kw_only=True, slots=True)
class ShardWork:
    """One output shard, as the scheduler sees it."""

    index: int
    file_name: str
    data_bytes: int
    """Tensor bytes the shard holds (what verify reads)."""
    source_bytes: int
    """Bytes its merge reads."""
    parts: tuple[int, ...]
    """The extract parts (staged mode) its merge reads: it waits for these."""


@dataclass(frozen=True, kw_only=True, slots=True)
class JobPlan:
    """What inspect decided: whether there is anything to do, and the units of work."""

    state: str
    """The output folder's state (`zerosafe.stages.output.OutputState.kind`): `done` means
    it already holds this conversion; `empty` or `partial` mean convert (or resume)."""
    job_key: str
    destination: str
    work_url: str = ""
    """The job's work area (plan, intermediates, results, journal); empty when `done`."""
    source: SourceDescription | None = None
    """The plan's source description (checkpoint, tag, format details); None when `done`.
    Its JSON leaves out the file list."""
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

    def to_json(self) -> dict[str, Any]:
        return {
            "state": self.state,
            "job_key": self.job_key,
            "destination": self.destination,
            "work": self.work_url,
            "source": self.source.to_json(with_files=False) if self.source else {},
            "reader": self.source.reader_json() if self.source else {},
            "parts": [
                {"index": p.index, "rank": p.rank, "label": p.label, "bytes": p.size_bytes}
                for p in self.parts
            ],
            "shards": [
                {
                    "index": s.index,
                    "file": s.file_name,
                    "bytes": s.data_bytes,
                    "source_bytes": s.source_bytes,
                    "parts": list(s.parts),
                }
                for s in self.shards
            ],  # fmt: skip
            "aliases": self.aliases,
            "notes": list(self.notes),
            "warnings": list(self.warnings),
            "fp32_bytes": self.fp32_bytes,
            "metadata_bytes_read": self.metadata_bytes_read,
            "source_bytes_needed": self.source_bytes_needed,
            "task_memory_bytes": self.task_memory_bytes,
            "serial_merges": self.serial_merges,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> JobPlan:
        return cls(
            state=data["state"],
            job_key=data["job_key"],
            destination=data.get("destination", ""),
            work_url=data.get("work", ""),
            source=SourceDescription.from_json(data["source"], data.get("reader"))
            if data.get("source")
            else None,
            parts=tuple(
                PartWork(index=p["index"], rank=p["rank"], label=p["label"], size_bytes=p["bytes"])
                for p in data.get("parts", [])
            ),
            shards=tuple(
                ShardWork(
                    index=s["index"],
                    file_name=s["file"],
                    data_bytes=s["bytes"],
                    source_bytes=s["source_bytes"],
                    parts=tuple(s["parts"]),
                )
                for s in data.get("shards", [])
            ),  # fmt: skip
            aliases=dict(data.get("aliases", {})),
            notes=tuple(data.get("notes", ())),
            warnings=tuple(data.get("warnings", ())),
            fp32_bytes=data.get("fp32_bytes", 0),
            metadata_bytes_read=data.get("metadata_bytes_read", 0),
            source_bytes_needed=data.get("source_bytes_needed", 0),
            task_memory_bytes=data.get("task_memory_bytes", 0),
            serial_merges=data.get("serial_merges", ""),
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class ExtractResult:
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
    seconds: float

    def to_json(self) -> dict[str, Any]:
        return {
            "part": self.part, "rank": self.rank, "file": self.file,
            "file_bytes": self.file_bytes, "bytes_read": self.bytes_read,
            "content_sha256": self.content_sha256, "ledger": self.ledger, "seconds": self.seconds,
        }  # fmt: skip

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ExtractResult:
        return cls(
            part=data["part"], rank=data["rank"], file=data["file"],
            file_bytes=data["file_bytes"], bytes_read=data["bytes_read"],
            content_sha256=data["content_sha256"], ledger=data["ledger"],
            seconds=data.get("seconds", 0.0),
        )  # fmt: skip


@dataclass(frozen=True, kw_only=True, slots=True)
class MergeResult:
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
    seconds: float
    reused: bool = False
    """A repair kept the published shard: nothing was read or written."""

    def to_json(self) -> dict[str, Any]:
        out = {
            "shard": self.shard, "file": self.file, "file_bytes": self.file_bytes,
            "data_bytes": self.data_bytes, "bytes_read": self.bytes_read,
            "tensors": self.tensors, "ledger": self.ledger, "seconds": self.seconds,
        }  # fmt: skip
        return {**out, "reused": True} if self.reused else out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> MergeResult:
        return cls(
            shard=data["shard"], file=data["file"], file_bytes=data["file_bytes"],
            data_bytes=data["data_bytes"], bytes_read=data["bytes_read"],
            tensors=data["tensors"], ledger=data["ledger"], seconds=data.get("seconds", 0.0),
            reused=bool(data.get("reused", False)),
        )  # fmt: skip


@dataclass(frozen=True, kw_only=True, slots=True)
class VerifyResult:
    """One shard checked by the independent reader (`zerosafe.verify.tensors`)."""

    shard: int
    file: str
    num_tensors: int
    tensors: TensorRecords
    metadata: dict[str, str]
    failures: tuple[dict[str, str], ...]
    """`{file, tensor, check, detail}` per failed check (`zerosafe.verify.tensors.Failure`)."""
    bytes_read: int
    seconds: float
    sha256: str | None = None
    """SHA-256 of the whole file as re-read, with `file_sha256` on (publish records it)."""

    @property
    def ok(self) -> bool:
        return not self.failures

    def to_json(self) -> dict[str, Any]:
        out = {
            "file": self.file, "ok": self.ok, "num_tensors": self.num_tensors,
            "tensors": self.tensors, "metadata": self.metadata,
            "failures": list(self.failures), "bytes_read": self.bytes_read,
            "shard": self.shard, "seconds": self.seconds,
        }  # fmt: skip
        return {**out, "sha256": self.sha256} if self.sha256 is not None else out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> VerifyResult:
        return cls(
            shard=data["shard"], file=data["file"], num_tensors=data["num_tensors"],
            tensors=data["tensors"], metadata=data.get("metadata", {}),
            failures=tuple(data.get("failures", ())), bytes_read=data.get("bytes_read", 0),
            seconds=data.get("seconds", 0.0), sha256=data.get("sha256"),
        )  # fmt: skip


@dataclass(frozen=True, kw_only=True, slots=True)
class RunStats:
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
    source_read_ratio: float | None = None
    """`source_bytes_read / source_bytes_needed` (1.0 is the least possible)."""

    def to_json(self) -> dict[str, Any]:
        out = {
            "mode": self.mode, "mode_reason": self.mode_reason,
            "source_bytes_read": self.source_bytes_read,
            "source_bytes_needed": self.source_bytes_needed,
            "intermediate_bytes_written": self.intermediate_bytes_written,
            "output_bytes_written": self.output_bytes_written,
            "bytes_read": self.bytes_read, "bytes_written": self.bytes_written,
            "fp32_bytes": self.fp32_bytes,
            "rss_growth_bytes_by_stage": self.rss_growth_bytes_by_stage,
            "rss_baseline_bytes": self.rss_baseline_bytes,
            "tasks_executed": self.tasks_executed, "peak_rss_bytes": self.peak_rss_bytes,
            "seconds": self.seconds,
        }  # fmt: skip
        if self.source_read_ratio is not None:
            out["source_read_ratio"] = self.source_read_ratio
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RunStats:
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})


@dataclass(frozen=True, kw_only=True, slots=True)
class PublishResult:
    """A verified output published: the marker is written."""

    files: tuple[str, ...]
    num_tensors: int
    integrity: dict[str, Any]
    """What the CRC checks covered (`zerosafe.formats.crc.LedgerCheck.as_dict`)."""
    stats: RunStats
    """The run's stats as the manifest records them (with the bytes the CRC checks read)."""

    def to_json(self) -> dict[str, Any]:
        return {
            "files": list(self.files),
            "num_tensors": self.num_tensors,
            "integrity": self.integrity,
            "stats": self.stats.to_json(),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> PublishResult:
        return cls(
            files=tuple(data["files"]),
            num_tensors=data["num_tensors"],
            integrity=data["integrity"],
            stats=RunStats.from_json(data["stats"]),
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class RunSummary:
    """What a run did: the same from the flow and from the sequential driver.

    `to_json()` is what `zerosafe convert --json` prints and the flow returns: the fields
    below with `stats` flattened in.
    """

    status: Literal["converted", "already-complete"]
    output: str
    job_key: str
    files: tuple[str, ...] = ()
    num_tensors: int = 0
    aliases: dict[str, str] = field(default_factory=dict)
    integrity: dict[str, Any] = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    checks_passed: int = 0
    """Tensors verified."""
    stats: RunStats | None = None
    """None when there was nothing to do."""
    seconds: float = 0.0
    throughput_bytes_per_second: int = 0
    """Source bytes read per second of the whole run."""

    @classmethod
    def already_complete(cls, output: str, job_key: str) -> RunSummary:
        return cls(status="already-complete", output=output, job_key=job_key)

    def to_json(self) -> dict[str, Any]:
        head: dict[str, Any] = {
            "status": self.status,
            "output": self.output,
            "job_key": self.job_key,
        }
        if self.stats is None:
            return head
        return {
            **head,
            "files": list(self.files), "num_tensors": self.num_tensors,
            "aliases": self.aliases, "integrity": self.integrity, "notes": list(self.notes),
            "warnings": list(self.warnings), "checks_passed": self.checks_passed,
            **self.stats.to_json(),
            "seconds": self.seconds,
            "throughput_bytes_per_second": self.throughput_bytes_per_second,
        }  # fmt: skip

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RunSummary:
        if data["status"] != "converted":
            return cls.already_complete(data["output"], data["job_key"])
        return cls(
            status="converted", output=data["output"], job_key=data["job_key"],
            files=tuple(data["files"]), num_tensors=data["num_tensors"],
            aliases=dict(data.get("aliases", {})), integrity=data.get("integrity", {}),
            notes=tuple(data.get("notes", ())), warnings=tuple(data.get("warnings", ())),
            checks_passed=data.get("checks_passed", 0), stats=RunStats.from_json(data),
            seconds=data.get("seconds", 0.0),
            throughput_bytes_per_second=data.get("throughput_bytes_per_second", 0),
        )  # fmt: skip
