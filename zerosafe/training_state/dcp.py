"""`zerosafe convert CKPT OUT --to dcp`: the model and Adam state of a ZeRO checkpoint as a
PyTorch DCP checkpoint, written as restartable units in bounded memory, verified, and
published with `.metadata` written last but for zerosafe's marker.

What torch 2.13's `FileSystemWriter` writes (`torch/distributed/checkpoint/filesystem.py`,
`metadata.py`), and so what this writes:

- `OUT/__<n>_0.distcp`: items one after another; a tensor item is a whole `torch.save` archive
  of the tensor (`zerosafe.training_state.torch_save`, its data streamed from the source runs
  in chunks of `chunk_bytes`), a bytes item a `torch.save` archive of the value. Here each
  unit of work (about `unit_bytes` of tensors) writes one file, `n` its index.
- `OUT/.metadata`: a pickled `Metadata`: `state_dict_metadata` (each flattened key: a
  `TensorStorageMetadata` with one chunk, the whole tensor, or a `BytesStorageMetadata`),
  `planner_data` (each key's path in the nested dict), `storage_data` (`MetadataIndex` ->
  `_StorageInfo(relative_path, offset, length)`), `storage_meta`, `version` `1.0.0`. The
  dataclasses are torch's own (torch is imported here only to pickle them; no source is ever
  loaded with torch). A tied alias's index points at its param's bytes.

The lifecycle: plan (`zerosafe.training_state.dcp_plan`); remove any `.metadata` (so a rerun
never shows an old index beside new files); units, each recorded with what it wrote and kept
on a rerun when its file is intact (with `--overwrite`, none is); verify (every source record
read against its zip CRC-32; every item re-read from the written file with zerosafe's
restricted reader: its pickle must be the expected tensor or value, its data record's CRC-32
the one recorded while writing; a unit whose file fails is dropped, so the next run redoes
it); then `.metadata`, then `OUT/zerosafe-dcp-complete.json`, last.
"""

from __future__ import annotations

import pickle
import struct
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Unpack

import numpy as np

from zerosafe.dtypes import dtype_info
from zerosafe.errors import OutputExistsError, VerificationError
from zerosafe.formats.torch_pickle import TensorRecord
from zerosafe.formats.torch_zip import TorchZipFile
from zerosafe.io.storage import (
    ByteSource,
    Sink,
    Storage,
    is_local,
    join_url,
    normalize_url,
)
from zerosafe.run.unit_records import fingerprint
from zerosafe.stages.destination import DCP_MARKER_NAME as MARKER_NAME
from zerosafe.stages.destination import DCP_METADATA_NAME as METADATA_NAME
from zerosafe.stages.destination import clear_dcp_output
from zerosafe.targets.base import StateKwargs, StateOptions, StateSummary, UnitSpec, UnitWork
from zerosafe.targets.lifecycle import WORK_DIR_NAME, read_marker, run_target
from zerosafe.training_state.client_files import carry_client_files, check_carried
from zerosafe.training_state.dcp_plan import DcpItem, DcpPlan, plan_dcp
from zerosafe.training_state.streams import SourcesOfPlan, UnitJob, record_crc, to_float32
from zerosafe.training_state.torch_save import TensorOut, TorchZipWriter, pickle_bytes

__all__ = [
    "MARKER_NAME",
    "DcpSummary",
    "DcpTarget",
    "convert_to_dcp",
    "is_dcp_output",
    "verify_dcp_output",
]

DCP_VERSION = "1.0.0"
DEFAULT_CHUNK_BYTES = 8 << 20
"""The chunk `verify OUT` re-reads an item in."""


@dataclass(kw_only=True)
class DcpSummary(StateSummary):
    """What a `--to dcp` run did."""

    num_items: int


class _Window:
    """The part of a sink one archive is written into: offsets count from its start."""

    def __init__(self, sink: Sink) -> None:
        self._sink = sink
        self.url = sink.url
        self.bytes_written = 0

    def write(self, data: bytes | memoryview) -> None:
        self._sink.write(data)
        self.bytes_written += memoryview(data).nbytes

    def commit(self) -> None:  # the file is committed by its owner
        pass

    def abort(self) -> None:
        pass


