"""Reading a PyTorch DCP checkpoint's `.metadata` without running code from it.

`.metadata` is a pickle of `torch.distributed.checkpoint.metadata.Metadata`
(torch/distributed/checkpoint/metadata.py and filesystem.py, torch 2.13):
- `state_dict_metadata`: flattened key -> `TensorStorageMetadata(properties, size, chunks)`
  (each chunk a `ChunkStorageMetadata(offsets, sizes)`) or `BytesStorageMetadata()` (a
  non-tensor value, itself a `torch.save` pickle that zerosafe never loads);
- `storage_data`: `MetadataIndex(fqn, offset, index)` -> `_StorageInfo(relative_path, offset,
  length, transform_descriptors)`: where each chunk's bytes sit;
- `planner_data` (key -> nested path), `storage_meta` (ids, a `pathlib` path), `version`.

The unpickler here knows exactly the globals that file needs (`ALLOWED_GLOBALS`, a table of
its own: DeepSpeed's are in `zerosafe.torch_zip`), turns DCP's classes into inert records and
then into the frozen dataclasses below; any other global is refused, naming it.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from zerosafe.dtypes import DTYPES
from zerosafe.errors import CheckpointFormatError, UnsafePickleError
from zerosafe.formats.torch_zip import DTypeToken, InertObject, TorchSize

__all__ = [
    "ALLOWED_GLOBALS",
    "DcpMetadata",
    "StorageInfo",
    "TensorMeta",
    "parse_metadata",
]

_METADATA = "torch.distributed.checkpoint.metadata"


def _inert(qualname: str) -> type[InertObject]:
    return type(qualname.rsplit(".", 1)[-1], (InertObject,), {"qualname": qualname})


def _torch_size(*args: Any) -> TorchSize:
    return TorchSize(args[0]) if args else TorchSize()


def _layout(name: Any) -> str:
    # torch.serialization._get_layout('torch.strided'): keep the name, build nothing.
    if name != "torch.strided":
        raise UnsafePickleError(f"tensor layout {name!r} is not supported; only torch.strided")
    return str(name)


def _path(*parts: Any) -> str:
    # StorageMeta.checkpoint_id: a pathlib path on the saving machine, kept as text.
    return "/".join(str(p) for p in parts)


_INERT_CLASSES = (
    f"{_METADATA}.Metadata",
    f"{_METADATA}.TensorStorageMetadata",
    f"{_METADATA}.BytesStorageMetadata",
    f"{_METADATA}.ChunkStorageMetadata",
    f"{_METADATA}.TensorProperties",
    f"{_METADATA}.MetadataIndex",
    f"{_METADATA}.StorageMeta",
    f"{_METADATA}._MEM_FORMAT_ENCODING",
    "torch.distributed.checkpoint.filesystem._StorageInfo",
)

ALLOWED_GLOBALS: dict[str, Any] = {
    **{name: _inert(name) for name in _INERT_CLASSES},
    "torch.Size": _torch_size,
    "torch.serialization._get_layout": _layout,
    "pathlib.PosixPath": _path,
    "pathlib.WindowsPath": _path,
    "pathlib.PurePosixPath": _path,
    "collections.OrderedDict": dict,
    **{f"torch.{name}": DTypeToken(name) for name in DTYPES},
}
"""Every global a DCP `.metadata` pickle may name, and what it becomes. Anything else is
refused. Seen in torch 2.13's files: the DCP classes, `torch.Size`, dtypes,
`torch.serialization._get_layout` and `pathlib.PosixPath`."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TensorMeta:
    """One tensor of the checkpoint: dtype, global shape and its chunks."""

    fqn: str
    dtype: str
    size: tuple[int, ...]
    chunks: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]
    """`(offsets, sizes)` of each chunk, in the metadata's order."""


