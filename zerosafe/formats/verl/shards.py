"""The tensors of a verl FSDP checkpoint, rebuilt from every rank's local shard.

FSDP2 saves each parameter as a `DTensor` on a 1-D device mesh of all W ranks, with one
placement: `Shard(0)` (the default) or `Replicate()`. `Shard(0)` splits dim 0 as `torch.chunk`
does: chunks of ceil(n / W) rows, so the last rank(s) hold fewer rows, or none (the rank
file then holds a view of that many rows of its padded storage). Rank r's rows start at
r * ceil(n / W), and a dim-0 block of a row-major tensor is one contiguous run of the output:
one fragment per rank. `Replicate()` and plain tensors (buffers, which FSDP leaves whole on
every rank) are read from rank 0, as verl's merger does. Other placements (`Shard(d)` for
d > 0, `Partial`, `_StridedShard` of FSDP+TP) and meshes of more than one dimension are
refused by name.
"""

from __future__ import annotations

import hashlib
import math
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from zerosafe.errors import CheckpointFormatError, UnsupportedCheckpointError
from zerosafe.formats.base import Fragment, Slot, SourceFile, SourceTensor, record_slot
from zerosafe.formats.torch_pickle import DTensorRecord, InertObject, TensorRecord
from zerosafe.formats.torch_zip import TorchZipFile

__all__ = [
    "VERL_FALLBACK",
    "Built",
    "RankFile",
    "build_tensors",
    "layout_lines",
    "shard_rows",
    "shards_fingerprint",
    "tied_lines",
]

VERL_FALLBACK = "convert it with verl's model_merger"


@dataclass(kw_only=True)
class RankFile:
    """One opened `model_world_size_W_rank_R.pt`: its unpickled state dict (records only)."""

    rank: int
    file: SourceFile
    zip: TorchZipFile
    state: dict[str, Any]


@dataclass(kw_only=True)
class Built:
    """What the rank files hold, as the reader's `SourceLayout` needs it."""

    tensors: dict[str, SourceTensor] = field(default_factory=dict)
    slots: list[Slot] = field(default_factory=list)
    order: list[str] = field(default_factory=list)
    aliases: dict[str, str] = field(default_factory=dict)
    placements: dict[str, int] = field(default_factory=dict)
    """How many tensors of each kind: `Shard(0)`, `Replicate()`, `plain` (not a DTensor)."""
    uneven: int = 0
    """Sharded tensors whose rows do not split evenly over the ranks."""
    non_tensor: list[str] = field(default_factory=list)
    """State-dict keys whose values are not tensors (not converted)."""
    copies: dict[str, str] = field(default_factory=dict)
    """Tensors saved apart whose local shards have the same size and CRC-32 as an earlier
    tensor's in every rank file (FSDP1 saves a tied head as a copy): name -> the earlier one.
    Both are written; this only explains why no tie is recorded."""


