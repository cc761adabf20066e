"""`zerosafe convert CKPT OUT --to universal`: a DeepSpeed universal checkpoint, written as
restartable units in bounded memory, verified, and published with a marker written last.

The target (`UniversalTarget`; `zerosafe.targets.lifecycle` runs it, in this process or as
Prefect tasks, holding the output folder against a second run):

1. inspect: plan every file from the pickles (`zerosafe.training_state.universal_plan`).
2. units: the optimizer state (and, ZeRO-1/2, the module copies), the model states copies,
   then the trained params in order, grouped so each unit writes about `unit_bytes`. A param
   streams from its byte runs into its `.pt` files (`zerosafe.training_state.torch_save`) in
   chunks of `chunk_bytes` (`--memory` divided among the units at once; several units run
   at once, `--parallel`), never whole in memory, whatever its size. Each finished unit is
   recorded with what it wrote (`zerosafe.run.unit_records`); a rerun keeps every recorded
   unit whose files are all there with their recorded sizes, and redoes the rest.
   `--overwrite` keeps none.
3. verify: every source record read (masters, moments, module copies) is checked against its
   zip CRC-32, from the CRC-32s of the chunks read (kept in the unit records, so resumed units
   count); every written `.pt` is reopened with zerosafe's restricted reader: its pickle must
   describe the expected tensor (dtype, shape, `requires_grad`) and its data record's CRC-32
   must match the zip directory and the CRC recorded while writing. A unit with a file that
   fails (damaged at its recorded size, so kept) is dropped: the next run redoes it.
4. publish: `OUT/<tag>_universal/zerosafe-manifest.json`, then `OUT/latest_universal` (what
   `engine.load_checkpoint(OUT)` reads with `"checkpoint": {"load_universal": true}`), then the
   marker `OUT/zerosafe-universal-complete.json`, last.
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Unpack

from zerosafe.dtypes import dtype_info
from zerosafe.errors import VerificationError
from zerosafe.formats.torch_legacy import open_torch_file
from zerosafe.formats.torch_pickle import InertObject, TensorRecord
from zerosafe.formats.torch_zip import TorchZipFile
from zerosafe.io.storage import (
    TAG_NAME_MAX_BYTES,
    Storage,
    is_local,
    join_url,
    normalize_url,
)
from zerosafe.run.unit_records import fingerprint
from zerosafe.stages.destination import LATEST_UNIVERSAL
from zerosafe.stages.destination import UNIVERSAL_MARKER_NAME as MARKER_NAME
from zerosafe.stages.destination import clear_universal_output as _clear_universal_output
from zerosafe.stages.model_files import copy_model_files, sha256_of
from zerosafe.stages.output import OUTPUT_JSON_MAX_BYTES
from zerosafe.targets.base import StateKwargs, StateOptions, StateSummary, UnitSpec, UnitWork
from zerosafe.targets.lifecycle import read_marker, run_target
from zerosafe.training_state.streams import SourcesOfPlan, UnitJob, record_crc, to_float32
from zerosafe.training_state.torch_save import TensorOut, TorchZipWriter, pickle_bytes
from zerosafe.training_state.universal_plan import (
    STATES,
    ModuleCopy,
    ParamOut,
    Run,
    UniversalPlan,
    plan_universal,
    small_tensors,
)

__all__ = [
    "LATEST_UNIVERSAL",
    "MARKER_NAME",
    "UniversalSummary",
    "UniversalTarget",
    "convert_to_universal",
    "is_universal_output",
    "verify_universal_output",
]

log = logging.getLogger(__name__)

MANIFEST_NAME = "zerosafe-manifest.json"
DEFAULT_CHUNK_BYTES = 8 << 20
"""The chunk `verify OUT` re-reads a file in."""


@dataclass(kw_only=True)
class UniversalSummary(StateSummary):
    """What a `--to universal` run did."""

    folder: str


@dataclass(kw_only=True)
class _Written:
    """One file a unit wrote: its path under OUT, size, and per-record CRC-32s."""

    path: str
    size_bytes: int
    crcs: dict[str, int]
    expect: dict[str, Any]
    """What verify checks its pickle against: `kind` (`state`, `module`, `step`, `pickle`,
    `copy`) and, for tensors, `shape` and `requires_grad`."""

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass(kw_only=True)
class _Job(UnitJob):
    """One unit's writer (`UnitJob`: its own sources, counts and ledger)."""

    plan: UniversalPlan

    @property
    def folder_url(self) -> str:
        return join_url(self.out_url, self.plan.folder)

    def _write_pt(
        self,
        rel: str,
        obj: Any,
        records: list[tuple[str, int, Iterator[tuple[bytes, int | None]]]],
        expect: dict[str, Any],
    ) -> _Written:
        """Write `OUT/<rel>`: the pickle of `obj`, then each `(key, size, chunks)` storage."""
        sink = self.storage.open_sink(join_url(self.out_url, rel))
        try:
            writer = TorchZipWriter(sink=sink, archive=rel.rsplit("/", 1)[-1].removesuffix(".pt"))
            writer.add_preamble(pickle_bytes(obj))
            crcs = {}
            for key, size, chunks in records:
                writer.begin(f"data/{key}", size_bytes=size)
                for chunk, crc in chunks:
                    writer.write(chunk, crc32=crc)
                crcs[f"data/{key}"] = writer.end()
            writer.close()
            sink.commit()
        except BaseException:
            sink.abort()
            raise
        self.bytes_written += writer.bytes_written
        return _Written(path=rel, size_bytes=writer.bytes_written, crcs=crcs, expect=expect)

    # -- units ---------------------------------------------------------------------------------

    def write_param(self, p: ParamOut) -> list[_Written]:
        z12 = self.plan.stage < 3
        out = []
        for state in STATES:
            grad = state == "fp32"
            tensor = TensorOut(
                key="0", dtype="float32", shape=p.shape if z12 else (p.numel,), requires_grad=grad
            )
            obj: Any = {"cat_dim": 0, "param": tensor} if z12 else tensor
            rel = f"{self.plan.folder}/zero/{p.name}/{state}.pt"
            expect = {"kind": "state", "shape": list(tensor.shape), "requires_grad": grad,
                      "wrapped": z12}  # fmt: skip
            out.append(
                self._write_pt(rel, obj, [("0", 4 * p.numel, self.chunks(p.runs[state]))], expect)
            )
        if z12 and p.group in self.plan.steps:
            rel = f"{self.plan.folder}/zero/{p.name}/step.pt"
            out.append(self._write_small(rel, self.plan.steps[p.group], {"kind": "step"}))
        return out

    def _write_small(self, rel: str, obj: Any, expect: dict[str, Any]) -> _Written:
        """A small object: its `TensorRecord`s read whole and written as fresh storages."""
        records: list[tuple[str, int, Iterator[tuple[bytes, int | None]]]] = []
        outs: dict[int, TensorOut] = {}
        for t in small_tensors(obj):
            if id(t) in outs:
                continue
            key = str(len(records))
            outs[id(t)] = TensorOut(
                key=key, dtype=t.dtype, shape=t.shape, requires_grad=t.requires_grad
            )
            records.append((key, t.nbytes, iter([(self.read_small(t), None)])))
        return self._write_pt(rel, _replace_records(obj, outs), records, expect)

    def write_optimizer_state(self) -> list[_Written]:
        rel = f"{self.plan.folder}/zero/optimizer_state.pt"
        out = [self._write_small(rel, self.plan.optimizer_state, {"kind": "pickle"})]
        for copy in self.plan.module_copies:
            out.append(self._write_module_copy(copy))
        return out

    def _write_module_copy(self, c: ModuleCopy) -> _Written:
        tensor = TensorOut(key="0", dtype="float32", shape=c.shape)
        rel = f"{self.plan.folder}/zero/{c.name}/fp32.pt"
        itemsize = dtype_info(c.dtype).itemsize
        chunks = ((to_float32(b, c.dtype), None) for b, _ in self.chunks((c.run,), itemsize))
        expect = {"kind": "state", "shape": list(c.shape), "requires_grad": False, "wrapped": True,
                  "only_param": True}  # fmt: skip
        return self._write_pt(rel, {"param": tensor}, [("0", 4 * c.run.numel, chunks)], expect)

    def copy_model_states(self) -> list[_Written]:
        out = []
        for url in self.plan.model_files:
            name = url.rsplit("/", 1)[-1]
            rel = f"{self.plan.folder}/{name}"
            file = self.plan.urls.index(url)
            size = self.storage.identity(url).size_bytes
            sink = self.storage.open_sink(join_url(self.out_url, rel))
            try:
                for chunk, _ in self.chunks((Run(file, 0, size),), itemsize=1):
                    sink.write(chunk)
                sink.commit()
            except BaseException:
                sink.abort()
                raise
            self.bytes_written += size
            out.append(_Written(path=rel, size_bytes=size, crcs={}, expect={"kind": "copy"}))
        return out

    def copy_client_files(self) -> list[_Written]:
        """The training client's files, byte for byte, into the output's top folder (where
        `Trainer.train(resume_from_checkpoint=OUT)` reads them); verify compares SHA-256s."""
        entries = copy_model_files(
            self.storage, self.plan.ckpt.ckpt_url, self.plan.client_files, self.out_url,
            chunk_bytes=self.chunk_bytes,
        )  # fmt: skip
        out = []
        for e in entries:
            self.bytes_written += e.size_bytes
            expect = {"kind": "client", "sha256": e.sha256}
            out.append(_Written(path=e.file, size_bytes=e.size_bytes, crcs={}, expect=expect))
        return out


