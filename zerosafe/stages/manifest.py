"""The output folder's records: the manifest (`zerosafe-manifest.json`) and the completion
marker (`zerosafe-complete.json`), as `zerosafe.stages.output.publish` writes them and every
later run, `zerosafe verify` and `zerosafe clean` read them back.

Their JSON is derived from the fields (`zerosafe.records`) in the order below, the keys and
order manifests always had. Manifests written by earlier versions lack some keys (the files'
`version` and `sha256`, the model files, `keep_work`): those read as the values the code
always took for them, so an older output is still recognised, repaired or verified.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from zerosafe.formats.base import SourceDescription
from zerosafe.formats.crc import IntegrityReport
from zerosafe.records import JsonObject, Record, json_meta
from zerosafe.stages.results import INTEGRITY_JSON, RunStats, TensorRecords

__all__ = [
    "MANIFEST_FORMAT",
    "Checks",
    "IndexEntry",
    "LowpCheck",
    "Manifest",
    "Marker",
    "ModelFileEntry",
    "PublishedFile",
    "ShardEntry",
]

MANIFEST_FORMAT = 1


@dataclass(frozen=True, kw_only=True, slots=True)
class ShardEntry(Record):
    """One weight file as published (`files`)."""

    file: str
    size_bytes: int
    data_bytes: int
    version: str | None = field(metadata=json_meta(absent=None))
    """mtime or ETag as published: a later run sees a file changed in place."""
    sha256: str | None = field(default=None, metadata=json_meta(omit_default=True))
    """The whole file's SHA-256, with `file_sha256`."""


@dataclass(frozen=True, kw_only=True, slots=True)
class IndexEntry(Record):
    """`model.safetensors.index.json` as published (`index`, with several shards)."""

    file: str
    size_bytes: int
    version: str | None = field(metadata=json_meta(absent=None))


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelFileEntry(Record):
    """A model file (config, tokenizer) copied or made (`model_files`)."""

    file: str
    size_bytes: int
    sha256: str | None = field(metadata=json_meta(absent=None))
    source: str | None = field(metadata=json_meta(absent=None))
    """The file it was copied from; None for a config made from the checkpoint."""
    source_size_bytes: int | None = field(metadata=json_meta(absent=None))
    source_version: str | None = field(metadata=json_meta(absent=None))
    version: str | None = field(default=None, metadata=json_meta(omit_default=True))
    """The copy's mtime or ETag as published (set by publish, after the move)."""


PublishedFile = ShardEntry | IndexEntry | ModelFileEntry
"""A file of the output whose size and version the manifest records."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LowpCheck(Record):
    """The optional 16-bit cross-check of an output (`zerosafe.verify.output.lowp_report`)."""

    file: str = "*"
    check: str = "lowp"
    lowp_checked: int
    lowp_mismatched: int
    lowp_skipped: str | None
    """Why some 16-bit copies were not compared (None when all were)."""
    failures: tuple[dict[str, str], ...] = ()


@dataclass(frozen=True, kw_only=True, slots=True)
class LowpCounts(Record):
    lowp_checked: int
    lowp_mismatched: int
    lowp_skipped: str | None


@dataclass(frozen=True, kw_only=True, slots=True)
class Checks(Record):
    """What verification covered (`checks`)."""

    verified_tensors: int = field(metadata=json_meta(absent=0))
    lowp_cross_check: LowpCounts | None = field(default=None, metadata=json_meta(omit_default=True))


def _source_json(source: SourceDescription | None) -> JsonObject:
    return dict(source.to_json()) if source is not None else {}


def _source_from_json(block: object) -> SourceDescription | None:
    return SourceDescription.from_json(block) if isinstance(block, dict) and block else None


def _stats_json(stats: RunStats | None) -> JsonObject:
    return stats.to_json() if stats is not None else {}


def _stats_from_json(data: object) -> RunStats | None:
    return RunStats.from_json(data) if data else None


@dataclass(frozen=True, kw_only=True, slots=True)
class Manifest(Record):
    """`zerosafe-manifest.json`: what an output holds and how it was converted."""

    manifest_format: int = field(metadata=json_meta(absent=MANIFEST_FORMAT))
    zerosafe_version: str = field(metadata=json_meta(absent=""))
    job_key: str | None = field(metadata=json_meta(absent=None))
    created_at: str = field(metadata=json_meta(absent=""))
    source: SourceDescription | None = field(
        metadata=json_meta(absent=None, encode=_source_json, decode=_source_from_json)
    )
    options: dict[str, Any] = field(metadata=json_meta(absent={}))
    """The job key's options (`ConvertOptions.identity`) and `direct`."""
    keep_work: bool = field(metadata=json_meta(absent=True))
    files: tuple[ShardEntry, ...] = field(metadata=json_meta(absent=()))
    total_size: int = field(metadata=json_meta(absent=0))
    index: IndexEntry | None = field(default=None, metadata=json_meta(omit_default=True))
    tensors: TensorRecords = field(metadata=json_meta(absent={}))
    """Tensor name -> its record (checksum, dtype, shape, ...) with its `file` and `role`."""
    aliases: dict[str, str] = field(metadata=json_meta(absent={}))
    model_files_from: str | None = field(metadata=json_meta(absent=None))
    model_files: tuple[ModelFileEntry, ...] = field(metadata=json_meta(absent=()))
    integrity: IntegrityReport | None = field(metadata=INTEGRITY_JSON)
    """What the CRC checks covered."""
    checks: Checks = field(metadata=json_meta(absent=Checks(verified_tensors=0)))
    notes: tuple[str, ...] = field(metadata=json_meta(absent=()))
    warnings: tuple[str, ...] = field(metadata=json_meta(absent=()))
    stats: RunStats | None = field(
        metadata=json_meta(absent=None, encode=_stats_json, decode=_stats_from_json)
    )

    @property
    def file_names(self) -> tuple[str, ...]:
        """The weight files, in shard order."""
        return tuple(f.file for f in self.files)


@dataclass(frozen=True, kw_only=True, slots=True)
class Marker(Record):
    """`zerosafe-complete.json`, written last: it vouches for the manifest by its hash."""

    job_key: str | None = field(metadata=json_meta(absent=None))
    manifest_sha256: str | None = field(metadata=json_meta(absent=None))
    completed_at: str | None = field(metadata=json_meta(absent=None))
    zerosafe_version: str | None = field(metadata=json_meta(absent=None))