@dataclass(frozen=True, kw_only=True, slots=True)
class StorageInfo:
    """Where one chunk (or one non-tensor value) is stored."""

    relative_path: str
    offset: int
    length: int
    transform_descriptors: tuple[str, ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class DcpMetadata:
    """The parts of `Metadata` a conversion needs, as plain data."""

    url: str
    tensors: dict[str, TensorMeta]
    """In the order the metadata lists them (the saved state dict's order)."""
    byte_entries: tuple[str, ...]
    """Keys of non-tensor values (`BytesStorageMetadata`)."""
    storage: dict[tuple[str, tuple[int, ...] | None], StorageInfo]
    """`(fqn, chunk offsets)` (offsets None for a non-tensor value) -> where it is stored."""
    version: str | None
    globals_found: frozenset[str]


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, url: str) -> None:
        super().__init__(io.BytesIO(data))
        self._url = url
        self.globals_found: set[str] = set()

    def find_class(self, module: str, name: str) -> Any:
        qualname = f"{module}.{name}"
        try:
            target = ALLOWED_GLOBALS[qualname]
        except KeyError:
            raise UnsafePickleError(
                f"{self._url}: the DCP metadata pickle names the global '{qualname}', which is "
                "not on zerosafe's allowlist for DCP metadata, so the file was not loaded "
                "(loading it could run code). If this is a legitimate checkpoint, report the "
                "global so it can be added to ALLOWED_GLOBALS in zerosafe/formats/dcp/metadata.py."
            ) from None
        self.globals_found.add(qualname)
        return target

    def persistent_load(self, pid: Any) -> Any:
        raise CheckpointFormatError(
            f"{self._url}: the metadata pickle has a persistent id {pid!r}; DCP metadata has none"
        )


def _fields(obj: Any, qualname: str, url: str, where: str) -> dict[str, Any]:
    """The field dict of an inert DCP record, checking it is the class expected."""
    if not isinstance(obj, InertObject) or obj.qualname != qualname:
        raise CheckpointFormatError(
            f"{url}: {where} is {_describe(obj)}, expected a '{qualname.rsplit('.', 1)[-1]}'; "
            "the file is not DCP metadata written by torch.distributed.checkpoint"
        )
    state = obj.state
    if isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict):
        state = {**(state[0] or {}), **state[1]}  # (dict state, slot state)
    if isinstance(state, dict):
        return state
    if state is None:
        return {}
    return {"__state__": state}


def _describe(obj: Any) -> str:
    if isinstance(obj, InertObject):
        return f"a '{obj.qualname}'"
    return f"{type(obj).__name__} {obj!r:.80}"


def _int_tuple(value: Any, url: str, where: str) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list)) or any(type(v) is not int for v in value):
        raise CheckpointFormatError(
            f"{url}: {where} is {_describe(value)}, expected a torch.Size of ints; the metadata "
            "is corrupt"
        )
    return tuple(value)


def _tensor_meta(fqn: str, obj: Any, url: str) -> TensorMeta:
    where = f"'{fqn}'"
    f = _fields(obj, f"{_METADATA}.TensorStorageMetadata", url, where)
    props = _fields(
        f.get("properties"), f"{_METADATA}.TensorProperties", url, f"{where} properties"
    )
    # TensorProperties pickles its fields as a tuple: (dtype, layout, requires_grad, ...).
    state = props.get("__state__")
    dtype = state[0] if isinstance(state, tuple) and state else props.get("dtype")
    if not isinstance(dtype, DTypeToken):
        raise CheckpointFormatError(
            f"{url}: {where} has dtype {_describe(dtype)}, expected a torch dtype; the metadata "
            "is corrupt"
        )
    chunks = []
    for i, chunk in enumerate(f.get("chunks") or ()):
        c = _fields(chunk, f"{_METADATA}.ChunkStorageMetadata", url, f"{where} chunk {i}")
        chunks.append(
            (
                _int_tuple(c.get("offsets"), url, f"{where} chunk {i} offsets"),
                _int_tuple(c.get("sizes"), url, f"{where} chunk {i} sizes"),
            )
        )
    return TensorMeta(
        fqn=fqn,
        dtype=str(dtype),
        size=_int_tuple(f.get("size"), url, f"{where} size"),
        chunks=tuple(chunks),
    )


