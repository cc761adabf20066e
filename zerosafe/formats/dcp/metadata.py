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
then into the frozen dataclasses below; any other global is refused, naming it. The table's
values are sealed (`zerosafe.formats.pickle_guard`): no file changes how a later one is read.

Other writers of the same format. OLMo-core's `RemoteFileSystemWriter`
(olmo_core/distributed/checkpoint/filesystem.py, ai2-olmo-core 3.0.0; what
`save_model_and_optim_state` and its trainer's `Checkpointer` use) fills `storage_data` with
its own `olmo_core.distributed.checkpoint.filesystem._StorageInfo(relative_path, offset,
length)` dataclass; everything else in its `.metadata` is torch's (`Metadata`, `StorageMeta`
with its save id, no `version`). Its `__{rank}_{n}.distcp` files are torch's default form:
each tensor chunk is `torch.save(chunk.clone())` appended at `offset` (a complete zip
archive of `length` bytes, no compression), each non-tensor value its raw `torch.save`
bytes. So its `_StorageInfo` is read as data exactly like torch's (`STORAGE_INFO_CLASSES`).

Drift across torch releases (2.3 to 2.13) and Python versions, each form accepted here
because it means the same bytes (tests/formats/dcp/test_metadata_drift.py writes each one):
- `TensorProperties`: DCP's own class since torch PR #116248 (early 2024, torch 2.3); before
  it, and in any file a writer made with the old class (torch's own BC test
  `test_sharded_tensor_dependency` still writes one), it is
  `torch.distributed._shard.sharded_tensor.metadata.TensorProperties`, whose memory-format
  enum is `MEM_FORMAT_ENCODING` (DCP's is `_MEM_FORMAT_ENCODING`). Both pickle their state as
  the tuple `(dtype, layout, requires_grad, memory-format enum, pin_memory)`; only `dtype` is
  used (chunks are checked against their own archives' shapes and strides).
- `Metadata.storage_meta` (`StorageMeta`, torch PR #124772, 2.4; torch 2.3 cannot unpickle a
  file that has it) and `Metadata.version`
  (torch PR #155343, mid-2025; `"1.0.0"` in 2.13, absent in OLMo-core's files): absent means
  None. `StorageMeta.modules` came later than its other fields; none of it is used.
- `_StorageInfo.transform_descriptors` (stream transforms such as compression, 2025):
  absent in older files and, since torch drops None fields when pickling it, in newer files
  that used no transform. A chunk with transforms is refused by the reader.
- `Metadata.all_local_plans`: megatron-core's `torch_dist` (0.19.2) sets it on torch's
  `Metadata` to every rank's `SavePlan` (of `WriteItem`s, `WriteItemType`s and
  `TensorWriteData`: `PLANNER_CLASSES`), a cache for its next save; read as inert data, unused.
- `StorageMeta.checkpoint_id` as a path: `pathlib.PosixPath(*parts)` up to Python 3.12,
  `pathlib._local.PosixPath(text)` from 3.13.
Fields that would change where a chunk's bytes are (an unknown field of `_StorageInfo`,
`ChunkStorageMetadata` or `TensorStorageMetadata`, a `TensorProperties` tuple of another
length, a `version` other than 1.x) are refused, naming them, rather than ignored.
"""

from __future__ import annotations

import dataclasses
import ntpath
import posixpath
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from zerosafe.dtypes import DTYPES
from zerosafe.errors import CheckpointFormatError, UnsafePickleError, UnsupportedCheckpointError
from zerosafe.formats.pickle_guard import GuardedUnpickler, seal_table
from zerosafe.formats.torch_pickle import RestrictedUnpickler, TensorRecord, inert_class
from zerosafe.formats.torch_zip import DTypeToken, InertObject, TorchSize

__all__ = [
    "ALLOWED_GLOBALS",
    "METADATA_CLASSES",
    "PLANNER_CLASSES",
    "STORAGE_INFO_CLASSES",
    "DcpMetadata",
    "StorageInfo",
    "TensorMeta",
    "parse_metadata",
]

_METADATA = "torch.distributed.checkpoint.metadata"
_SHARDED = "torch.distributed._shard.sharded_tensor.metadata"
_TENSOR_PROPERTIES = (f"{_METADATA}.TensorProperties", f"{_SHARDED}.TensorProperties")


def _torch_size(*args: Any) -> TorchSize:
    return TorchSize(args[0]) if args else TorchSize()


def _layout(name: Any) -> str:
    # torch.serialization._get_layout('torch.strided'): keep the name, build nothing.
    if name != "torch.strided":
        raise UnsafePickleError(f"tensor layout {name!r} is not supported; only torch.strided")
    return str(name)


def _posix_path(*parts: Any) -> str:
    # StorageMeta.checkpoint_id: a pathlib path on the saving machine, kept as text. Python
    # <= 3.12 pickles its parts ('/', 'a', 'b'), 3.13 the whole text.
    return posixpath.join(*(str(p) for p in parts)) if parts else ""


def _windows_path(*parts: Any) -> str:
    return ntpath.join(*(str(p) for p in parts)) if parts else ""


_BYTECHECKPOINT = "bytecheckpoint.checkpointer.meta_type"

METADATA_CLASSES: dict[str, tuple[str, frozenset[str]]] = {
    f"{_METADATA}.Metadata": (
        "torch.distributed.checkpoint",
        frozenset(
            {
                "state_dict_metadata",
                "planner_data",
                "storage_data",
                "storage_meta",
                "version",
                "all_local_plans",
            }
        ),
    ),
    f"{_BYTECHECKPOINT}.Metadata": (
        "ByteCheckpoint",
        frozenset(
            {
                "state_dict_metadata",
                "planner_data",
                "storage_data",
                "all_tensor_metadata",
                "bytecheckpoint_version",
                "user_defined_dict",
            }
        ),
    ),
}
"""The `.metadata` root classes zerosafe reads, as data: qualname -> (the library that pickles
it, the fields it may carry). Both hold torch's `state_dict_metadata` and a `storage_data`
of `STORAGE_INFO_CLASSES`; ByteCheckpoint's adds `all_tensor_metadata` (the module
docstring)."""

STORAGE_INFO_CLASSES: dict[str, tuple[str, frozenset[str]]] = {
    "torch.distributed.checkpoint.filesystem._StorageInfo": (
        "torch's FileSystemWriter",
        frozenset({"relative_path", "offset", "length", "transform_descriptors"}),
    ),
    "olmo_core.distributed.checkpoint.filesystem._StorageInfo": (
        "OLMo-core's RemoteFileSystemWriter",
        frozenset({"relative_path", "offset", "length"}),
    ),
    f"{_BYTECHECKPOINT}._StorageInfo": (
        "ByteCheckpoint",
        frozenset({"relative_path", "offset", "length"}),
    ),
}
"""The `storage_data` value classes zerosafe reads, as data: qualname -> (the writer that
pickles it, the fields it may carry). Each locates a chunk as bytes `[offset, offset +
length)` of `relative_path`, a file in the checkpoint folder (see the module docstring)."""

_PLANNER = "torch.distributed.checkpoint.planner"
PLANNER_CLASSES = (
    f"{_PLANNER}.SavePlan",
    f"{_PLANNER}.WriteItem",
    f"{_PLANNER}.WriteItemType",
    f"{_PLANNER}.TensorWriteData",
)
"""torch's save-planner classes megatron-core pickles into `Metadata.all_local_plans` (every
rank's `SavePlan` of the save, kept to skip planning on the next one): read as inert data and
never used; where the bytes are is `storage_data`'s alone."""