def _replace_records(obj: Any, outs: dict[int, TensorOut]) -> Any:
    """`obj` with each small `TensorRecord` replaced by the `TensorOut` written for it."""
    if isinstance(obj, TensorRecord):
        return outs[id(obj)]
    if isinstance(obj, OrderedDict):
        return OrderedDict((k, _replace_records(v, outs)) for k, v in obj.items())
    if isinstance(obj, dict):
        return {k: _replace_records(v, outs) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_replace_records(v, outs) for v in obj]
    if isinstance(obj, tuple) and type(obj) is tuple:
        return tuple(_replace_records(v, outs) for v in obj)
    if isinstance(obj, InertObject) and small_tensors([obj.args, obj.state]):
        copy = type(obj)(*_replace_records(obj.args, outs))
        copy.state = _replace_records(obj.state, outs)
        return copy
    return obj


def _units(plan: UniversalPlan, unit_bytes: int) -> list[tuple[str, list[int]]]:
    """`(kind, param indices)`: the optimizer state, the model states copies, then params in
    order, each unit about `unit_bytes` of masters + moments (a larger param alone)."""
    units: list[tuple[str, list[int]]] = [("optimizer_state", []), ("model_states", [])]
    # the client's files go last, so the units before keep the indices they had before
    current: list[int] = []
    filled = 0
    for i, p in enumerate(plan.params):
        size = 12 * p.numel
        if current and filled + size > unit_bytes:
            units.append(("params", current))
            current, filled = [], 0
        current.append(i)
        filled += size
    if current:
        units.append(("params", current))
    if plan.client_files:
        units.append(("client_files", []))
    return units