class _Slice:
    """Bytes `[offset, offset + length)` of a source, as a source of its own."""

    def __init__(self, source: ByteSource, offset: int, length: int) -> None:
        self._source = source
        self._offset = offset
        self.url = f"{source.url}@{offset}"
        self.size_bytes = length

    def read_range(self, start: int, end: int) -> bytes:
        if end > self.size_bytes:
            raise VerificationError(f"{self.url}: read past the item's {self.size_bytes} bytes")
        return self._source.read_range(self._offset + start, self._offset + end)

    def readinto_at(self, offset: int, buf: memoryview) -> None:
        buf[:] = self.read_range(offset, offset + len(buf))

    def close(self) -> None:
        pass


def _float32_bytes(value: Any) -> bytes:
    return struct.pack("<f", float(value))


@dataclass(kw_only=True)
class _Job(UnitJob):
    """One unit's writer (`UnitJob`: its own sources, counts and ledger)."""

    plan: DcpPlan

    def _step_bytes(self, small: Any) -> bytes:
        if not isinstance(small, TensorRecord):
            return _float32_bytes(small)
        raw = self.read_small(small)
        if small.dtype == "float32":
            return raw
        return _float32_bytes(np.frombuffer(raw, np.dtype(small.dtype))[0])

    def _chunks(self, item: DcpItem) -> Iterator[tuple[bytes, int | None]]:
        if item.small is not None:
            yield self._step_bytes(item.small), None
            return
        chunks = self.chunks(item.runs, dtype_info(item.src_dtype).itemsize)
        if item.src_dtype == item.dtype:
            yield from chunks
        else:
            for data, _ in chunks:
                yield to_float32(data, item.src_dtype), None

    def write_unit(self, index: int, items: list[DcpItem]) -> dict[str, Any]:
        """`__<index>_0.distcp`: each item's archive in turn; returns what was written."""
        name = f"__{index}_0.distcp"
        rel = f"{items[0].folder}/{name}" if items[0].folder else name
        sink = self.storage.open_sink(join_url(self.out_url, rel))
        entries = []
        offset = 0
        try:
            for item in items:
                window = _Window(sink)
                writer = TorchZipWriter(sink=window)
                crc = None
                if item.kind == "bytes":
                    writer.add_preamble(pickle_bytes(item.value))
                else:
                    tensor = TensorOut(key="0", dtype=item.dtype, shape=item.shape)
                    writer.add_preamble(pickle_bytes(tensor))
                    writer.begin("data/0", size_bytes=item.nbytes)
                    for chunk, chunk_crc in self._chunks(item):
                        writer.write(chunk, crc32=chunk_crc)
                    crc = writer.end()
                writer.close()
                entries.append({"fqn": item.fqn, "offset": offset,
                                "length": writer.bytes_written, "crc32": crc})  # fmt: skip
                offset += writer.bytes_written
            sink.commit()
        except BaseException:
            sink.abort()
            raise
        self.bytes_written += offset
        return {"path": rel, "size_bytes": offset, "items": entries}


def _units(plan: DcpPlan, unit_bytes: int) -> list[list[DcpItem]]:
    """Items in order, each unit about `unit_bytes` (a larger tensor alone); the bytes items
    and aliases cost nothing and ride along."""
    units: list[list[DcpItem]] = []
    current: list[DcpItem] = []
    filled = 0
    for item in plan.items:
        if item.same_as is not None:
            continue
        size = item.nbytes if item.kind == "tensor" else 0
        if current and ((size and filled + size > unit_bytes) or item.folder != current[0].folder):
            units.append(current)
            current, filled = [], 0
        current.append(item)
        filled += size
    if current:
        units.append(current)
    return units