def _leaves_folder(path: str) -> bool:
    """Whether a `relative_path` is absolute, a URL, or climbs out with `..`: a checkpoint's
    chunks are always files in its own folder."""
    parts = path.replace("\\", "/").split("/")
    return path.startswith(("/", "\\")) or "://" in path or ".." in parts


def _storage_entry(key: Any, value: Any, url: str) -> tuple[tuple[str, Any], StorageInfo]:
    k = _fields(key, f"{_METADATA}.MetadataIndex", url, "a storage_data key")
    fqn = k.get("fqn")
    if not isinstance(fqn, str):
        raise CheckpointFormatError(f"{url}: a storage_data key has fqn {fqn!r}, expected text")
    offset = k.get("offset")
    offsets = None if offset is None else _int_tuple(offset, url, f"'{fqn}' storage offset")
    v = _fields(
        value, "torch.distributed.checkpoint.filesystem._StorageInfo", url, f"'{fqn}' storage"
    )
    path, start, length = v.get("relative_path"), v.get("offset"), v.get("length")
    if not isinstance(path, str) or type(start) is not int or type(length) is not int:
        raise CheckpointFormatError(
            f"{url}: '{fqn}' storage is ({path!r}, {start!r}, {length!r}), expected "
            "(relative_path, offset, length); the metadata is corrupt"
        )
    if _leaves_folder(path):
        raise CheckpointFormatError(
            f"{url}: '{fqn}' is stored at relative_path '{path}', which points outside the "
            "checkpoint folder (torch writes a file name inside it); this metadata was not "
            "written by DCP's FileSystemWriter or was edited. Restore the checkpoint's own "
            "'.metadata'."
        )
    transforms = tuple(str(t) for t in (v.get("transform_descriptors") or ()))
    info = StorageInfo(
        relative_path=path, offset=start, length=length, transform_descriptors=transforms
    )
    return (fqn, offsets), info


def parse_metadata(data: bytes, url: str) -> DcpMetadata:
    """Read the bytes of a DCP `.metadata` file.

    Args:
        data: The file's bytes.
        url: Its URL, for messages.

    Returns:
        The tensors, non-tensor keys and storage locations it lists.

    Raises:
        UnsafePickleError: If the pickle names a global outside `ALLOWED_GLOBALS`.
        CheckpointFormatError: If it is not DCP metadata (another pickle, corrupt, truncated).
    """
    unpickler = _MetadataUnpickler(data, url)
    try:
        root = unpickler.load()
    except CheckpointFormatError:
        raise
    except Exception as e:
        raise CheckpointFormatError(
            f"{url}: the DCP metadata pickle could not be read ({type(e).__name__}: {e}); the "
            "file is truncated or corrupt. Copy the checkpoint again."
        ) from e
    m = _fields(root, f"{_METADATA}.Metadata", url, "the pickled object")
    sd = m.get("state_dict_metadata")
    if not isinstance(sd, Mapping):
        raise CheckpointFormatError(
            f"{url}: 'state_dict_metadata' is {_describe(sd)}, expected a dict"
        )
    tensors: dict[str, TensorMeta] = {}
    byte_entries: list[str] = []
    for fqn, entry in sd.items():
        if isinstance(entry, InertObject) and entry.qualname.endswith(".BytesStorageMetadata"):
            byte_entries.append(str(fqn))
        else:
            tensors[str(fqn)] = _tensor_meta(str(fqn), entry, url)
    raw_storage = m.get("storage_data")
    if not isinstance(raw_storage, Mapping):
        raise CheckpointFormatError(
            f"{url}: 'storage_data' is {_describe(raw_storage)}, expected a dict; was the "
            "checkpoint written by a storage writer other than torch's FileSystemWriter?"
        )
    storage = dict(_storage_entry(k, v, url) for k, v in raw_storage.items())
    version = m.get("version")
    return DcpMetadata(
        url=url,
        tensors=tensors,
        byte_entries=tuple(byte_entries),
        storage=storage,
        version=None if version is None else str(version),
        globals_found=frozenset(unpickler.globals_found),
    )
