"""What `inspect`, the plan's notes and the manifest say about a verl FSDP checkpoint, and the
`SourceLayout` that carries it: `describe` is the one place the reader's `source` and `facts`
are made."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from zerosafe.formats.base import InspectFacts, ReadLabels, SourceDescription, SourceLayout
from zerosafe.formats.verl.rank_files import built_fields, shards_layout, shards_source
from zerosafe.formats.verl.shards import layout_lines, shards_fingerprint, tied_lines
from zerosafe.units import format_bytes

if TYPE_CHECKING:
    from zerosafe.formats.base import Slot, SourceFile
    from zerosafe.formats.verl.shards import Built

__all__ = ["describe"]

_FORMAT = "verl"
_FORMAT_NAME = "verl FSDP"


@dataclass(frozen=True, kw_only=True, slots=True)
class VerlSource:
    """A verl checkpoint's own fields of the manifest's `source` block (`SourceDetails`)."""

    ORDER: ClassVar[tuple[str, ...]] = (
        "format", "format_name", "checkpoint", "tag", "world_size", "fsdp_version",
        "num_tensors", "num_params", "non_tensor_entries", "checkpoint_bytes", "files",
        "content_sha256",
    )  # fmt: skip

    world_size: int
    fsdp_version: Any
    num_tensors: int
    non_tensor_entries: tuple[str, ...]

    @property
    def order(self) -> tuple[str, ...]:
        return self.ORDER

    def fields(self) -> dict[str, object]:
        return {
            "format_name": _FORMAT_NAME,
            "world_size": self.world_size,
            "fsdp_version": self.fsdp_version,
            "num_tensors": self.num_tensors,
            "non_tensor_entries": list(self.non_tensor_entries),
        }

    def headline(self, common: SourceDescription) -> str:
        return (
            f"({_FORMAT_NAME}, {_wrapping(self.fsdp_version)}, world size {self.world_size}, "
            f"{self.num_tensors} tensors)"
        )


def describe(
    *,
    url: str,
    tag: str,
    files: list[SourceFile],
    built: Built,
    config: dict[str, Any] | None,
    model_files: str | None,
    metadata_bytes: int,
) -> SourceLayout:
    """The reader's `SourceLayout`: tensors, slots, and what the manifest and `inspect` say."""
    models = [f for f in files if f.role == "model"]
    fsdp_version = config.get("FSDP_version") if config else None
    source = shards_source(
        fmt=_FORMAT, url=url, tag=tag, files=files, built=built,
        content_sha256=_fingerprint(files, built.slots),
        details=VerlSource(
            world_size=len(models),
            fsdp_version=fsdp_version,
            num_tensors=len(built.tensors),
            non_tensor_entries=tuple(built.non_tensor),
        ),
        model_files=model_files,
    )  # fmt: skip
    params, total = source.num_params, source.checkpoint_bytes
    dtypes = Counter(t.dtype for t in built.tensors.values())
    about = [
        f"Checkpoint  {url}  (verl, {_wrapping(fsdp_version)}, world size {len(models)})",
        f"  {len(built.tensors)} tensors ({params:,} elements) in {len(models)} model rank "
        f"file(s), {format_bytes(sum(f.size_bytes for f in models))}; optimizer and extra "
        "state files are never read",
        *layout_lines(built, dtypes),
        f"  model files: {model_files or 'none (no huggingface/ folder)'}",
    ]
    about += tied_lines(built)
    facts = InspectFacts(
        fields={
            "checkpoint": url,
            "world_size": len(models),
            "fsdp_version": fsdp_version,
            "tensors": len(built.tensors),
            **built_fields(built, dtypes),
            "model_files": model_files,
            "files": {"model": len(models), "total_bytes": total},
        },
        about=about,
        read_labels=ReadLabels(
            main="local shards of the model rank files",
            other="other",
            metadata="pickles, zip directories and fsdp_config.json",
            never="optimizer and extra-state files are never read",
        ),
    )
    return shards_layout(
        fmt=_FORMAT, url=url, tag=tag, files=files, built=built, source=source, facts=facts,
        metadata_bytes=metadata_bytes, main_slot_kind="shard",
        notes=_notes(built, config), warnings=_warnings(built),
        lowp_missing="verl saves only the sharded model weights, no second copy",
    )  # fmt: skip


def _wrapping(fsdp_version: Any) -> str:
    if fsdp_version in (1, 2):
        return f"FSDP{fsdp_version}"
    if fsdp_version == 0:
        return "model not FSDP-wrapped"
    return "FSDP version not recorded"


def _warnings(built: Built) -> list[str]:
    lora = [k for k in built.order if ".lora_A." in k or ".lora_B." in k]
    if not lora:
        return []
    return [
        f"a LoRA actor ({len(lora)} LoRA tensors): the output keeps the state dict's PEFT names "
        "(`base_model.model.`, `.base_layer`, `.default`), which from_pretrained of the base "
        "model does not load; verl's model_merger writes the base weights under the model's "
        "own names and the adapter apart"
    ]


def _notes(built: Built, config: dict[str, Any] | None) -> list[str]:
    notes = []
    if config is None:
        notes.append("no fsdp_config.json (verl writes it on rank 0): world size from file names")
    for name, first in built.copies.items():
        notes.append(
            f"{name} is saved apart from {first} with the same size and CRC-32 in every rank "
            "file (FSDP1 saves a tied weight as a copy): both are written, no tie is recorded"
        )
    if built.non_tensor:
        notes.append(
            f"{len(built.non_tensor)} non-tensor entr(ies) not converted: "
            + ", ".join(built.non_tensor[:8])
        )
    return notes


def _fingerprint(files: Sequence[SourceFile], slots: Sequence[Slot]) -> str:
    return shards_fingerprint(f"verl {sum(f.role == 'model' for f in files)}", slots)
