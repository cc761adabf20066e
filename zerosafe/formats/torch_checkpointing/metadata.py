"""torch_checkpointing's `metadata.pkl`, read as data: the global layout of a save's items.

torch_checkpointing 0.1.1 writes `metadata.pkl` when an item declares a resharder
(metadata_manager.py, `pickle.dumps(DistributedMetadata.to_dict())`; read back by
metadata_serialization.py's `TorchDistributedMetadataFormat`). `to_dict` turns every class of
distributed_metadata.py and dtensor_metadata.py into builtins, so the pickle holds dicts,
lists, tuples, strings, ints and None only (format version "2.0"):

    {"metadata": {item: {
        "nested_path_to_metadata": {json.dumps([fqn]): [
            {"sharding_metadata": {"type": "DTensorShardingMetadata", "data": {
                "global_shape": [...], "dtype": "torch.float32", "stride": [...],
                "mesh_spec": {"device_type", "mesh_shape", "mesh_data", "mesh_dim_names"},
                "placements": [{"type": "Shard", "dim": 0} | {"type": "Replicate"}
                               | {"type": "StridedShard", "dim", "split_factor"}]}},
             "ranks": (ranks sharing this metadata)}]},
        "rank_to_layout_info": {rank: {"file_path": "model_0.safetensors",
            "serialization_format": {"type": "SafetensorsSerialization", "metadata"?}} | None}}},
     "world_size": W, "version": "2.0"}

The unpickler's table of globals (`METADATA_GLOBALS`) is therefore empty: any global is
refused, nothing is constructed or run. Every dict is then checked against the fields above;
an unknown field, placement or sharding-metadata type (`default_tensor_v1`, a custom
`CheckpointableTensor`'s) is refused, naming it, rather than ignored.
"""

from __future__ import annotations

import json
import posixpath
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NoReturn

from zerosafe.dtypes import DTYPES
from zerosafe.errors import CheckpointFormatError, UnsafePickleError, UnsupportedCheckpointError
from zerosafe.formats.pickle_guard import GuardedUnpickler, seal_table

__all__ = ["METADATA_GLOBALS", "Placement", "ShardedTensor", "TcMetadata", "parse_metadata"]

METADATA_GLOBALS: dict[str, Any] = {}
"""The globals `metadata.pkl` may name: none (its writer pickles builtins only)."""
seal_table(METADATA_GLOBALS)

VERSION = "2.0"
_TOP = {"metadata", "world_size", "version"}
_ITEM = {"nested_path_to_metadata", "rank_to_layout_info"}
_GROUP = {"sharding_metadata", "ranks"}
_SHARDING = {"type", "data"}
_DTENSOR = {"global_shape", "dtype", "stride", "mesh_spec", "placements"}
_MESH = {"device_type", "mesh_shape", "mesh_data", "mesh_dim_names"}
_LAYOUT = {"file_path", "serialization_format"}
_PLACEMENTS = {"Shard": {"type", "dim"}, "Replicate": {"type"}}
SAFETENSORS = "SafetensorsSerialization"


@dataclass(frozen=True, kw_only=True, slots=True)
class Placement:
    """One mesh dimension's placement: `Shard(dim)` or `Replicate()` (dim None)."""

    dim: int | None

    def __str__(self) -> str:
        return "Replicate()" if self.dim is None else f"Shard({self.dim})"


