"""What `inspect`, the plan's notes and the manifest say about a torch_checkpointing save, and
the `SourceLayout` that carries it: `describe` is the one place the reader's `source` and
`facts` are made."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from zerosafe.formats.base import InspectFacts, ReadLabels, SourceDescription, SourceLayout
from zerosafe.formats.verl.rank_files import built_fields, shards_layout, shards_source
from zerosafe.formats.verl.shards import layout_lines, shards_fingerprint, tied_lines
from zerosafe.units import format_bytes

if TYPE_CHECKING:
    from zerosafe.formats.base import Slot, SourceFile
    from zerosafe.formats.verl.shards import Built

__all__ = ["describe"]

_FORMAT = "torch_checkpointing"


@dataclass(frozen=True, kw_only=True, slots=True)
class TorchCheckpointingSource:
    """A torch_checkpointing save's own fields of the manifest's `source` block."""

    ORDER: ClassVar[tuple[str, ...]] = (
        "format", "checkpoint", "tag", "world_size", "num_tensors", "num_params",
        "other_items", "non_tensor_entries", "checkpoint_bytes", "files", "content_sha256",
    )  # fmt: skip

    world_size: int
    num_tensors: int
    other_items: tuple[str, ...]
    non_tensor_entries: tuple[str, ...]

    @property
    def order(self) -> tuple[str, ...]:
        return self.ORDER

    def fields(self) -> dict[str, object]:
        return {
            "world_size": self.world_size,
            "num_tensors": self.num_tensors,
            "other_items": list(self.other_items),
            "non_tensor_entries": list(self.non_tensor_entries),
        }

    def headline(self, common: SourceDescription) -> str:
        return f"({_FORMAT}, world size {self.world_size}, {self.num_tensors} tensors)"


def describe(
    *,
    url: str,
    tag: str,
    files: list[SourceFile],
    built: Built,
    other_items: Mapping[str, int],
    metadata_bytes: int,
    safetensors_fingerprint: str | None = None,
) -> SourceLayout:
    """The reader's `SourceLayout`: tensors, slots, and what the manifest and `inspect` say.

    `safetensors_fingerprint` (the safetensors layout's, from its headers and metadata.pkl)
    stands for the default layout's fingerprint of its zip records' CRC-32s."""
    safetensors = safetensors_fingerprint is not None
    source = shards_source(
        fmt=_FORMAT, url=url, tag=tag, files=files, built=built,
        content_sha256=safetensors_fingerprint or _fingerprint(files, built.slots),
        details=TorchCheckpointingSource(
            world_size=len(files),
            num_tensors=len(built.tensors),
            other_items=tuple(other_items),
            non_tensor_entries=tuple(built.non_tensor),
        ),
    )  # fmt: skip
    params, total = source.num_params, source.checkpoint_bytes
    dtypes = Counter(t.dtype for t in built.tensors.values())
    others = ", ".join(f"{item} ({n} file(s))" for item, n in other_items.items()) or "none"
    about = [
        f"Checkpoint  {url}  ({_FORMAT}, world size {len(files)})",
        f"  {len(built.tensors)} tensors ({params:,} elements) in {len(files)} model rank "
        f"file(s), {format_bytes(total)}"
        + (" (safetensors layout, placed by metadata.pkl)" if safetensors else ""),
        f"  other items (never read): {others}",
        *layout_lines(built, dtypes),
    ]
    about += tied_lines(built)
    facts = InspectFacts(
        fields={
            "checkpoint": url,
            "world_size": len(files),
            "tensors": len(built.tensors),
            "other_items": dict(other_items),
            **built_fields(built, dtypes),
            "files": {"model": len(files), "total_bytes": total},
        },
        about=about,
        read_labels=ReadLabels(
            main="local shards of the model rank files",
            other="other",
            metadata=(
                "metadata.pkl and the safetensors headers"
                if safetensors
                else "pickles and zip directories"
            ),
            never="the other items' files (optimizer state, counters) are never read",
        ),
    )
    return shards_layout(
        fmt=_FORMAT, url=url, tag=tag, files=files, built=built, source=source, facts=facts,
        metadata_bytes=metadata_bytes, main_slot_kind="chunk" if safetensors else "shard",
        notes=_notes(built), lowp_missing=f"{_FORMAT} saves the sharded model weights only",
    )  # fmt: skip


def _notes(built: Built) -> list[str]:
    notes = [
        f"{name} is saved apart from {first} with the same size and CRC-32 in every rank "
        "file: both are written, no tie is recorded"
        for name, first in built.copies.items()
    ]
    if built.non_tensor:
        notes.append(
            f"{len(built.non_tensor)} non-tensor entr(ies) of the model item not converted: "
            + ", ".join(built.non_tensor[:8])
        )
    return notes


def _fingerprint(files: Sequence[SourceFile], slots: Sequence[Slot]) -> str:
    return shards_fingerprint(f"{_FORMAT} {len(files)}", slots)
