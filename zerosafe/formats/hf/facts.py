"""What `inspect`, the plan's notes and the manifest say about a safetensors folder or a
`HuggingFaceStorageWriter` save, and the `SourceLayout` that carries it."""

from __future__ import annotations

import hashlib
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from zerosafe.formats.base import (
    InspectFacts,
    ReadLabels,
    Slot,
    SourceDescription,
    SourceFile,
    SourceLayout,
    SourceTensor,
)
from zerosafe.formats.hf.headers import SafetensorsHeader
from zerosafe.units import format_bytes

__all__ = ["Described", "HfSource", "describe"]


@dataclass(frozen=True, kw_only=True, slots=True)
class HfSource:
    """The manifest's own fields of a safetensors source (`SourceDetails`)."""

    ORDER: ClassVar[tuple[str, ...]] = (
        "format", "format_name", "checkpoint", "tag", "world_size", "num_files",
        "num_tensors", "num_params", "aliases", "checkpoint_bytes", "files", "content_sha256",
    )  # fmt: skip

    format_name: str
    world_size: int | None
    """Ranks that wrote the save (`HuggingFaceStorageWriter`); None for a plain folder."""
    num_files: int
    num_tensors: int
    aliases: tuple[tuple[str, str], ...]

    @property
    def order(self) -> tuple[str, ...]:
        return self.ORDER

    def fields(self) -> dict[str, object]:
        fields: dict[str, object] = {
            "format_name": self.format_name,
            "num_files": self.num_files,
            "num_tensors": self.num_tensors,
            "aliases": dict(self.aliases),
        }
        if self.world_size is not None:
            fields["world_size"] = self.world_size
        return fields

    def headline(self, common: SourceDescription) -> str:
        ranks = f", world size {self.world_size}" if self.world_size is not None else ""
        return f"({self.format_name}{ranks}, {self.num_files} file(s), {self.num_tensors} tensors)"


@dataclass(frozen=True, kw_only=True, slots=True)
class Described:
    """What a reader found, as `describe` needs it."""

    format: str
    format_name: str
    url: str
    tag: str
    files: list[SourceFile]
    headers: Sequence[SafetensorsHeader]
    slots: list[Slot]
    tensors: dict[str, SourceTensor]
    order: list[str]
    aliases: dict[str, str]
    world_size: int | None
    notes: list[str]
    metadata_bytes: int
    main_label: str
    model_files: str | None = None
    """Where the model's config and tokenizer are, where not the folder above `url`."""
    ties_by_config: bool = False
    """`SourceLayout.ties_by_config`."""


def describe(found: Described) -> SourceLayout:
    """The reader's `SourceLayout`: tensors, slots, and what the manifest and `inspect` say."""
    params = sum(math.prod(t.shape) for t in found.tensors.values())
    total = sum(f.size_bytes for f in found.files)
    source = SourceDescription(
        format=found.format,
        checkpoint=found.url,
        tag=found.tag,
        num_params=params,
        checkpoint_bytes=total,
        files=tuple(f.identity for f in found.files),
        content_sha256=_fingerprint(found.headers),
        details=HfSource(
            format_name=found.format_name,
            world_size=found.world_size,
            num_files=len(found.files),
            num_tensors=len(found.tensors),
            aliases=tuple(sorted(found.aliases.items())),
        ),
        model_files=found.model_files,
    )
    dtypes = Counter(t.dtype for t in found.tensors.values())
    ranks = f", world size {found.world_size}" if found.world_size is not None else ""
    about = [
        f"Checkpoint  {found.url}  ({found.format_name}{ranks})",
        f"  {len(found.tensors)} tensors ({params:,} elements) in {len(found.files)} "
        f"safetensors file(s), {format_bytes(total)}",
        "  dtypes: " + ", ".join(f"{d} x {n}" for d, n in dtypes.most_common()),
    ]
    if found.aliases:
        about.append(
            "  tied: " + ", ".join(f"{a} -> {t}" for a, t in sorted(found.aliases.items()))
        )
    facts = InspectFacts(
        fields={
            "checkpoint": found.url,
            "world_size": found.world_size,
            "tensors": len(found.tensors),
            "dtypes": dict(dtypes),
            "aliases": dict(found.aliases),
            "files": {"safetensors": len(found.files), "total_bytes": total},
        },
        about=about,
        read_labels=ReadLabels(
            main=found.main_label,
            other="other",
            metadata="safetensors headers and the index",
            never="nothing else is read",
        ),
    )
    return SourceLayout(
        format=found.format, where=found.url, tag=found.tag, files=found.files,
        slots=found.slots, tensors=found.tensors, order=found.order, aliases=found.aliases,
        source=source, facts=facts, metadata_bytes=found.metadata_bytes,
        main_slot_kind="chunk", notes=found.notes, ties_by_config=found.ties_by_config,
        lowp_missing="a safetensors save keeps one copy of the weights, no second one",
    )  # fmt: skip


def _fingerprint(headers: Sequence[SafetensorsHeader]) -> str:
    """SHA-256 over every file's size and every tensor's name, dtype, shape, byte range and
    `__metadata__`: from headers only (safetensors records no checksum), the same after
    copies and moves. It tells another model or save apart; a change of values alone is
    caught by `verify --against`'s value sample."""
    h = hashlib.sha256(b"safetensors\n")
    for header in sorted(headers, key=lambda x: x.url.rsplit("/", 1)[-1]):
        h.update(f"{header.url.rsplit('/', 1)[-1]}\0{header.size_bytes}\n".encode())
        for t in sorted(header.tensors.values(), key=lambda t: t.name):
            h.update(f"{t.name}\0{t.dtype}\0{list(t.shape)}\0{t.byte_offset}\n".encode())
        for k, v in sorted(header.metadata.items()):
            h.update(f"{k}\0{v}\n".encode())
    return h.hexdigest()
