"""torch_checkpointing's safetensors layout: global tensors from `model_R.safetensors` and
`metadata.pkl`.

An item saved with `SafetensorsSerialization` (torch_checkpointing 0.1.1,
checkpoint_layout.py) is one safetensors file per rank holding the rank's local shards under
their full names (DTensors unwrapped to their local tensor), no offsets; where each shard lies
is only in `metadata.pkl` (`metadata.py`): each tensor's global shape, dtype, device mesh and
placements. A rank's shard is the box DTensor gives its mesh coordinate (torch's
`compute_local_shape_and_global_offset`: each `Shard(d)` of mesh dimension i splits the
rank's current extent of dim d into `torch.chunk`'s pieces of ceil(n / mesh size), in mesh
dimension order); a `Replicate()` dimension's copies are checked like the others and read
from coordinate 0 only.

Every rank file's header (`zerosafe.formats.hf.headers`) must name exactly the tensors
metadata.pkl places on that rank, each with its dtype and the shape of its box; the boxes must
then tile each tensor exactly once (`zerosafe.formats.hf.sharded.place_chunks`, DCP's chunk
geometry), so a missing rank file, a gap, an overlap or a header that disagrees is refused in
one line before anything is written.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from zerosafe.errors import CheckpointFormatError, UnsupportedCheckpointError
from zerosafe.formats.base import SourceFile
from zerosafe.formats.hf.headers import HeaderTensor, SafetensorsHeader, read_checked_header
from zerosafe.formats.hf.sharded import PlacedChunk, place_chunks
from zerosafe.formats.torch_checkpointing.metadata import ShardedTensor, TcMetadata, parse_metadata
from zerosafe.formats.verl.shards import Built
from zerosafe.io.storage import Storage, join_url

__all__ = ["METADATA_FILE", "SafetensorsSave", "local_box", "read_safetensors_save"]

METADATA_FILE = "metadata.pkl"
_CONSOLIDATE = "torch_checkpointing.hf.consolidate_hf_safetensors_checkpoint"


@dataclass(kw_only=True)
class SafetensorsSave:
    """What the reader needs of a safetensors-layout save."""

    files: list[SourceFile]
    built: Built
    fingerprint: str


def local_box(
    sharded: ShardedTensor, coordinate: Sequence[int]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The `(offsets, sizes)` of the shard a mesh coordinate holds: DTensor's rule for
    `Shard`/`Replicate` placements, applied in mesh dimension order."""
    offsets = [0] * len(sharded.global_shape)
    sizes = list(sharded.global_shape)
    for placement, parts, index in zip(
        sharded.placements, sharded.mesh_shape, coordinate, strict=True
    ):
        if placement.dim is None:
            continue
        extent = sizes[placement.dim]
        chunk = -(-extent // parts)
        start = min(chunk * index, extent)
        sizes[placement.dim] = min(extent, start + chunk) - start
        offsets[placement.dim] += start
    return tuple(offsets), tuple(sizes)


def _coordinate(sharded: ShardedTensor, rank: int) -> tuple[int, ...]:
    flat = sharded.mesh_ranks.index(rank)
    coordinate = []
    for size in reversed(sharded.mesh_shape):
        coordinate.append(flat % size)
        flat //= size
    return tuple(reversed(coordinate))


def _check_world(url: str, meta: TcMetadata, names: Sequence[str], present: set[str]) -> None:
    missing = [f"{p} (rank {r})" for r, p in sorted(meta.rank_files.items()) if p not in present]
    if missing:
        raise CheckpointFormatError(
            f"{url}: {METADATA_FILE} places the model shards of {meta.world_size} ranks, but "
            f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} missing; each rank "
            "writes its own file, so the save did not finish or was copied in part. Copy the "
            "whole folder again"
        )
    if sorted(meta.rank_files.values()) != sorted(names):
        raise CheckpointFormatError(
            f"{url}: {METADATA_FILE} names the model files {sorted(meta.rank_files.values())}, "
            f"but the folder holds {sorted(names)}: files of different saves share this "
            "folder; copy the whole save folder again"
        )


def _header_of(
    url: str, header: SafetensorsHeader, name: str, group: ShardedTensor, box: tuple[int, ...]
) -> HeaderTensor:
    tensor = header.tensors[name]
    if tensor.dtype != group.dtype or tensor.shape != box:
        raise CheckpointFormatError(
            f"{header.url}: '{name}' is {tensor.dtype} {list(tensor.shape)} in the header, but "
            f"{METADATA_FILE} records a {group.dtype} shard of {list(box)} for this rank (a "
            f"{list(group.global_shape)} tensor placed "
            f"{', '.join(map(str, group.placements))} over a mesh of "
            f"{list(group.mesh_shape)}); the file does not belong to this save or was "
            f"rewritten since. Copy the whole save folder again"
        )
    return tensor