_INERT_CLASSES = (
    *METADATA_CLASSES,
    *PLANNER_CLASSES,
    f"{_METADATA}.TensorStorageMetadata",
    f"{_METADATA}.BytesStorageMetadata",
    f"{_METADATA}.ChunkStorageMetadata",
    f"{_METADATA}.MetadataIndex",
    f"{_METADATA}.StorageMeta",
    *_TENSOR_PROPERTIES,
    f"{_METADATA}._MEM_FORMAT_ENCODING",
    f"{_SHARDED}.MEM_FORMAT_ENCODING",
    *STORAGE_INFO_CLASSES,
)

ALLOWED_GLOBALS: dict[str, Any] = {
    **{name: inert_class(name) for name in _INERT_CLASSES},
    "torch.Size": _torch_size,
    "torch.serialization._get_layout": _layout,
    "pathlib.PosixPath": _posix_path,
    "pathlib.PurePosixPath": _posix_path,
    "pathlib.WindowsPath": _windows_path,
    "pathlib.PureWindowsPath": _windows_path,
    "pathlib._local.PosixPath": _posix_path,
    "pathlib._local.PurePosixPath": _posix_path,
    "pathlib._local.WindowsPath": _windows_path,
    "pathlib._local.PureWindowsPath": _windows_path,
    "collections.OrderedDict": dict,
    **{f"torch.{name}": DTypeToken(name) for name in DTYPES},
}
"""Every global a DCP `.metadata` pickle may name, and what it becomes. Anything else is
refused. Seen in torch 2.13's, OLMo-core 3.0.0's, ByteCheckpoint 0.0.2's and megatron-core
0.19.2's files: the DCP classes (ByteCheckpoint's own `Metadata` and `_StorageInfo` among
them), `torch.Size`, dtypes, `torch.serialization._get_layout`, `pathlib.PosixPath`,
OLMo-core's `_StorageInfo` and torch's planner classes (`PLANNER_CLASSES`); the older and
newer forms of the module docstring's drift list."""
seal_table(ALLOWED_GLOBALS)


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
    raw_tensor: TensorRecord | None = None
    """ByteCheckpoint: the chunk tensor its bytes are the raw storage of (from
    `all_tensor_metadata`); None where the bytes are a `torch.save` archive or safetensors."""


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
    writers: tuple[str, ...] = ()
    """Who wrote the chunks, from the `storage_data` classes (`STORAGE_INFO_CLASSES`):
    `torch's FileSystemWriter`, `OLMo-core's RemoteFileSystemWriter`, `ByteCheckpoint`."""
    globals_found: frozenset[str]

    @property
    def written_by_olmo_core(self) -> bool:
        """Whether OLMo-core's checkpoint writer wrote it (its names are OLMo-core's own)."""
        return any(w.startswith("OLMo-core") for w in self.writers)


