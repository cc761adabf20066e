"""What `inspect`, the plan's notes and the manifest say about a PyTorch DCP checkpoint."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from zerosafe.formats.base import InspectFacts, ReadLabels, SourceDescription
from zerosafe.units import format_bytes

if TYPE_CHECKING:
    from zerosafe.formats.base import Slot, SourceFile
    from zerosafe.formats.dcp.metadata import DcpMetadata, TensorMeta
    from zerosafe.formats.dcp.reader import Selected
    from zerosafe.formats.dcp.stored import StoredChunk

__all__ = [
    "DcpSource",
    "chunk_grid",
    "dcp_facts",
    "dcp_notes",
    "dcp_source_block",
    "sharding_text",
]

_Located = Sequence[Sequence["StoredChunk | None"]]


def chunk_grid(tensor: TensorMeta) -> tuple[int, ...]:
    """How many distinct chunk starts each dimension has: `(4, 1)` for a dim-0 shard over 4
    ranks, `(2, 2)` for a 2-D mesh, all ones for a whole (replicated or plain) tensor."""
    return tuple(len({offsets[d] for offsets, _ in tensor.chunks}) for d in range(len(tensor.size)))


def sharding_text(grid: tuple[int, ...]) -> str:
    """`whole`, `4 chunks on dim 0`, `2x2 grid on dims 0,1`."""
    split = [d for d, n in enumerate(grid) if n > 1]
    if not split:
        return "whole"
    if len(split) == 1:
        return f"{grid[split[0]]} chunks on dim {split[0]}"
    return f"{'x'.join(str(grid[d]) for d in split)} grid on dims {','.join(map(str, split))}"


def _selection_text(selected: Selected) -> str:
    prefixes = ", ".join(f"'{p}'" if p else "every key" for p in selected.select)
    strip = f", '{selected.strip_prefix}.' stripped" if selected.strip_prefix else ""
    return f"under {prefixes}{strip}"


def _subtree_text(selected: Selected) -> str:
    """Why the default selection took a subtree other than `model`; "" where it did not."""
    if selected.model_subtree is None:
        return ""
    return (
        f"no top-level `model` key: converting '{selected.model_subtree}', the only subtree "
        "named `model` beside the optimizer state (which is never converted as weights), "
        f"named without '{selected.model_subtree}.'; --select PREFIX picks another"
    )


def _not_selected(meta: DcpMetadata, selected: Selected) -> list[str]:
    picked = {fqn for fqn, _ in selected.pairs}
    return [k for k in meta.tensors if k not in picked]


def dcp_facts(
    url: str,
    meta: DcpMetadata,
    selected: Selected,
    files: Sequence[SourceFile],
    slots: Sequence[Slot],
    located: _Located,
) -> InspectFacts:
    """`inspect`'s DCP section: what the checkpoint holds and what was selected."""
    chosen = [meta.tensors[fqn] for fqn, _ in selected.pairs]
    left = _not_selected(meta, selected)
    dtypes = Counter(t.dtype for t in chosen)
    sharding = Counter(sharding_text(chunk_grid(t)) for t in chosen)
    meshes = sorted({g for t in chosen if (g := tuple(n for n in chunk_grid(t) if n > 1))})
    forms = sorted({c.serialization for row in located for c in row if c is not None})
    distcp = [f for f in files if f.role == "distcp"]
    used = {s.file for s in slots}
    total = sum(f.size_bytes for f in files)
    about = [
        f"Checkpoint  {url}  (PyTorch DCP, metadata version {meta.version or 'unknown'})",
        f"  {len(meta.tensors)} tensors and {len(meta.byte_entries)} non-tensor entries; "
        f"{len(chosen)} tensors selected ({_selection_text(selected)})"
        + (
            f", {len(left)} not selected and never read "
            f"(top-level keys {sorted({k.split('.', 1)[0] for k in left})})"
            if left
            else ""
        ),
        f"  chunks: {len(slots)} stored chunk(s) of the selected tensors "
        f"({' and '.join(forms) or 'none'}) in {len(used)} of {len(distcp)} .distcp file(s); "
        f"{format_bytes(total)} in all",
        "  dtypes: " + ", ".join(f"{d} x {n}" for d, n in dtypes.most_common()),
        "  sharding: "
        + "; ".join(f"{s}: {n} tensor(s)" for s, n in sharding.most_common())
        + (
            f" (mesh shape(s) inferred from the chunks: {', '.join(map(str, meshes))})"
            if meshes
            else ""
        ),
    ]
    if meta.byte_entries:
        shown = ", ".join(meta.byte_entries[:8]) + (" ..." if len(meta.byte_entries) > 8 else "")
        about.append(f"  non-tensor entries (listed in the manifest, not converted): {shown}")
    if meta.writers:
        about.append(f"  written by: {', '.join(meta.writers)}")
    fields: dict[str, object] = {
        "checkpoint": url,
        "dcp_version": meta.version,
        "writers": list(meta.writers),
        "tensors_in_checkpoint": len(meta.tensors),
        "tensors_selected": len(chosen),
        "select": list(selected.select),
        "strip_prefix": selected.strip_prefix,
        "model_subtree": selected.model_subtree,
        "not_selected": len(left),
        "non_tensor_entries": list(meta.byte_entries),
        "chunks": len(slots),
        "serialization": forms,
        "files": {"distcp": len(distcp), "read": len(used), "total_bytes": total},
        "dtypes": dict(dtypes),
        "sharding": dict(sharding),
        "meshes": [list(m) for m in meshes],
    }
    labels = ReadLabels(
        main="chunks of the selected tensors",
        other="other",
        metadata=".metadata and chunk headers",
        never="tensors not selected (optimizer state) are never read",
    )
    return InspectFacts(fields=fields, about=about, read_labels=labels)