def _verify_file(
    storage: Storage,
    out_url: str,
    by_fqn: dict[str, DcpItem],
    f: Mapping[str, Any],
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> None:
    """Re-read every item of one written file (module docstring).

    Raises:
        VerificationError: Naming the file, the item and what differs.
    """
    url = join_url(out_url, f["path"])
    source = storage.open_source(url)
    try:
        if source.size_bytes != f["size_bytes"]:
            raise VerificationError(f"{url}: {source.size_bytes} bytes, {f['size_bytes']} written")
        for e in f["items"]:
            _verify_item(_Slice(source, e["offset"], e["length"]), by_fqn[e["fqn"]], e, chunk_bytes)
    finally:
        source.close()


def _verify_item(source: _Slice, item: DcpItem, entry: dict[str, Any], chunk_bytes: int) -> None:
    where = f"{source.url} ({item.fqn})"
    zf = TorchZipFile(source)
    obj = zf.load()
    if item.kind == "bytes":
        if obj != item.value or type(obj) is not type(item.value):
            raise VerificationError(f"{where}: reads back as {obj!r:.200}, not {item.value!r}")
        return
    if not (
        isinstance(obj, TensorRecord)
        and obj.dtype == item.dtype
        and tuple(obj.shape) == item.shape
        and obj.is_contiguous()
        and obj.storage_offset == 0
    ):
        raise VerificationError(
            f"{where}: expected a {item.dtype} tensor of shape {list(item.shape)}, "
            f"found {obj!r:.200}"
        )
    record = zf.storage_record("0")
    crc = record_crc(source, zf.data_offset(record), record.size_bytes, chunk_bytes)
    if not (record.size_bytes == item.nbytes and record.crc32 == entry["crc32"] == crc):
        raise VerificationError(
            f"{where}: data reads back with CRC-32 {crc:08x} ({record.size_bytes} bytes); the zip "
            f"directory says {record.crc32:08x} and {entry['crc32']:08x} was recorded while "
            "writing it"
        )


def metadata_bytes(
    plan: DcpPlan, files: list[dict[str, Any]], out_url: str, folder: str = ""
) -> bytes:
    """`.metadata` of the DCP checkpoint in `folder`: torch's own `Metadata` dataclasses,
    pickled as `FileSystemWriter` does."""
    import torch
    from torch.distributed.checkpoint import filesystem as fs
    from torch.distributed.checkpoint import metadata as md

    stored = {e["fqn"]: (f["path"], e) for f in files for e in f["items"]}
    state: dict[str, Any] = {}
    planner: dict[str, tuple[str | int, ...]] = {}
    storage_data: dict[Any, Any] = {}
    for item in plan.items:
        if item.folder != folder:
            continue
        path, e = stored[item.same_as or item.fqn]  # relative to the checkpoint's own folder
        info = fs._StorageInfo(path.rsplit("/", 1)[-1], e["offset"], e["length"])
        planner[item.fqn] = item.path
        if item.kind == "bytes":
            state[item.fqn] = md.BytesStorageMetadata()
            storage_data[md.MetadataIndex(item.fqn)] = info
            continue
        size = torch.Size(item.shape)
        zeros = torch.Size([0] * len(item.shape))
        state[item.fqn] = md.TensorStorageMetadata(
            properties=md.TensorProperties(dtype=getattr(torch, item.dtype)),
            size=size,
            chunks=[md.ChunkStorageMetadata(offsets=zeros, sizes=size)],
        )
        storage_data[md.MetadataIndex(item.fqn, zeros, 0)] = info
    metadata = md.Metadata(
        state_dict_metadata=state, planner_data=planner, storage_data=storage_data,
        storage_meta=md.StorageMeta(
            checkpoint_id=join_url(out_url, folder) if folder else out_url, save_id=plan.job_key
        ),
        version=DCP_VERSION,
    )  # fmt: skip
    return pickle.dumps(metadata)


class DcpTarget(SourcesOfPlan):
    """`--to dcp` as an `OutputTarget` (`zerosafe.targets.base`): its plan, units, unit
    writer, item check and `.metadata`; `zerosafe.targets.lifecycle` runs it."""

    name: Literal["dcp"] = "dcp"
    marker_name = MARKER_NAME
    label = "DCP checkpoint"

    def __init__(
        self, storage: Storage, ckpt_url: str, *, tag: str | None = None, layout: str = "torch"
    ) -> None:
        super().__init__()
        self.plan = plan_dcp(storage, ckpt_url, tag=tag, layout=layout)
        self.job_key = self.plan.job_key
        self.source_url = self.plan.universal.ckpt.ckpt_url
        self.notes = self.plan.notes
        self.urls, self.records = self.plan.urls, self.plan.records
        self.small_zip = self.plan.universal.ckpt.optim_files[0].zip
        self._by_fqn = {i.fqn: i for i in self.plan.items}

    def _metadata_urls(self, out_url: str) -> list[str]:
        return [
            join_url(out_url, f, METADATA_NAME) if f else join_url(out_url, METADATA_NAME)
            for f in self.plan.folders
        ]

    def prepare(
        self, storage: Storage, out_url: str, marker: Mapping[str, Any] | None, *, overwrite: bool
    ) -> bool:
        """True when `marker` is this conversion's and every `.metadata` is there. Otherwise
        remove an old `.metadata` before any unit writes (a rerun never shows an old index
        beside new files).

        Raises:
            OutputExistsError: A DCP checkpoint zerosafe did not write is there (no marker, no
                work area) and `overwrite` is not set.
        """
        metadata_urls = self._metadata_urls(out_url)
        if marker is not None:
            if all(map(storage.exists, metadata_urls)):
                return True
        elif not storage.exists(join_url(out_url, WORK_DIR_NAME)):
            found = [u for u in metadata_urls if storage.exists(u)]
            if found and not overwrite:
                raise OutputExistsError(
                    f"{found[0]}: a DCP checkpoint zerosafe did not write (no {MARKER_NAME}); "
                    "choose another output folder or pass --overwrite"
                )
        for url in metadata_urls:
            if storage.exists(url):
                storage.remove(url)
        return False

    def clear(self, storage: Storage, out_url: str) -> None:
        clear_dcp_output(storage, out_url)

    def units(self, unit_bytes: int) -> Sequence[UnitSpec]:
        return [
            UnitSpec(index=index, kind="items", members=tuple(items),
                     fingerprint=fingerprint([i.fqn for i in items]))
            for index, items in enumerate(_units(self.plan, unit_bytes))
        ]  # fmt: skip

    def write_unit(
        self, storage: Storage, out_url: str, unit: UnitSpec, chunk_bytes: int
    ) -> UnitWork:
        job = _Job(plan=self.plan, **self.unit_job(storage, out_url, chunk_bytes))
        try:
            written = job.write_unit(unit.index, list(unit.members))
        finally:
            job.sources.close()
        return job.done([written])

    def check_file(
        self, storage: Storage, out_url: str, file: Mapping[str, Any], chunk_bytes: int
    ) -> None:
        _verify_file(storage, out_url, self._by_fqn, file, chunk_bytes=chunk_bytes)

    def temp_folders(self, storage: Storage, out_url: str) -> list[str]:
        folders = [join_url(out_url, f) if f else out_url for f in self.plan.folders]
        return [f for f in folders if is_local(f) and storage.isdir(f)]

    def publish(
        self, storage: Storage, out_url: str, files: list[dict[str, Any]], chunk_bytes: int
    ) -> dict[str, Any]:
        """The client's files, then each folder's `.metadata`; the marker (returned, holding
        the manifest) goes last."""
        plan, u = self.plan, self.plan.universal
        carried = carry_client_files(
            storage, u.ckpt.ckpt_url, u.client_files, out_url, chunk_bytes=chunk_bytes
        )
        if problems := check_carried(storage, out_url, carried):
            raise VerificationError(problems[0]["error"])
        manifest = {"format": "torch-dcp", "layout": plan.layout, "folders": plan.folders,
                    "job_key": plan.job_key, "files": files,
                    "client_files": carried}  # fmt: skip
        for folder in plan.folders:
            where = join_url(out_url, folder) if folder else out_url
            storage.write_bytes(
                join_url(where, METADATA_NAME), metadata_bytes(plan, files, out_url, folder)
            )
        return {"job_key": plan.job_key, "source": {
            "checkpoint": u.ckpt.ckpt_url, "tag": u.tag, "stage": u.stage,
            "world_size": u.world_size}, **manifest, "notes": plan.notes}  # fmt: skip

    def summary(self, status: str, output: str) -> DcpSummary:
        u = self.plan.universal
        return DcpSummary(
            status=status, output=output, num_params=len(u.params),
            num_items=len(self.plan.items), masters_bytes=u.masters_bytes,
            moments_bytes=u.moments_bytes, notes=list(self.plan.notes),
        )  # fmt: skip


def convert_to_dcp(
    ckpt_url: str,
    out_url: str,
    *,
    tag: str | None = None,
    storage: Storage | None = None,
    layout: str = "torch",
    **options: Unpack[StateKwargs],
) -> DcpSummary:
    """Write the DCP checkpoint of a ZeRO checkpoint's model and Adam state into `out_url`;
    an FSDP2 run of the same module loads it with `dcp.load` + `set_state_dict`
    (docs/training-state.md). `layout`: `torch` (one checkpoint of `{"model", "optim"}`) or
    `accelerate` (`pytorch_model_fsdp_0/` and `optimizer_0/`, as accelerate saves FSDP2).
    `options`: `StateOptions`' fields, as for `convert_to_universal`.

    Raises:
        UnsupportedCheckpointError: What is not converted yet, named in one line.
        ConfigError: `out_url` is the checkpoint folder, inside it or holds it.
        LeaseHeldError: Another run converts into `out_url` now.
        OutputExistsError: `out_url` holds another DCP checkpoint, or another kind's output
            (`zerosafe.stages.destination`), and `overwrite` is not set.
        VerificationError: A written item failed its check; its unit was dropped, so the
            next run redoes it.
    """
    storage = storage or Storage()
    summary = run_target(
        "dcp", lambda: DcpTarget(storage, ckpt_url, tag=tag, layout=layout), ckpt_url, out_url,
        StateOptions(**options), storage=storage,
    )  # fmt: skip
    assert isinstance(summary, DcpSummary)
    return summary


def is_dcp_output(storage: Storage, out_url: str) -> bool:
    """Whether `out_url` holds a complete `--to dcp` output (its marker)."""
    return storage.exists(join_url(normalize_url(out_url), MARKER_NAME))


def verify_dcp_output(out_url: str, *, storage: Storage | None = None) -> dict[str, Any]:
    """`zerosafe verify OUT` of a `--to dcp` output: every `.distcp` file the marker lists
    present with its size, every item's data record against the CRC-32 recorded when written.

    Returns:
        `{"ok", "output", "num_files", "num_items", "failures": [{"file", "error"}]}`.
    """
    storage = storage or Storage()
    out_url = normalize_url(out_url)
    marker = read_marker(storage, join_url(out_url, MARKER_NAME))
    failures = []
    for folder in marker.get("folders", [""]):
        rel = f"{folder}/{METADATA_NAME}" if folder else METADATA_NAME
        if not storage.exists(join_url(out_url, rel)):
            failures.append({"file": rel, "error": "missing"})
    items = 0
    for f in marker["files"]:
        url = join_url(out_url, f["path"])
        try:
            source = storage.open_source(url)
        except OSError as missing:
            failures.append({"file": f["path"], "error": str(missing)})
            continue
        try:
            if source.size_bytes != f["size_bytes"]:
                raise VerificationError(f"{source.size_bytes} bytes, {f['size_bytes']} written")
            for e in f["items"]:
                items += 1
                if e["crc32"] is None:
                    continue
                item = _Slice(source, e["offset"], e["length"])
                zf = TorchZipFile(item)
                record = zf.storage_record("0")
                crc = record_crc(item, zf.data_offset(record), record.size_bytes)
                if crc != e["crc32"]:
                    raise VerificationError(
                        f"{e['fqn']}: data reads back with CRC-32 {crc:08x}, "
                        f"{e['crc32']:08x} was recorded while writing it"
                    )
        except (VerificationError, ValueError, OSError) as err:
            failures.append({"file": f["path"], "error": str(err)})
        finally:
            source.close()
    failures += check_carried(storage, out_url, marker.get("client_files", []))
    return {
        "ok": not failures, "output": out_url, "num_files": len(marker["files"]),
        "num_items": items, "failures": failures,
    }  # fmt: skip