@dataclass(frozen=True, kw_only=True, slots=True)
class ShardedTensor:
    """One group of `metadata.pkl`'s entry for a tensor: how it lies on `ranks`."""

    global_shape: tuple[int, ...]
    dtype: str
    """torch name (`float32`)."""
    mesh_shape: tuple[int, ...]
    mesh_ranks: tuple[int, ...]
    """The mesh's global ranks, row-major over `mesh_shape`."""
    placements: tuple[Placement, ...]
    ranks: tuple[int, ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class TcMetadata:
    """The model item's part of `metadata.pkl`."""

    world_size: int
    tensors: dict[str, list[ShardedTensor]]
    """fqn -> its groups, in file order."""
    rank_files: dict[int, str]
    """rank -> the model file's path in the save folder."""


class _MetadataUnpickler(GuardedUnpickler):
    table = METADATA_GLOBALS

    def unknown_global(self, qualname: str) -> UnsafePickleError:
        return UnsafePickleError(
            f"{self._url}: the pickle names the global '{qualname}', but torch_checkpointing "
            "writes metadata.pkl from builtins only (DistributedMetadata.to_dict()), so the "
            "file was not loaded (loading it could run code); it was crafted or written by "
            "another tool"
        )

    def persistent_load(self, pid: Any) -> NoReturn:
        raise CheckpointFormatError(
            f"{self._url}: the pickle has a persistent id {pid!r}; torch_checkpointing's "
            "metadata.pkl has none"
        )


def _bad(url: str, where: str, found: Any, expected: str) -> CheckpointFormatError:
    return CheckpointFormatError(
        f"{url}: {where} is {str(found)[:120]!r}, expected {expected}; the file is not a "
        "metadata.pkl written by torch_checkpointing 0.1.1 (or is damaged): copy it again"
    )


def _fields(
    url: str, where: str, value: Any, names: set[str], optional: frozenset[str] = frozenset()
) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _bad(url, where, value, f"a dict of {sorted(names)}")
    keys = set(value)
    if not names <= keys <= names | optional:
        unknown = sorted(map(str, keys - names - optional))
        missing = sorted(names - keys)
        raise _bad(
            url, where, sorted(map(str, keys)),
            f"the fields {sorted(names)}"
            + (f" (unknown: {unknown})" if unknown else "")
            + (f" (missing: {missing})" if missing else ""),
        )  # fmt: skip
    return value


def _ints(url: str, where: str, value: Any) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)) or not all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value
    ):
        raise _bad(url, where, value, "a list of non-negative ints")
    return tuple(value)


def _placement(url: str, where: str, raw: Any) -> Placement:
    kind = raw.get("type") if isinstance(raw, dict) else None
    if kind == "StridedShard":
        raise UnsupportedCheckpointError(
            f"{url}: {where} is a StridedShard placement (FSDP2 over tensor parallelism), "
            "which zerosafe does not reassemble; consolidate the save with "
            "torch_checkpointing.hf.consolidate_hf_safetensors_checkpoint"
        )
    if kind not in _PLACEMENTS:
        raise _bad(url, where, raw, "a Shard or Replicate placement")
    fields = _fields(url, where, raw, _PLACEMENTS[kind])
    if kind == "Replicate":
        return Placement(dim=None)
    dim = fields["dim"]
    if not isinstance(dim, int) or isinstance(dim, bool) or dim < 0:
        raise _bad(url, f"{where}'s dim", dim, "a non-negative int")
    return Placement(dim=dim)


def _sharded(url: str, where: str, raw: Any, world_size: int) -> ShardedTensor:
    group = _fields(url, where, raw, _GROUP)
    packed = _fields(url, f"{where}'s sharding_metadata", group["sharding_metadata"], _SHARDING)
    if packed["type"] != "DTensorShardingMetadata":
        raise UnsupportedCheckpointError(
            f"{url}: {where} has sharding metadata of type {packed['type']!r}, where zerosafe "
            "reads DTensors' ('DTensorShardingMetadata'); consolidate the save with "
            "torch_checkpointing.hf.consolidate_hf_safetensors_checkpoint"
        )
    data = _fields(url, f"{where}'s data", packed["data"], _DTENSOR)
    mesh = _fields(url, f"{where}'s mesh_spec", data["mesh_spec"], _MESH)
    shape = _ints(url, f"{where}'s global_shape", data["global_shape"])
    _ints(url, f"{where}'s stride", data["stride"])
    mesh_shape = _ints(url, f"{where}'s mesh_shape", mesh["mesh_shape"])
    mesh_ranks = _ints(url, f"{where}'s mesh_data", mesh["mesh_data"])
    ranks = _ints(url, f"{where}'s ranks", group["ranks"])
    placements = data["placements"]
    if not isinstance(placements, list) or len(placements) != len(mesh_shape):
        raise _bad(url, f"{where}'s placements", placements, f"{len(mesh_shape)} placement(s)")
    dtype = data["dtype"]
    name = dtype[len("torch.") :] if isinstance(dtype, str) and dtype.startswith("torch.") else ""
    if name not in DTYPES:
        raise _bad(url, f"{where}'s dtype", dtype, "a torch dtype ('torch.float32')")
    product = 1
    for n in mesh_shape:
        product *= n
    if (
        product != len(mesh_ranks)
        or len(set(mesh_ranks)) != len(mesh_ranks)
        or not set(ranks) <= set(mesh_ranks)
        or any(r >= world_size for r in mesh_ranks)
    ):
        raise _bad(
            url, f"{where}'s mesh", mesh,
            f"a mesh of {list(mesh_shape)} distinct ranks below the world size {world_size}, "
            f"holding the group's ranks {list(ranks)}",
        )  # fmt: skip
    return ShardedTensor(
        global_shape=shape, dtype=name, mesh_shape=mesh_shape, mesh_ranks=mesh_ranks,
        placements=tuple(
            _placement(url, f"{where}'s placement {i}", p) for i, p in enumerate(placements)
        ),
        ranks=ranks,
    )  # fmt: skip