def verify_file(
    storage: Storage,
    out_url: str,
    w: Mapping[str, Any],
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> None:
    """Reopen one written file with the restricted reader and check it (module docstring).

    Raises:
        VerificationError: Naming the file and what differs.
    """
    url = join_url(out_url, w["path"])
    expect = w["expect"]
    source = storage.open_source(url)
    try:
        if source.size_bytes != w["size_bytes"]:
            raise VerificationError(f"{url}: {source.size_bytes} bytes, {w['size_bytes']} written")
        if expect["kind"] == "client":  # a client's file, copied unread: its SHA-256
            _, digest = sha256_of(storage, url, chunk_bytes=chunk_bytes)
            if digest != expect["sha256"]:
                raise VerificationError(
                    f"{url}: SHA-256 {digest}, {expect['sha256']} when it was copied"
                )
            return
        if expect["kind"] == "copy":  # a model states file: every record against its CRC-32
            copied = open_torch_file(source)  # legacy (non-zip) files have no CRCs to check
            for record in copied.records.values():
                if not record.has_crc:
                    continue
                start = copied.data_offset(record)
                read = record_crc(source, start, record.size_bytes, chunk_bytes)
                if read != record.crc32:
                    raise VerificationError(
                        f"{url}: record '{record.name}' reads back with CRC-32 {read:08x}, its "
                        f"zip directory says {record.crc32:08x}"
                    )
            return
        zf = TorchZipFile(source)
        obj = zf.load()
        for name, crc in w["crcs"].items():
            record = zf.records[zf.prefix + name]
            read = record_crc(source, zf.data_offset(record), record.size_bytes, chunk_bytes)
            if not record.crc32 == crc == read:
                raise VerificationError(
                    f"{url}: record '{name}' reads back with CRC-32 {read:08x}; the zip directory "
                    f"says {record.crc32:08x} and {crc:08x} was recorded while writing it"
                )
        if expect["kind"] == "state":
            _check_state(url, obj, expect)
    finally:
        source.close()


def _check_state(url: str, obj: Any, expect: dict[str, Any]) -> None:
    if expect.get("wrapped"):
        keys = {"param"} if expect.get("only_param") else {"param", "cat_dim"}
        if not isinstance(obj, dict) or set(obj) != keys:
            raise VerificationError(
                f"{url}: expected a dict with keys {sorted(keys)}, found {obj!r:.200}"
            )
        obj = obj["param"]
    if not (
        isinstance(obj, TensorRecord)
        and obj.dtype == "float32"
        and list(obj.shape) == expect["shape"]
        and obj.requires_grad == expect["requires_grad"]
        and obj.is_contiguous()
        and obj.storage_offset == 0
    ):
        raise VerificationError(
            f"{url}: expected a float32 tensor of shape {expect['shape']} with "
            f"requires_grad={expect['requires_grad']}, found {obj!r:.200}"
        )


class UniversalTarget(SourcesOfPlan):
    """`--to universal` as an `OutputTarget` (`zerosafe.targets.base`): its plan, units, unit
    writer, file check and manifest; `zerosafe.targets.lifecycle` runs it."""

    name: Literal["universal"] = "universal"
    marker_name = MARKER_NAME
    label = "universal checkpoint"

    def __init__(self, storage: Storage, ckpt_url: str, *, tag: str | None = None) -> None:
        super().__init__()
        self.plan = plan_universal(storage, ckpt_url, tag=tag)
        self.job_key = self.plan.job_key
        self.source_url = self.plan.ckpt.ckpt_url
        self.notes = self.plan.notes
        self.urls, self.records = self.plan.urls, self.plan.records
        self.small_zip = self.plan.ckpt.optim_files[0].zip

    def prepare(
        self, storage: Storage, out_url: str, marker: Mapping[str, Any] | None, *, overwrite: bool
    ) -> bool:
        return marker is not None and marker.get("job_key") == self.job_key

    def clear(self, storage: Storage, out_url: str) -> None:
        _clear_universal_output(storage, out_url)

    def units(self, unit_bytes: int) -> Sequence[UnitSpec]:
        return [
            UnitSpec(index=index, kind=kind, members=tuple(members),
                     fingerprint=fingerprint(kind, [self.plan.params[i].name for i in members]))
            for index, (kind, members) in enumerate(_units(self.plan, unit_bytes))
        ]  # fmt: skip

    def write_unit(
        self, storage: Storage, out_url: str, unit: UnitSpec, chunk_bytes: int
    ) -> UnitWork:
        plan = self.plan
        job = _Job(plan=plan, **self.unit_job(storage, out_url, chunk_bytes))
        try:
            if unit.kind == "optimizer_state":
                files = job.write_optimizer_state()
            elif unit.kind == "model_states":
                files = job.copy_model_states()
            elif unit.kind == "client_files":
                files = job.copy_client_files()
            else:
                files = [w for i in unit.members for w in job.write_param(plan.params[i])]
        finally:
            job.sources.close()
        return job.done([w.to_json() for w in files])

    def check_file(
        self, storage: Storage, out_url: str, file: Mapping[str, Any], chunk_bytes: int
    ) -> None:
        verify_file(storage, out_url, file, chunk_bytes=chunk_bytes)

    def temp_folders(self, storage: Storage, out_url: str) -> list[str]:
        """The folders a killed run may have left temporary files in (local outputs only)."""
        plan = self.plan
        if not is_local(out_url):
            return []
        folder = join_url(out_url, plan.folder)
        names = [p.name for p in plan.params] + [c.name for c in plan.module_copies]
        candidates = [
            folder, join_url(folder, "zero"), *(join_url(folder, "zero", n) for n in names)
        ]  # fmt: skip
        if plan.client_files:
            candidates.append(out_url)
        return [url for url in candidates if storage.isdir(url)]

    def publish(
        self, storage: Storage, out_url: str, files: list[dict[str, Any]], chunk_bytes: int
    ) -> dict[str, Any]:
        """The manifest, then `latest_universal`; the marker (returned) goes last."""
        plan = self.plan
        manifest = {
            "format": "deepspeed-universal",
            "job_key": plan.job_key,
            "source": {"checkpoint": plan.ckpt.ckpt_url, "tag": plan.tag, "stage": plan.stage,
                       "world_size": plan.world_size},
            "files": files,
            "notes": plan.notes,
        }  # fmt: skip
        storage.write_bytes(
            join_url(out_url, plan.folder, MANIFEST_NAME), json.dumps(manifest, indent=1).encode()
        )
        storage.write_bytes(join_url(out_url, LATEST_UNIVERSAL), plan.folder.encode())
        return {"job_key": plan.job_key, "folder": plan.folder, "source": manifest["source"]}

    def summary(self, status: str, output: str) -> UniversalSummary:
        plan = self.plan
        return UniversalSummary(
            status=status, output=output, folder=plan.folder, num_params=len(plan.params),
            masters_bytes=plan.masters_bytes, moments_bytes=plan.moments_bytes,
            notes=list(plan.notes),
        )  # fmt: skip


def convert_to_universal(
    ckpt_url: str,
    out_url: str,
    *,
    tag: str | None = None,
    storage: Storage | None = None,
    **options: Unpack[StateKwargs],
) -> UniversalSummary:
    """Write the DeepSpeed universal checkpoint of a ZeRO checkpoint into `out_url`.

    Args:
        ckpt_url: The folder holding `latest`, or a tag folder.
        out_url: The output folder; `engine.load_checkpoint(out_url)` with
            `"checkpoint": {"load_universal": true}` resumes from it.
        tag: The tag to convert; by default the one `latest` names.
        options: `StateOptions`' fields: `memory` and `parallel` (the units at once and their
            chunk), `unit_bytes` (masters + moments per unit: the granularity of resume),
            `overwrite` (replace a complete universal checkpoint of another source in
            `out_url`, or another kind's output there, and redo every unit an unfinished run
            left), `keep_work`.

    Returns:
        What was done, with bytes read and written and peak memory.

    Raises:
        UnsupportedCheckpointError: What is not converted yet, named in one line.
        ConfigError: `out_url` is the checkpoint folder, inside it or holds it.
        LeaseHeldError: Another run converts into `out_url` now.
        OutputExistsError: `out_url` holds a complete conversion of another checkpoint, or
            another kind's output (without `overwrite`).
        VerificationError: A written file failed its check; its unit was dropped, so the
            next run redoes it.
    """
    storage = storage or Storage()
    summary = run_target(
        "universal", lambda: UniversalTarget(storage, ckpt_url, tag=tag), ckpt_url, out_url,
        StateOptions(**options), storage=storage,
    )  # fmt: skip
    assert isinstance(summary, UniversalSummary)
    return summary


def is_universal_output(storage: Storage, out_url: str) -> bool:
    """Whether `out_url` holds a complete `--to universal` output (its marker)."""
    return storage.exists(join_url(normalize_url(out_url), MARKER_NAME))


def verify_universal_output(out_url: str, *, storage: Storage | None = None) -> dict[str, Any]:
    """`zerosafe verify OUT` of a universal output: every file of its manifest present and
    checked as `convert` checked it, and `latest_universal` naming its folder.

    Returns:
        `{"ok", "output", "folder", "num_files", "failures": [{"file", "error"}]}`.
    """
    storage = storage or Storage()
    out_url = normalize_url(out_url)
    marker = read_marker(storage, join_url(out_url, MARKER_NAME))
    folder = str(marker["folder"])
    manifest_url = join_url(out_url, folder, MANIFEST_NAME)
    manifest = json.loads(
        storage.read_small(
            manifest_url, limit_bytes=OUTPUT_JSON_MAX_BYTES, what="a zerosafe manifest"
        )
    )
    failures = []
    latest_url = join_url(out_url, LATEST_UNIVERSAL)
    raw = storage.read_small(latest_url, limit_bytes=TAG_NAME_MAX_BYTES, what="a folder name")
    latest = raw.decode("utf-8", "replace").strip()
    if latest != folder:
        failures.append({"file": LATEST_UNIVERSAL, "error": f"names '{latest}', not '{folder}'"})
    for w in manifest["files"]:
        try:
            verify_file(storage, out_url, w)
        except (VerificationError, OSError, ValueError) as e:
            failures.append({"file": w["path"], "error": str(e)})
    return {
        "ok": not failures, "output": out_url, "folder": folder,
        "num_files": len(manifest["files"]), "failures": failures,
    }  # fmt: skip