class _MetadataUnpickler(GuardedUnpickler):
    table = ALLOWED_GLOBALS

    def unknown_global(self, qualname: str) -> UnsafePickleError:
        return UnsafePickleError(
            f"{self._url}: the DCP metadata pickle names the global '{qualname}', which is "
            "not on zerosafe's allowlist for DCP metadata, so the file was not loaded "
            "(loading it could run code). If this is a legitimate checkpoint, report the "
            "global so it can be added to ALLOWED_GLOBALS in zerosafe/formats/dcp/metadata.py."
        )

    def persistent_load(self, pid: Any) -> Any:
        raise CheckpointFormatError(
            f"{self._url}: the metadata pickle has a persistent id {pid!r}; DCP metadata has none"
        )


def _fields(obj: Any, qualnames: str | tuple[str, ...], url: str, where: str) -> dict[str, Any]:
    """The field dict of an inert DCP record, checking it is (one of) the class(es) expected."""
    names = (qualnames,) if isinstance(qualnames, str) else qualnames
    if not isinstance(obj, InertObject) or obj.qualname not in names:
        raise CheckpointFormatError(
            f"{url}: {where} is {_describe(obj)}, expected a '{names[0].rsplit('.', 1)[-1]}'; "
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


def _only_fields(
    fields: Mapping[str, Any], known: frozenset[str], url: str, where: str, what: str
) -> None:
    """Refuse fields no known writer sets: they could change where the bytes are."""
    unknown = sorted(set(fields) - known)
    if unknown:
        raise UnsupportedCheckpointError(
            f"{url}: {where} is a {what} with field(s) {unknown} that zerosafe does not know "
            f"(it reads {sorted(known)}); a newer writer may store the bytes differently, so "
            "nothing was converted. Report the writer and its version."
        )


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


_CHUNK_FIELDS = frozenset({"offsets", "sizes"})
_TENSOR_FIELDS = frozenset({"properties", "size", "chunks"})


def _dtype_of(props: Any, url: str, where: str) -> str:
    """The dtype of a `TensorProperties` (DCP's or ShardedTensor's: the module docstring)."""
    fields = _fields(props, _TENSOR_PROPERTIES, url, f"{where} properties")
    state = fields.get("__state__")
    if isinstance(state, tuple):
        # __getstate__: (dtype, layout, requires_grad, memory-format enum, pin_memory)
        if len(state) != 5:
            raise UnsupportedCheckpointError(
                f"{url}: {where} has TensorProperties of {len(state)} values, expected the 5 "
                "(dtype, layout, requires_grad, memory_format, pin_memory) torch 2.3 to 2.13 "
                "write; a newer torch may describe its chunks differently, so nothing was "
                "converted. Report the torch version that wrote it."
            )
        dtype = state[0]
    else:
        dtype = fields.get("dtype")
    if not isinstance(dtype, DTypeToken):
        raise CheckpointFormatError(
            f"{url}: {where} has dtype {_describe(dtype)}, expected a torch dtype; the metadata "
            "is corrupt"
        )
    return str(dtype)


def _tensor_meta(fqn: str, obj: Any, url: str) -> TensorMeta:
    where = f"'{fqn}'"
    f = _fields(obj, f"{_METADATA}.TensorStorageMetadata", url, where)
    _only_fields(f, _TENSOR_FIELDS, url, where, "TensorStorageMetadata")
    dtype = _dtype_of(f.get("properties"), url, where)
    chunks = []
    for i, chunk in enumerate(f.get("chunks") or ()):
        c = _fields(chunk, f"{_METADATA}.ChunkStorageMetadata", url, f"{where} chunk {i}")
        _only_fields(c, _CHUNK_FIELDS, url, f"{where} chunk {i}", "ChunkStorageMetadata")
        chunks.append(
            (
                _int_tuple(c.get("offsets"), url, f"{where} chunk {i} offsets"),
                _int_tuple(c.get("sizes"), url, f"{where} chunk {i} sizes"),
            )
        )
    return TensorMeta(
        fqn=fqn,
        dtype=dtype,
        size=_int_tuple(f.get("size"), url, f"{where} size"),
        chunks=tuple(chunks),
    )


def _leaves_folder(path: str) -> bool:
    """Whether a `relative_path` is absolute, a URL, or climbs out with `..`: a checkpoint's
    chunks are always files in its own folder."""
    parts = path.replace("\\", "/").split("/")
    return path.startswith(("/", "\\")) or "://" in path or ".." in parts


def _index_key(key: Any, url: str, where: str) -> tuple[str, tuple[int, ...] | None]:
    """A `MetadataIndex` key as `(fqn, chunk offsets)` (offsets None for a non-tensor value)."""
    k = _fields(key, f"{_METADATA}.MetadataIndex", url, f"a {where} key")
    fqn = k.get("fqn")
    if not isinstance(fqn, str):
        raise CheckpointFormatError(f"{url}: a {where} key has fqn {fqn!r}, expected text")
    offset = k.get("offset")
    offsets = None if offset is None else _int_tuple(offset, url, f"'{fqn}' {where} offset")
    return fqn, offsets


def _raw_tensors(value: Any, url: str) -> dict[tuple[str, tuple[int, ...] | None], TensorRecord]:
    """ByteCheckpoint's `all_tensor_metadata`: each chunk's tensor pickle, read with the
    restricted tensor unpickler (the module docstring). None values (non-tensor entries)
    are skipped."""
    if not isinstance(value, Mapping):
        raise CheckpointFormatError(
            f"{url}: 'all_tensor_metadata' is {_describe(value)}, expected a dict; the "
            "ByteCheckpoint metadata is corrupt"
        )
    out: dict[tuple[str, tuple[int, ...] | None], TensorRecord] = {}
    for key, pickled in value.items():
        fqn, offsets = _index_key(key, url, "all_tensor_metadata")
        if pickled is None:
            continue
        where = f"{url}: 'all_tensor_metadata' of '{fqn}'"
        if not isinstance(pickled, bytes):
            raise CheckpointFormatError(
                f"{where} is {_describe(pickled)}, expected the bytes of a tensor pickle"
            )
        try:
            tensor = RestrictedUnpickler(pickled, where).load()
        except (CheckpointFormatError, UnsafePickleError):
            raise
        except Exception as e:
            raise CheckpointFormatError(
                f"{where}: the tensor pickle could not be read ({type(e).__name__}: {e}); "
                "the metadata is corrupt. Copy the checkpoint again."
            ) from e
        if not isinstance(tensor, TensorRecord):
            raise CheckpointFormatError(
                f"{where} describes {_describe(tensor)}, expected one tensor; the metadata "
                "is corrupt"
            )
        out[(fqn, offsets)] = tensor
    return out


def _storage_entry(key: Any, value: Any, url: str) -> tuple[tuple[str, Any], StorageInfo, str]:
    """One `storage_data` item: its `(fqn, offsets)` key, where it is, and who wrote it."""
    fqn, offsets = _index_key(key, url, "storage_data")
    v = _fields(value, tuple(STORAGE_INFO_CLASSES), url, f"'{fqn}' storage")
    writer, known = STORAGE_INFO_CLASSES[value.qualname]
    _only_fields(v, known, url, f"'{fqn}' storage", f"_StorageInfo of {writer}")
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
    return (fqn, offsets), info, writer


def _check_version(version: Any, url: str) -> str | None:
    """`Metadata.version` as text: None (written before it existed, or by OLMo-core), or 1.x
    (`"1.0.0"` in torch 2.13); a later major version is refused."""
    if version is None:
        return None
    text = str(version)
    if not isinstance(version, (str, float, int)) or text.split(".", 1)[0] != "1":
        raise UnsupportedCheckpointError(
            f"{url}: DCP metadata version {text!r}; zerosafe reads version 1 (torch up to "
            "2.13) and metadata without a version. A newer torch may lay chunks out "
            "differently: convert with the torch that wrote it (`dcp_to_torch_save`), or "
            "report the version."
        )
    return text


def _load(data: bytes, url: str) -> tuple[Any, frozenset[str]]:
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
    return root, frozenset(unpickler.globals_found)


def parse_metadata(data: bytes, url: str) -> DcpMetadata:
    """Read the bytes of a DCP `.metadata` file.

    Args:
        data: The file's bytes.
        url: Its URL, for messages.

    Returns:
        The tensors, non-tensor keys and storage locations it lists.

    Raises:
        UnsafePickleError: If the pickle names a global outside `ALLOWED_GLOBALS`.
        UnsupportedCheckpointError: If it carries fields or a version zerosafe does not know
            (the module docstring lists the forms it reads).
        CheckpointFormatError: If it is not DCP metadata (another pickle, corrupt, truncated).
    """
    root, globals_found = _load(data, url)
    m = _fields(root, tuple(METADATA_CLASSES), url, "the pickled object")
    library, known = METADATA_CLASSES[root.qualname]
    _only_fields(m, known, url, "the pickled object", f"Metadata of {library}")
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
    storage: dict[tuple[str, tuple[int, ...] | None], StorageInfo] = {}
    writers: set[str] = set()
    for k, v in raw_storage.items():
        key, info, writer = _storage_entry(k, v, url)
        storage[key] = info
        writers.add(writer)
    if "all_tensor_metadata" in known:
        storage = _with_raw_tensors(storage, tensors, m.get("all_tensor_metadata"), url)
    return DcpMetadata(
        url=url,
        tensors=tensors,
        byte_entries=tuple(byte_entries),
        storage=storage,
        version=_check_version(m.get("version"), url),
        writers=tuple(sorted(writers)),
        globals_found=globals_found,
    )


def _with_raw_tensors(
    storage: dict[tuple[str, tuple[int, ...] | None], StorageInfo],
    tensors: Mapping[str, TensorMeta],
    all_tensor_metadata: Any,
    url: str,
) -> dict[tuple[str, tuple[int, ...] | None], StorageInfo]:
    """ByteCheckpoint's storage, each tensor chunk with the tensor its raw bytes hold.

    Raises:
        CheckpointFormatError: If a stored tensor chunk has no tensor pickle: its bytes
            could not be placed.
    """
    raw = _raw_tensors(all_tensor_metadata, url)
    out: dict[tuple[str, tuple[int, ...] | None], StorageInfo] = {}
    for key, info in storage.items():
        tensor = raw.get(key)
        if tensor is None and key[0] in tensors:
            raise CheckpointFormatError(
                f"{url}: '{key[0]}' has a chunk at offsets {list(key[1] or ())} stored as raw "
                "bytes (ByteCheckpoint) but 'all_tensor_metadata' has no tensor for it, so "
                "its shape and strides are unknown; the metadata is corrupt or from another "
                "save. Restore the checkpoint's own '.metadata'."
            )
        out[key] = dataclasses.replace(info, raw_tensor=tensor)
    return out
