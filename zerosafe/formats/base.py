"""What a checkpoint format's reader gives the rest of zerosafe: a `SourceLayout`.

A reader turns a checkpoint URL into the source files, every output tensor as fragments
(byte ranges of those files, as runs of elements of *slots*, to offsets of the flattened
tensor), the tied aliases, and what `inspect` and the manifest say about the checkpoint.
Everything after that (`zerosafe.plan.build`, the stages, verify, publish, the flow) is
format-agnostic: it plans shards and copies byte ranges, and knows no DeepSpeed or DCP.

The formats themselves are described in docs/formats.md.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from zerosafe.config import ConvertOptions
from zerosafe.dtypes import dtype_info
from zerosafe.errors import CheckpointFormatError, ConfigError
from zerosafe.io.storage import FileIdentity

if TYPE_CHECKING:
    from zerosafe.formats.torch_pickle import TensorRecord
    from zerosafe.formats.torch_zip import TorchZipFile
    from zerosafe.io.storage import ByteSource, Storage
    from zerosafe.plan.model import Plan

__all__ = [
    "FormatReader",
    "Fragment",
    "InspectFacts",
    "LowpCopy",
    "LowpWitness",
    "ReadLabels",
    "ReadsLowpCopies",
    "Slot",
    "SourceFile",
    "SourceDescription",
    "SourceDetails",
    "SourceLayout",
    "SourceTensor",
    "StoredDetails",
]

Fragment = tuple[int, int, int, int]
"""`(slot, src_offset, numel, dst_offset)`: copy `numel` elements from element `src_offset` of
a slot to element `dst_offset` of the flattened output tensor."""

ROLES = ("param", "frozen", "buffer")
"""A source tensor's role: a trained parameter, a frozen (requires_grad=False) parameter, or a
buffer. `exclude_frozen` leaves out the frozen ones; `inspect` counts each."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SourceFile:
    """One file a conversion reads, with its identity (size, mtime or ETag) when planned."""

    index: int
    url: str
    role: str
    rank: int
    size_bytes: int
    version: str

    @property
    def identity(self) -> FileIdentity:
        return FileIdentity(url=self.url, size_bytes=self.size_bytes, version=self.version)


@dataclass(frozen=True, kw_only=True, slots=True)
class Slot:
    """A contiguous run of elements in a source file that fragments read from."""

    index: int
    file: int
    rank: int
    kind: str
    """`fp32` (master partition), `frozen` (16-bit frozen param) or `buffer`."""
    name: str
    record: str
    record_offset: int
    """Absolute file offset of the zip record's data."""
    record_size_bytes: int
    record_crc32: int
    element_offset: int
    """Offset of the slot's first element inside the record."""
    numel: int
    dtype: str

    @property
    def itemsize(self) -> int:
        return dtype_info(self.dtype).itemsize

    @property
    def byte_offset(self) -> int:
        """Absolute file offset of the slot's first byte."""
        return self.record_offset + self.element_offset * self.itemsize

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