def dcp_notes(meta: DcpMetadata, selected: Selected, located: _Located) -> list[str]:
    notes = [_subtree_text(selected)] if selected.model_subtree is not None else []
    left = _not_selected(meta, selected)
    if left:
        tops = sorted({k.split(".", 1)[0] for k in left})
        notes.append(
            f"{len(left)} tensor(s) not selected and not read (top-level keys {tops}); "
            "--select PREFIX converts them"
        )
    if meta.byte_entries:
        shown = ", ".join(meta.byte_entries[:8]) + (" ..." if len(meta.byte_entries) > 8 else "")
        notes.append(
            f"{len(meta.byte_entries)} non-tensor entr(ies) listed in the manifest, not "
            f"converted: {shown}"
        )
    if meta.written_by_olmo_core:
        notes.append(
            "written by OLMo-core's checkpointer: tensors keep OLMo-core's own names (no "
            "Hugging Face mapping is applied)"
        )
    formats = {c.serialization for row in located for c in row if c is not None}
    if "safetensors" in formats:
        notes.append("chunks stored as safetensors (SerializationFormat.SAFETENSORS)")
    return notes


@dataclass(frozen=True, kw_only=True, slots=True)
class DcpSource:
    """A DCP checkpoint's own fields of the manifest's `source` block (`SourceDetails`)."""

    ORDER: ClassVar[tuple[str, ...]] = (
        "format", "format_name", "checkpoint", "tag", "dcp_version", "writers",
        "num_tensors_in_checkpoint", "num_tensors_selected", "num_params", "select",
        "strip_prefix", "non_tensor_entries", "num_distcp_files", "checkpoint_bytes", "files",
        "content_sha256",
    )  # fmt: skip
    TITLE: ClassVar[str] = "PyTorch DCP"

    dcp_version: str | None
    writers: tuple[str, ...]
    """Who wrote the checkpoint's chunks (torch's writer, OLMo-core's)."""
    num_tensors_in_checkpoint: int
    num_tensors_selected: int
    select: tuple[str, ...]
    strip_prefix: str | None
    non_tensor_entries: tuple[str, ...]
    num_distcp_files: int

    @property
    def order(self) -> tuple[str, ...]:
        return self.ORDER

    def fields(self) -> dict[str, object]:
        return {
            "format_name": self.TITLE,
            "dcp_version": self.dcp_version,
            "writers": list(self.writers),
            "num_tensors_in_checkpoint": self.num_tensors_in_checkpoint,
            "num_tensors_selected": self.num_tensors_selected,
            "select": list(self.select),
            "strip_prefix": self.strip_prefix,
            "non_tensor_entries": list(self.non_tensor_entries),
            "num_distcp_files": self.num_distcp_files,
        }

    def headline(self, common: SourceDescription) -> str:
        return (
            f"({self.TITLE}, {self.num_tensors_selected} of {self.num_tensors_in_checkpoint} "
            f"tensors selected, {self.num_distcp_files} .distcp files)"
        )


def dcp_source_block(
    url: str,
    meta: DcpMetadata,
    selected: Selected,
    files: Sequence[SourceFile],
    fingerprint: str,
) -> SourceDescription:
    """The manifest's `source` block."""
    return SourceDescription(
        format="dcp",
        checkpoint=url,
        tag=url.rstrip("/").rsplit("/", 1)[-1],
        num_params=sum(math.prod(meta.tensors[fqn].size) for fqn, _ in selected.pairs),
        checkpoint_bytes=sum(f.size_bytes for f in files),
        files=tuple(f.identity for f in files),
        content_sha256=fingerprint,
        details=DcpSource(
            dcp_version=meta.version,
            writers=tuple(meta.writers),
            num_tensors_in_checkpoint=len(meta.tensors),
            num_tensors_selected=len(selected.pairs),
            select=tuple(selected.select),
            strip_prefix=selected.strip_prefix,
            non_tensor_entries=tuple(meta.byte_entries),
            num_distcp_files=sum(f.role == "distcp" for f in files),
        ),
    )