def _fqn(url: str, key: Any) -> str:
    try:
        path = json.loads(key)
    except (TypeError, ValueError):
        path = None
    if not (isinstance(path, list) and len(path) == 1 and isinstance(path[0], str)):
        raise _bad(url, "a nested path", key, "a JSON list of one name ('[\"embed.weight\"]')")
    return path[0]


def _rank_files(url: str, raw: Any, world_size: int, item: str) -> dict[int, str]:
    if not isinstance(raw, dict) or set(raw) != set(range(world_size)):
        found = sorted(map(str, raw)) if isinstance(raw, dict) else raw
        raise _bad(
            url, f"'{item}' rank_to_layout_info", found,
            f"an entry for every rank 0..{world_size - 1}",
        )  # fmt: skip
    files: dict[int, str] = {}
    for rank, layout in sorted(raw.items()):
        where = f"'{item}' rank {rank}'s layout"
        fields = _fields(url, where, layout, _LAYOUT)
        fmt = _fields(
            url, f"{where}'s serialization_format", fields["serialization_format"], {"type"},
            frozenset({"metadata"}),
        )  # fmt: skip
        if fmt["type"] != SAFETENSORS:
            raise CheckpointFormatError(
                f"{url}: saves '{item}' of rank {rank} as {fmt['type']!r}, expected "
                f"{SAFETENSORS} as the rank files here are: metadata.pkl belongs to another "
                "save; copy the whole save folder again"
            )
        path = fields["file_path"]
        if (
            not isinstance(path, str)
            or posixpath.isabs(path)
            or ".." in path.split("/")
            or "\\" in path
            or not path.endswith(".safetensors")
        ):
            raise _bad(url, f"{where}'s file_path", path, "a .safetensors file inside the save")
        files[rank] = path
    return files


def parse_metadata(data: bytes, url: str, *, item: str) -> TcMetadata:
    """`metadata.pkl`'s layout of one item, unpickled as data and checked field by field.

    Args:
        data: The file's bytes.
        url: The file, for messages.
        item: The item to describe (`model`).

    Returns:
        The item's tensors, their groups, and each rank's file.

    Raises:
        UnsafePickleError: If the pickle names any global.
        CheckpointFormatError: If a field is missing, unknown or of the wrong kind.
        UnsupportedCheckpointError: For placements and sharding types zerosafe does not read.
    """
    try:
        raw = _MetadataUnpickler(data, url).load()
    except CheckpointFormatError:
        raise
    except Exception as e:  # noqa: BLE001 - any unpickling failure is a damaged file
        raise CheckpointFormatError(
            f"{url}: not a readable pickle ({type(e).__name__}: {e}); the save was not "
            "finished or the file was damaged: copy the whole folder again"
        ) from e
    top = _fields(url, "the pickle", raw, _TOP)
    if top["version"] != VERSION:
        raise UnsupportedCheckpointError(
            f"{url}: metadata format version {top['version']!r}, where zerosafe reads "
            f"{VERSION!r} (torch_checkpointing 0.1.1); consolidate the save with "
            "torch_checkpointing.hf.consolidate_hf_safetensors_checkpoint"
        )
    world_size = top["world_size"]
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise _bad(url, "world_size", world_size, "a positive int")
    items = top["metadata"]
    if not isinstance(items, dict) or item not in items:
        found = sorted(map(str, items)) if isinstance(items, dict) else items
        raise CheckpointFormatError(
            f"{url}: describes the item(s) {found} but not '{item}'; it belongs to another "
            "save: copy the whole folder again"
        )
    entry = _fields(url, f"item '{item}'", items[item], _ITEM)
    paths = entry["nested_path_to_metadata"]
    if not isinstance(paths, Mapping):
        raise _bad(url, f"'{item}' nested_path_to_metadata", paths, "a dict")
    tensors: dict[str, list[ShardedTensor]] = {}
    for key, groups in paths.items():
        fqn = _fqn(url, key)
        if not isinstance(groups, list) or not groups:
            raise _bad(url, f"'{fqn}'", groups, "a list of groups")
        tensors[fqn] = [
            _sharded(url, f"'{fqn}' group {i}", g, world_size) for i, g in enumerate(groups)
        ]
    return TcMetadata(
        world_size=world_size, tensors=tensors,
        rank_files=_rank_files(url, entry["rank_to_layout_info"], world_size, item),
    )  # fmt: skip