def shard_rows(rows: int, world_size: int) -> list[int]:
    """Rows of each rank under `Shard(0)`: `torch.chunk`'s chunks of ceil(rows / W)."""
    chunk = -(-rows // world_size) if rows else 0
    return [max(0, min(chunk, rows - r * chunk)) for r in range(world_size)]


def _placement_name(placement: Any) -> str:
    if not isinstance(placement, InertObject):
        return repr(placement)
    kind = placement.qualname.rsplit(".", 1)[-1]
    dim = placement.get("dim")
    return f"{kind}({dim})" if dim is not None else f"{kind}()"


def _mesh_size(where: str, spec: InertObject, world_size: int, fallback: str) -> None:
    """Refuse a mesh that is not 1-D over all ranks (HSDP, FSDP+TP)."""
    mesh = spec.get("mesh")
    rank_map = mesh.get("_rank_map") if isinstance(mesh, InertObject) else None
    if isinstance(rank_map, TensorRecord) and rank_map.numel != world_size:
        raise UnsupportedCheckpointError(
            f"{where}: its device mesh spans {rank_map.numel} rank(s) in shape "
            f"{list(rank_map.shape)}, where zerosafe reads FSDP2 on a 1-D mesh of all "
            f"{world_size} ranks; {fallback}"
        )


def _check_dtensor(
    where: str, pieces: Sequence[DTensorRecord], world_size: int, fallback: str
) -> str:
    """The placement all ranks agree on (`Shard(0)` or `Replicate()`), checked."""
    first = pieces[0]
    names = [tuple(_placement_name(p) for p in piece.placements) for piece in pieces]
    for rank, piece in enumerate(pieces):
        if (piece.shape, piece.dtype, names[rank]) != (first.shape, first.dtype, names[0]):
            raise CheckpointFormatError(
                f"{where}: rank {rank} saves it as {piece.dtype} {list(piece.shape)} "
                f"{list(names[rank])}, rank 0 as {first.dtype} {list(first.shape)} "
                f"{list(names[0])}; the rank files come from different saves"
            )
    if len(names[0]) != 1 or names[0][0] not in ("Shard(0)", "Replicate()"):
        raise UnsupportedCheckpointError(
            f"{where}: placements {list(names[0])}, where zerosafe reads one Shard(0) or "
            f"Replicate() placement (FSDP2 on a 1-D mesh); {fallback}"
        )
    _mesh_size(where, first.spec, world_size, fallback)
    for rank, piece in enumerate(pieces):
        mesh = piece.spec.get("mesh")
        coordinate = mesh.get("_coordinate_on_dim") if isinstance(mesh, InertObject) else None
        if coordinate is not None and tuple(coordinate) != (rank,):
            # the shards are placed by the file's rank: a mesh that orders the ranks otherwise
            # would place them wrong
            raise UnsupportedCheckpointError(
                f"{where}: rank {rank}'s file holds the shard of mesh coordinate "
                f"{list(coordinate)}, not [{rank}]: the rank files were renamed or mixed up "
                "(copy the folder again), or the device mesh orders the ranks otherwise, "
                "which zerosafe does not read"
            )
        if not piece.local.is_contiguous():
            raise CheckpointFormatError(
                f"{where}: rank {rank}'s local shard is not contiguous (stride "
                f"{list(piece.local.stride)}); FSDP2 saves contiguous shards"
            )
    return names[0][0]


def _local_rows(where: str, pieces: Sequence[DTensorRecord], placement: str) -> list[int]:
    """Each rank's rows of the output, checked against the placement's split."""
    shape = pieces[0].shape
    if placement == "Replicate()":
        expected = [tuple(shape)] * len(pieces)
        rows = [0] * len(pieces)
        rows[0] = shape[0] if shape else 1
    else:
        if not shape:
            raise CheckpointFormatError(f"{where}: a 0-d tensor cannot be Shard(0)")
        rows = shard_rows(shape[0], len(pieces))
        expected = [(n, *shape[1:]) for n in rows]
    for rank, piece in enumerate(pieces):
        if tuple(piece.local.shape) != expected[rank]:
            raise CheckpointFormatError(
                f"{where}: rank {rank}'s local shard is {list(piece.local.shape)}, where "
                f"{placement} of {list(shape)} over {len(pieces)} ranks gives "
                f"{list(expected[rank])}; the file is corrupt or the ranks were mixed up"
            )
    return rows


def _signature(records: Sequence[TensorRecord]) -> tuple[Any, ...]:
    return tuple((r.storage.key, r.storage_offset, r.shape, r.stride, r.dtype) for r in records)


def build_tensors(url: str, ranks: Sequence[RankFile], *, fallback: str = VERL_FALLBACK) -> Built:
    """Every tensor of the rank files, as fragments of slots (local shards).

    Args:
        url: The folder, for errors.
        ranks: The opened rank files, in rank order.
        fallback: What the refusal of a placement or mesh zerosafe does not read tells the
            user to do instead (the saving framework's own tool: verl's model_merger).

    Raises:
        CheckpointFormatError: If the ranks disagree on the keys, a shard has the wrong shape,
            or a rank's values are of different kinds.
        UnsupportedCheckpointError: For a placement or mesh other than FSDP2's 1-D one.
    """
    built = Built()
    keys = list(ranks[0].state)
    for rank_file in ranks[1:]:
        if list(rank_file.state) != keys:
            diff = sorted(set(keys) ^ set(rank_file.state))[:5]
            raise CheckpointFormatError(
                f"{rank_file.file.url}: holds other keys than rank 0's ({diff or 'another order'}); "
                "the rank files come from different saves"
            )
    pending: list[tuple[RankFile, str, TensorRecord]] = []
    seen: dict[tuple[Any, ...], str] = {}
    for key in keys:
        values = [r.state[key] for r in ranks]
        where = f"{url}: '{key}'"
        if all(isinstance(v, DTensorRecord) for v in values):
            placement = _check_dtensor(where, values, len(ranks), fallback)
            rows = _local_rows(where, values, placement)
            locals_ = [v.local for v in values]
            shape, dtype, role = values[0].shape, values[0].dtype, "param"
        elif all(isinstance(v, TensorRecord) for v in values):
            placement, shape, dtype, role = "plain", values[0].shape, values[0].dtype, "buffer"
            rows, locals_ = [shape[0] if shape else 1] + [0] * (len(ranks) - 1), list(values)
            _check_plain(where, values)
        elif any(isinstance(v, (DTensorRecord, TensorRecord)) for v in values):
            kinds = sorted({type(v).__name__ for v in values})
            raise CheckpointFormatError(f"{where}: the ranks save it as different kinds {kinds}")
        else:
            built.non_tensor.append(key)
            continue
        built.order.append(key)
        signature = _signature(locals_)
        if signature in seen and built.tensors[seen[signature]].shape == tuple(shape):
            built.aliases[key] = seen[signature]  # a tied weight: the same storage everywhere
            continue
        seen[signature] = key
        built.placements[placement] = built.placements.get(placement, 0) + 1
        built.uneven += placement == "Shard(0)" and shape[0] % len(ranks) != 0
        built.tensors[key] = _fragments(key, shape, dtype, role, rows, ranks, locals_, pending)
    built.slots = _resolve_slots(pending)
    built.copies = _same_crcs(built)
    return built


def _same_crcs(built: Built) -> dict[str, str]:
    seen: dict[tuple[Any, ...], str] = {}
    copies = {}
    for name, tensor in built.tensors.items():
        slots = [built.slots[f[0]] for f in tensor.fragments]
        if not slots or any(not s.record_crc32 for s in slots):
            continue  # saved without CRCs: nothing to compare
        key = (tensor.shape, tensor.dtype, *((s.rank, s.numel, s.record_crc32) for s in slots))
        if key in seen:
            copies[name] = seen[key]
        else:
            seen[key] = name
    return copies


def _check_plain(where: str, values: Sequence[TensorRecord]) -> None:
    for rank, value in enumerate(values):
        if (value.shape, value.dtype) != (values[0].shape, values[0].dtype):
            raise CheckpointFormatError(
                f"{where}: rank {rank} saves {value.dtype} {list(value.shape)}, rank 0 "
                f"{values[0].dtype} {list(values[0].shape)}; a tensor FSDP leaves whole is the "
                "same on every rank"
            )
    if not values[0].is_contiguous():
        raise CheckpointFormatError(f"{where}: not contiguous (stride {list(values[0].stride)})")


def _fragments(
    key: str,
    shape: tuple[int, ...],
    dtype: str,
    role: str,
    rows: Sequence[int],
    ranks: Sequence[RankFile],
    locals_: Sequence[TensorRecord],
    pending: list[tuple[RankFile, str, TensorRecord]],
) -> SourceTensor:
    row_numel = math.prod(shape[1:]) if shape else 1
    fragments: list[Fragment] = []
    dst = 0
    for rank_file, local, count in zip(ranks, locals_, rows, strict=True):
        numel = count * row_numel
        if numel:
            fragments.append((len(pending), 0, numel, dst))
            pending.append((rank_file, key, local))
        dst += numel
    return SourceTensor(
        name=key, shape=tuple(shape), dtype=dtype, role=role, fragments=tuple(fragments)
    )


def _resolve_slots(
    pending: Sequence[tuple[RankFile, str, TensorRecord]], max_workers: int = 8
) -> list[Slot]:
    """One slot per local shard read; each needs its record's zip local header (one read)."""

    def one(index: int, item: tuple[RankFile, str, TensorRecord]) -> Slot:
        rank_file, key, t = item
        return record_slot(
            rank_file.zip, t, where=f"{rank_file.file.url}: '{key}'", index=index,
            file=rank_file.file.index, rank=rank_file.rank, kind="shard",
            name=f"{key}@rank{rank_file.rank}",
        )  # fmt: skip

    with ThreadPoolExecutor(max_workers=max_workers) as pool:
        return list(pool.map(one, range(len(pending)), pending))


def shards_fingerprint(head: str, slots: Sequence[Slot]) -> str:
    """SHA-256 of `head` and every local shard's name, record size and CRC-32 (zip directory
    form): from headers only, the same after copies and moves, different for a changed shard
    (the content identity of a folder of per-rank DTensor files: verl's, torch_checkpointing's)."""
    h = hashlib.sha256(f"{head}\n".encode())
    for s in sorted(slots, key=lambda s: s.name):
        h.update(f"{s.name}\0{s.record_size_bytes}\0{s.record_crc32}\n".encode())
    return h.hexdigest()


def layout_lines(built: Built, dtypes: Counter[str]) -> list[str]:
    """`inspect`'s lines on how the tensors are placed over the ranks, and their dtypes."""
    return [
        "  placements: "
        + ", ".join(f"{p} x {n}" for p, n in sorted(built.placements.items()))
        + (f" ({built.uneven} split unevenly over the ranks)" if built.uneven else ""),
        "  dtypes: " + ", ".join(f"{d} x {n}" for d, n in dtypes.most_common()),
    ]


def tied_lines(built: Built) -> list[str]:
    """`inspect`'s line on tied aliases, where there are any."""
    if not built.aliases:
        return []
    return ["  tied: " + ", ".join(f"{a} -> {t}" for a, t in sorted(built.aliases.items()))]