def _place(
    url: str, meta: TcMetadata, headers: Sequence[SafetensorsHeader], files: Sequence[SourceFile]
) -> tuple[dict[str, list[PlacedChunk]], dict[str, tuple[int, ...]], Counter[str], int]:
    chunks: dict[str, list[PlacedChunk]] = {}
    sizes: dict[str, tuple[int, ...]] = {}
    placements: Counter[str] = Counter()
    uneven = 0
    expected: dict[int, set[str]] = {r: set() for r in range(meta.world_size)}
    for name, groups in meta.tensors.items():
        first = groups[0]
        sizes[name] = first.global_shape
        placements[", ".join(map(str, first.placements))] += 1
        uneven += any(
            p.dim is not None and first.global_shape[p.dim] % n
            for p, n in zip(first.placements, first.mesh_shape, strict=True)
        )
        for group in groups:
            if (group.global_shape, group.dtype) != (first.global_shape, first.dtype):
                raise CheckpointFormatError(
                    f"{url}: {METADATA_FILE} records '{name}' as {first.dtype} "
                    f"{list(first.global_shape)} on ranks {list(first.ranks)} and as "
                    f"{group.dtype} {list(group.global_shape)} on ranks {list(group.ranks)}; "
                    "the file is damaged: copy the whole save folder again"
                )
            for rank in group.ranks:
                if name in expected[rank]:
                    raise CheckpointFormatError(
                        f"{url}: {METADATA_FILE} places '{name}' on rank {rank} twice; the "
                        "file is damaged: copy the whole save folder again"
                    )
                expected[rank].add(name)
                coordinate = _coordinate(group, rank)
                offsets, box = local_box(group, coordinate)
                header = headers[rank]
                if name not in header.tensors:
                    continue  # named below with the rest of the rank's differences
                tensor = _header_of(url, header, name, group, box)
                replica = any(
                    p.dim is None and c for p, c in zip(group.placements, coordinate, strict=True)
                )
                if not replica:
                    chunks.setdefault(name, []).append(
                        PlacedChunk(tensor=tensor, offsets=offsets, file=files[rank])
                    )
    for rank, header in enumerate(headers):
        lacking = sorted(expected[rank] - set(header.tensors))
        extra = sorted(set(header.tensors) - expected[rank])
        if lacking or extra:
            found = []
            if lacking:
                found.append(f"lacks {lacking[:4]}, which {METADATA_FILE} places on rank {rank}")
            if extra:
                found.append(f"holds {extra[:4]}, which {METADATA_FILE} does not place there")
            raise CheckpointFormatError(
                f"{header.url}: the header {' and '.join(found)}; the file does not belong to "
                "this save or was rewritten since. Copy the whole save folder again"
            )
    for name in sizes:
        chunks.setdefault(name, [])
    return chunks, sizes, placements, uneven


def read_safetensors_save(storage: Storage, url: str, names: Sequence[str]) -> SafetensorsSave:
    """The model item of a safetensors-layout save, placed by its `metadata.pkl`.

    Args:
        storage: Where the save is.
        url: The save folder.
        names: The model rank files in the folder, in rank order.

    Returns:
        The rank files, the global tensors (slots and fragments) and the save's fingerprint.

    Raises:
        UnsupportedCheckpointError: Without `metadata.pkl`, or for a layout it records that
            zerosafe does not read.
        CheckpointFormatError: If a rank file is missing, a header disagrees with
            `metadata.pkl`, or the shards overlap or leave a gap.
    """
    meta_url = join_url(url, METADATA_FILE)
    present = set(storage.listdir(url))
    if METADATA_FILE not in present:
        raise UnsupportedCheckpointError(
            f"{url}: holds the model item in torch_checkpointing's safetensors layout "
            f"(model_R.safetensors) without {METADATA_FILE}, the only record of the global "
            "shapes and placements (written only when an item declares a resharder); save "
            "with `ItemSpec(resharder=DefaultResharder())`, or consolidate it with "
            f"{_CONSOLIDATE}"
        )
    data = storage.read_bytes(meta_url)
    meta = parse_metadata(data, meta_url, item="model")
    _check_world(url, meta, names, present)
    files: list[SourceFile] = []
    headers: list[SafetensorsHeader] = []
    for rank in range(meta.world_size):
        ident = storage.identity(join_url(url, meta.rank_files[rank]))
        files.append(
            SourceFile(
                index=rank, url=ident.url, role="model", rank=rank,
                size_bytes=ident.size_bytes, version=ident.version,
            )
        )  # fmt: skip
        source = storage.open_source(ident.url)
        try:
            headers.append(read_checked_header(source))
        finally:
            source.close()
    chunks, sizes, placements, uneven = _place(url, meta, headers, files)
    placed = place_chunks(url, chunks, sizes)
    built = Built(
        tensors=placed.tensors, slots=placed.slots, order=placed.order,
        placements=dict(placements), uneven=uneven,
    )  # fmt: skip
    return SafetensorsSave(files=files, built=built, fingerprint=_fingerprint(data, headers))


def _fingerprint(metadata: bytes, headers: Sequence[SafetensorsHeader]) -> str:
    """SHA-256 over `metadata.pkl` and every rank file's size and header entries (name,
    dtype, shape, byte offset): headers only (safetensors records no checksum), the same
    after copies and moves; a change of values alone is caught by `verify --against`'s
    value sample."""
    h = hashlib.sha256(b"torch_checkpointing safetensors\n")
    h.update(hashlib.sha256(metadata).digest())
    for header in headers:
        h.update(f"{header.url.rsplit('/', 1)[-1]}\0{header.size_bytes}\n".encode())
        for t in sorted(header.tensors.values(), key=lambda t: t.name):
            h.update(f"{t.name}\0{t.dtype}\0{list(t.shape)}\0{t.byte_offset}\n".encode())
    return h.hexdigest()
