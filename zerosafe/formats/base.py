"""What a checkpoint format's reader gives the rest of zerosafe: a `SourceLayout`.

A reader turns a checkpoint URL into the source files, every output tensor as fragments
(byte ranges of those files, as runs of elements of *slots*, to offsets of the flattened
tensor), the tied aliases, and what `inspect` and the manifest say about the checkpoint.
Everything after that (`zerosafe.plan.build`, the stages, verify, publish, the flow) is
format-agnostic: it plans shards and copies byte ranges, and knows no DeepSpeed or DCP.

The formats themselves are described in docs/formats.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from zerosafe.config import ConvertOptions

if TYPE_CHECKING:
    from zerosafe.io.storage import Storage
    from zerosafe.plan.model import Plan, Slot, SourceFile

__all__ = ["FormatReader", "Fragment", "SourceLayout", "SourceTensor"]

Fragment = tuple[int, int, int, int]
"""`(slot, src_offset, numel, dst_offset)`: copy `numel` elements from element `src_offset` of
a slot to element `dst_offset` of the flattened output tensor."""

ROLES = ("param", "frozen", "buffer")
"""A source tensor's role: a trained parameter, a frozen (requires_grad=False) parameter, or a
buffer. `exclude_frozen` leaves out the frozen ones; `inspect` counts each."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SourceTensor:
    """One tensor the checkpoint holds, as the fragments that tile it."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    """The dtype it was saved in (a torch name, `float32`)."""
    role: str
    fragments: tuple[Fragment, ...]


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
    source: dict[str, Any] = field(default_factory=dict)
    """The manifest's `source` block: where from, and format facts (stage, world size...)."""
    facts: dict[str, Any] = field(default_factory=dict)
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
    checks: tuple[Callable[[Plan], None], ...] = ()
    """Format checks that need the finished plan (run by `plan_layout`, before it returns)."""
    native: Any = None
    """The reader's own description (DeepSpeed: the `ZeroCheckpoint`; DCP: its parsed
    metadata), for the checks only that format has (`verify --against`'s 16-bit
    cross-check)."""

    @property
    def identities(self) -> list[dict[str, Any]]:
        """The source files' identities (URL, size, version): part of the job key."""
        return [
            {"url": f.url, "size_bytes": f.size_bytes, "version": f.version} for f in self.files
        ]


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

    lowp_copy: bool
    """Whether checkpoints of this format can keep a 16-bit copy of the trained weights beside
    the masters (DeepSpeed ZeRO-1/2), the witness `check_lowp` compares with; a format that
    never does refuses the option before anything is read. Whether one checkpoint does is
    `SourceLayout.lowp_missing`."""

    def detect(self, storage: Storage, url: str) -> bool:
        """Whether `url` holds this format, from a listing (no file is opened)."""
        ...

    def quick_identities(
        self, storage: Storage, url: str, tag: str | None
    ) -> tuple[str, list[dict[str, Any]]]:
        """`(tag, identities)` of the files a conversion reads, from listings and stats only,
        in `SourceLayout.files` order, so a job key can be computed without opening a file."""
        ...

    def read(
        self, storage: Storage, url: str, *, tag: str | None, options: ConvertOptions
    ) -> SourceLayout:
        """Read the checkpoint's metadata (never its tensor data) into a `SourceLayout`."""
        ...