@dataclass(frozen=True, kw_only=True, slots=True)
class SourceTensor:
    """One tensor the checkpoint holds, as the fragments that tile it."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    """The dtype it was saved in (a torch name, `float32`)."""
    role: str
    fragments: tuple[Fragment, ...]


class SourceDetails(Protocol):
    """A format's own fields of the manifest's `source` block (DeepSpeed: stage, world size,
    dtypes; DCP: what was selected), typed by the reader that makes them. Only the reader
    reads them; everyone else writes them out (`SourceDescription.to_json`)."""

    @property
    def order(self) -> tuple[str, ...]:
        """Every key of the block, common ones included, in the order the manifest writes
        them (kept as each format has always written them: the manifest's bytes)."""
        ...

    def fields(self) -> dict[str, object]:
        """The format's own keys and their JSON values; a key whose value is absent (None
        where the format omits it) is left out."""
        ...

    def headline(self, common: SourceDescription) -> str:
        """What the flow's run summary says about the checkpoint, after its URL: `(tag
        global_step4, ZeRO-3, world size 2)`."""
        ...


@dataclass(frozen=True, slots=True)
class StoredDetails:
    """`SourceDetails` as read back from a plan or a job plan (JSON): the format's own
    fields as they were written, and the headline the reader made."""

    items: tuple[tuple[str, object], ...]
    keys: tuple[str, ...]
    said: str = ""

    @property
    def order(self) -> tuple[str, ...]:
        return self.keys

    def fields(self) -> dict[str, object]:
        return dict(self.items)

    def headline(self, common: SourceDescription) -> str:
        return self.said


_COMMON = (
    "format", "checkpoint", "tag", "tag_url", "num_params", "checkpoint_bytes", "files",
    "content_sha256", "model_files", "found_in", "model_config",
)  # fmt: skip
"""The block's keys `SourceDescription` types itself; the rest are the format's own."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SourceDescription:
    """What the manifest's `source` block says about the checkpoint: the fields every format
    has, typed (the rest of zerosafe reads these), and the format's own (`details`)."""

    format: str
    """The reader's name (`SourceLayout.format`); written into the block only where the
    format's `details.order` lists `format`."""
    checkpoint: str
    """The checkpoint URL as given."""
    tag: str
    tag_url: str | None = None
    """The folder the save is in, where it differs from `checkpoint` (DeepSpeed's tag
    folder); model files are looked up in the folder above it."""
    num_params: int
    checkpoint_bytes: int
    """The bytes of every file a conversion reads (`files`)."""
    files: tuple[FileIdentity, ...]
    content_sha256: str
    """A fingerprint of the stored tensors from metadata alone (`verify --against` compares
    it with the checkpoint's)."""
    details: SourceDetails
    model_files: str | None = None
    """The folder the format keeps the model files in (verl: `actor/huggingface/`), where it is
    not the folder above `model_files_url`; written at the block's end where set."""
    found_in: str | None = None
    """The folder the user gave, where the save was found one level down in it
    (`zerosafe.formats.nested`); written at the block's end where set."""
    model_config: dict[str, object] | None = None
    """A transformers `config.json` the reader made from the checkpoint itself (Megatron-LM:
    from its saved args), written beside the weights where the model files hold none
    (`zerosafe.stages.output`); written at the block's end where set."""

    @property
    def model_files_url(self) -> str:
        """The folder whose parent holds the model files (`tag_url`, else `checkpoint`)."""
        return self.tag_url or self.checkpoint

    @property
    def headline(self) -> str:
        """The flow summary's words about the checkpoint (`SourceDetails.headline`)."""
        return self.details.headline(self)

    def to_json(self, *, with_files: bool = True) -> dict[str, object]:
        """The manifest's `source` block, in the format's key order."""
        values: dict[str, object] = {
            "format": self.format,
            "checkpoint": self.checkpoint,
            "tag": self.tag,
            "tag_url": self.tag_url,
            "num_params": self.num_params,
            "checkpoint_bytes": self.checkpoint_bytes,
            "files": [f.to_json() for f in self.files] if with_files else None,
            "content_sha256": self.content_sha256,
            **self.details.fields(),
        }
        skip = () if with_files else ("files",)
        block = {k: values[k] for k in self.details.order if k in values and k not in skip}
        ends = (
            ("model_files", self.model_files), ("found_in", self.found_in),
            ("model_config", self.model_config),
        )  # fmt: skip
        for key, value in ends:
            if value is not None:
                block[key] = value
        return block

    def reader_json(self) -> dict[str, str]:
        """What a plan keeps beside the block to read it back (`from_json`)."""
        return {"format": self.format, "headline": self.headline}

    @classmethod
    def from_json(
        cls, block: Mapping[str, Any], reader: Mapping[str, str] | None = None
    ) -> SourceDescription:
        """A description read back from `to_json()` (and `reader_json()`, where kept)."""
        reader = reader or {}
        files = tuple(FileIdentity.from_json(f) for f in block.get("files") or ())
        own = tuple((k, v) for k, v in block.items() if k not in _COMMON)
        return cls(
            format=str(reader.get("format") or block.get("format") or ""),
            checkpoint=str(block.get("checkpoint") or ""),
            tag=str(block.get("tag") or ""),
            tag_url=block.get("tag_url"),
            num_params=block.get("num_params", 0),
            checkpoint_bytes=block.get("checkpoint_bytes", 0),
            files=files,
            content_sha256=block.get("content_sha256", ""),
            details=StoredDetails(own, tuple(block), reader.get("headline", "")),
            model_files=block.get("model_files"),
            found_in=block.get("found_in"),
            model_config=block.get("model_config"),
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class ReadLabels:
    """What `inspect` calls each kind of read (`SourceLayout.main_slot_kind` is `main`)."""

    main: str
    other: str
    metadata: str
    never: str
    """What is never read, as a sentence (`Adam moments are never read`)."""

    def to_json(self) -> dict[str, str]:
        return {
            "main": self.main,
            "other": self.other,
            "metadata": self.metadata,
            "never": self.never,
        }


@dataclass(kw_only=True, slots=True)
class InspectFacts:
    """What `inspect` reports about the checkpoint itself, before its generic sections."""

    fields: dict[str, object]
    """The format's own report (JSON values, in report order); nothing reads it by key."""
    about: list[str]
    """The report's opening lines for people (`Checkpoint  URL  (DeepSpeed ZeRO, tag ...)`)."""
    read_labels: ReadLabels
    appendix: dict[str, object] = field(default_factory=dict)
    """Report sections after `read_labels` (DeepSpeed pipeline parallel: `pipeline`)."""

    def to_json(self) -> dict[str, object]:
        return {
            **self.fields,
            "about": list(self.about),
            "read_labels": self.read_labels.to_json(),
            **self.appendix,
        }


@dataclass(frozen=True, kw_only=True, slots=True)
class LowpCopy:
    """A 16-bit copy of (part of) one output tensor that the checkpoint keeps beside its
    trained weights (DeepSpeed ZeRO-1/2's module states): the witness `check_lowp` and
    `verify --against` compare the output with, cast to `dtype`."""

    name: str
    """The output tensor it copies."""
    file_url: str
    source: ByteSource
    """The open file holding it."""
    byte_offset: int
    numel: int
    dtype: str
    element_offset: int = 0
    """Where in the output tensor it starts."""
    partial: bool = False
    """Whether it covers a part of the tensor only (one expert's rows of a fused weight)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LowpWitness:
    """The 16-bit copies a checkpoint keeps (in checking order), or why it keeps none."""

    copies: tuple[LowpCopy, ...] = ()
    missing: str | None = None


@runtime_checkable
class ReadsLowpCopies(Protocol):
    """A reader whose checkpoints can keep a 16-bit copy of the trained weights beside the
    masters (DeepSpeed ZeRO-1/2), the witness `check_lowp` and `verify --against` compare
    with: an optional capability, asked as `isinstance(reader, ReadsLowpCopies)`. A format
    without it refuses `check_lowp` before anything is read; whether one checkpoint keeps a
    copy is `SourceLayout.lowp_missing`."""

    def lowp_witness(
        self, storage: Storage, source: SourceDescription, *, layout: SourceLayout | None = None
    ) -> LowpWitness:
        """The checkpoint's 16-bit copies: from `layout` where given (read by this reader),
        else read again from `source` (a plan's description).

        Raises:
            CheckpointFormatError: If the checkpoint cannot be read again.
        """
        ...


@dataclass(kw_only=True)
class SourceLayout:
    """Everything the planner needs from one checkpoint (see the module docstring)."""

    format: str
    """The reader's name (`deepspeed`, `dcp`)."""
    where: str
    """The URL errors about the checkpoint as a whole name (DeepSpeed: the tag folder)."""
    tag: str
    """Which save inside the checkpoint folder (DeepSpeed's tag); part of the job key."""
    files: list[SourceFile]
    slots: list[Slot]
    tensors: dict[str, SourceTensor]
    order: list[str]
    """Output order: tensor names and alias names (the model's `state_dict()` order)."""
    aliases: dict[str, str] = field(default_factory=dict)
    """Tied names: alias -> the tensor it shares memory with (a key of `tensors`)."""
    source: SourceDescription
    """The manifest's `source` block: where from, and format facts (stage, world size...)."""
    facts: InspectFacts | None = None
    """What `inspect` reports about the checkpoint itself, before its generic sections."""
    metadata_bytes: int = 0
    """What any conversion reads besides the slots: pickles, zip directories, metadata
    files. The run summary reports bytes read against slots + this."""
    main_slot_kind: str = "fp32"
    """The kind of slot `inspect` reports as the main read (`read_labels["main"]`): DeepSpeed's
    fp32 masters (`fp32`), DCP's chunks (`chunk`); other slots count as `other`."""
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    lowp_missing: str | None = None
    """Why this checkpoint keeps no 16-bit copy of its trained weights for `check_lowp` to
    compare with (`ZeRO-3 saves no 16-bit copy...`), or None where it keeps one; the
    option is refused at plan time where it is set (`zerosafe.formats.registry.read_source`)."""
    ties_by_config: bool = False
    """Whether the checkpoint leaves a tied weight out and lets the model's config tie it
    again (`save_pretrained` stores a tied head once, the config says
    `tie_word_embeddings: true`): that config then agrees with a checkpoint that records no
    alias, and no warning says otherwise."""
    checks: tuple[Callable[[Plan], None], ...] = ()
    """Format checks that need the finished plan (run by `plan_layout`, before it returns)."""
    native: object = None
    """The reader's own description (DeepSpeed: the `ZeroCheckpoint`), opaque: only the
    reader that made it reads it (in its optional capabilities, `ReadsLowpCopies`)."""

    @property
    def identities(self) -> list[FileIdentity]:
        """The source files' identities (URL, size, version): part of the job key."""
        return [f.identity for f in self.files]


class FormatReader(Protocol):
    """One checkpoint format. Readers are listed in `zerosafe.formats.registry`."""

    name: str
    """Short name (`deepspeed`): `SourceLayout.format`, `--format`, the manifest."""
    title: str
    """What `inspect` and errors call it (`DeepSpeed ZeRO`)."""
    looks_like: str
    """What a folder of this format holds, for the error that lists the formats."""
    selects: bool
    """Whether the format takes `ConvertOptions.select` and `strip_prefix` (DCP: a
    checkpoint holds more than one state dict); other readers refuse them."""
    parts_below: tuple[str, ...]
    """The formats (`name`) whose saves one level down go with a save of this format rather
    than beside it: its own (DeepSpeed's tag folders; a DCP folder's subfolders are none of
    its save) and, for DeepSpeed ZeRO and universal, each other (the universal folder
    ds_to_universal.py made of a tag). A save of any other format one level down is a second
    save, and the folder is refused (`zerosafe.formats.nested.refuse_saves_beside`)."""
    tag_folders: bool
    """Whether `--tag` picks a folder inside a save of this format (DeepSpeed's
    `global_stepN/`): how to convert it when a save of another format lies beside it."""

    def detect(self, storage: Storage, url: str) -> bool:
        """Whether `url` holds this format, from a listing (no file is opened)."""
        ...

    def quick_identities(
        self, storage: Storage, url: str, tag: str | None
    ) -> tuple[str, list[FileIdentity]]:
        """`(tag, identities)` of the files a conversion reads, from listings and stats only,
        in `SourceLayout.files` order, so a job key can be computed without opening a file."""
        ...

    def read(
        self, storage: Storage, url: str, *, tag: str | None, options: ConvertOptions
    ) -> SourceLayout:
        """Read the checkpoint's metadata (never its tensor data) into a `SourceLayout`."""
        ...


def one_save_tag(url: str, tag: str | None, *, this: str, give: str, depth: int = 1) -> str:
    """The tag of a folder that is one save (DCP, safetensors, verl...): the folder's name, or
    with `depth=2` its last two names (verl's `global_step_N/actor`); `--tag` may name it or
    the folder's own name.

    `this` names the folder (`a PyTorch DCP checkpoint`), `give` what to give instead.

    Raises:
        ConfigError: If another tag is asked for.
    """
    parts = url.rstrip("/").rsplit("/", depth)
    name = "/".join(parts[-depth:])
    if tag is not None and tag not in (name, parts[-1]):
        raise ConfigError(
            f"{url}: `--tag {tag}` names a DeepSpeed tag folder, but this is {this}, which is "
            f"one save; give {give} and no --tag"
        )
    return name


def record_slot(
    archive: TorchZipFile,
    t: TensorRecord,
    *,
    where: str,
    index: int,
    file: int,
    rank: int,
    kind: str,
    name: str,
) -> Slot:
    """The slot of a pickled tensor `t`'s elements in its storage record of `archive` (one
    small read: the record's zip local header); `where` names the tensor in errors.

    Raises:
        CheckpointFormatError: If the record is shorter than the tensor's elements.
    """
    record = archive.storage_record(t.storage.key)
    end = (t.storage_offset + t.numel) * t.itemsize
    if end > record.size_bytes:
        raise CheckpointFormatError(
            f"{where} needs {end} bytes of record '{record.name}', which holds "
            f"{record.size_bytes}; the file is corrupt"
        )
    return Slot(
        index=index, file=file, rank=rank, kind=kind, name=name, record=record.name,
        record_offset=archive.data_offset(record), record_size_bytes=record.size_bytes,
        record_crc32=record.crc32, element_offset=t.storage_offset, numel=t.numel,
        dtype=t.dtype,
    )  # fmt: skip
