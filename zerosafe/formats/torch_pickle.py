"""The pickle inside a `torch.save` file, read without running code from it.

In the pickle a tensor is `torch._utils._rebuild_tensor_v2(storage, storage_offset, size,
stride, ...)` and a storage is the persistent id `('storage', <storage type>, key, location,
numel)` (https://pytorch.org/docs/stable/notes/serialization.html, torch/serialization.py).
The restricted unpickler here maps those calls to `TensorRecord`s (no bytes are read), maps the
bookkeeping classes real checkpoints contain to inert records, and refuses every other global
by name, so nothing in a checkpoint ever runs. `ALLOWED_GLOBALS` is the visible table of what
is allowed; docs/formats.md lists where each entry was seen. Every value in it is sealed
(`zerosafe.formats.pickle_guard`), so no file can change how a later one is read. The zip
container around the pickle is `zerosafe.formats.torch_zip`.
"""

from __future__ import annotations

import collections
import io
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar

from zerosafe.dtypes import DTYPES, dtype_info
from zerosafe.errors import CheckpointFormatError, UnsafePickleError
from zerosafe.formats.pickle_guard import (
    GuardedUnpickler,
    SealedClass,
    SealedFunction,
    SealedStr,
    SealedToken,
    seal_table,
)

__all__ = [
    "ALLOWED_GLOBALS",
    "DTENSOR_GLOBALS",
    "DTensorRecord",
    "DTypeToken",
    "InertObject",
    "RestrictedUnpickler",
    "StorageRef",
    "TensorRecord",
    "TorchDevice",
    "TorchSize",
    "contiguous_stride",
    "inert_class",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class StorageRef:
    """A storage named in the pickle: which record holds it and how many elements it has."""

    key: str
    dtype: str
    numel: int
    location: str


@dataclass(frozen=True, kw_only=True, slots=True)
class TensorRecord:
    """A tensor as the pickle describes it; its bytes stay in the file until asked for."""

    storage: StorageRef
    storage_offset: int
    """In elements of `dtype`."""
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str
    requires_grad: bool = False
    is_parameter: bool = False
    """Saved as an `nn.Parameter`; `requires_grad` is then the parameter's flag."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return dtype_info(self.dtype).itemsize

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    def is_contiguous(self) -> bool:
        expected = 1
        for size, stride in zip(reversed(self.shape), reversed(self.stride), strict=True):
            if size != 1 and stride != expected:
                return False
            expected *= size
        return True


class InertObject(metaclass=SealedClass):
    """Stands in for a bookkeeping object (a loss scaler, an enum): keeps its data, runs nothing.

    `args` are the constructor arguments the pickle passed and `state` what it would have set
    with `__setstate__`; `get` reads a field from either. Instances are fresh per load; the
    class, shared, cannot be changed (`SealedClass`).
    """

    qualname: ClassVar[str] = "?"

    def __new__(cls, *args: Any, **kwargs: Any) -> InertObject:
        obj = object.__new__(cls)
        obj.args = args
        obj.state = None
        return obj

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args

    def __setstate__(self, state: Any) -> None:
        self.state = state

    args: tuple[Any, ...]
    state: Any

    def get(self, field: str, default: Any = None) -> Any:
        if isinstance(self.state, dict) and field in self.state:
            return self.state[field]
        if (
            isinstance(self.state, tuple)
            and len(self.state) == 2
            and isinstance(self.state[1], dict)
        ):
            return self.state[1].get(field, default)  # (dict state, slot state)
        return default

    @property
    def value(self) -> Any:
        """The first constructor argument: an enum's value (`ZeroStageEnum(2)` -> 2)."""
        return self.args[0] if self.args else None

    def __repr__(self) -> str:
        return f"<inert {self.qualname} args={self.args!r} state={self.state!r}>"


def inert_class(qualname: str) -> type[InertObject]:
    """The inert record class for the global `qualname`, for an allowlist table."""
    # a subclass of InertObject: its metaclass is `SealedClass` too
    return type(qualname.rsplit(".", 1)[-1], (InertObject,), {"qualname": qualname})


class _StorageType(SealedToken):
    """The global a persistent id names as the storage's type (`torch.FloatStorage`)."""

    __slots__ = ("dtype",)
    dtype: str


class _DTypeToken(SealedStr):
    """A torch dtype named in a pickle (`torch.float16`), kept as its name."""

    __slots__ = ()

    @property
    def qualname(self) -> str:
        return f"torch.{self}"


DTypeToken = _DTypeToken


class TorchSize(tuple):  # type: ignore[type-arg]
    """A `torch.Size` named in a pickle: a plain tuple of ints that remembers it was one."""


class TorchDevice(str):
    """A `torch.device` named in a pickle, kept as its name (`cuda:0`)."""


def contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    """The strides torch gives a new contiguous tensor of `shape` (size-0 dims count as 1)."""
    stride = []
    step = 1
    for size in reversed(shape):
        stride.append(step)
        step *= max(size, 1)
    return tuple(reversed(stride))


def _rebuild_tensor_v2(
    storage: tuple[StorageRef, str],
    storage_offset: int,
    size: tuple[int, ...],
    stride: tuple[int, ...],
    requires_grad: bool = False,
    backward_hooks: Any = None,
    metadata: Any = None,
) -> TensorRecord:
    # a typed storage: the tensor's dtype is the storage's
    ref = _storage_ref(storage)
    return _rebuild_tensor_v3(
        storage, storage_offset, size, stride, requires_grad, backward_hooks, ref.dtype
    )


def _rebuild_tensor_v3(
    storage: tuple[StorageRef, str],
    storage_offset: int,
    size: tuple[int, ...],
    stride: tuple[int, ...],
    requires_grad: bool,
    backward_hooks: Any,
    dtype: str,
    metadata: Any = None,
) -> TensorRecord:
    # v3 is used with untyped (byte) storages: the offset is in elements of `dtype`.
    return TensorRecord(
        storage=_storage_ref(storage),
        storage_offset=_exact_int(storage_offset, "storage offset"),
        shape=tuple(_exact_int(s, "size") for s in size),
        stride=tuple(_exact_int(s, "stride") for s in stride),
        dtype=str(dtype),
        requires_grad=bool(requires_grad),
    )


def _storage_ref(storage: Any) -> StorageRef:
    ref = storage[0] if isinstance(storage, tuple) and len(storage) == 2 else storage
    if not isinstance(ref, StorageRef):
        raise CheckpointFormatError(
            f"a tensor is rebuilt from {type(ref).__name__} {ref!r} where torch.save writes a "
            "storage reference; the file was not written by torch.save"
        )
    return ref


def _exact_int(value: Any, what: str) -> int:
    # int() would quietly turn 2.7 into 2 or '3' into 3; torch.save writes Python ints only.
    if type(value) is not int:
        raise CheckpointFormatError(
            f"a tensor's {what} is {type(value).__name__} {value!r}, expected an int; the file "
            "was not written by torch.save"
        )
    return value


def _rebuild_tensor_v1(
    storage: tuple[StorageRef, str], storage_offset: int, size: Any, stride: Any
) -> TensorRecord:
    return _rebuild_tensor_v2(storage, storage_offset, size, stride)


def _rebuild_parameter(
    data: TensorRecord, requires_grad: bool, backward_hooks: Any
) -> TensorRecord:
    if not isinstance(data, TensorRecord):
        return data
    return replace(data, requires_grad=bool(requires_grad), is_parameter=True)


def _rebuild_parameter_with_state(
    data: TensorRecord, requires_grad: bool, backward_hooks: Any, state: Any
) -> TensorRecord:
    return _rebuild_parameter(data, requires_grad, backward_hooks)


class _TensorClass(SealedToken):
    """`torch.Tensor` / `torch.nn.Parameter` as named by `_rebuild_from_type_v2`."""

    __slots__ = ()


def _rebuild_from_type_v2(
    func: Callable[..., Any], new_type: Any, args: tuple[Any, ...], state: Any
) -> Any:
    # Only our own rebuild functions can arrive here (the allowlist resolved `func`, sealed).
    rebuilds_wrapper = (
        isinstance(func, SealedFunction) and func.function is _rebuild_wrapper_subclass
    )
    if isinstance(new_type, _WrapperSubclass) and rebuilds_wrapper:
        return _dtensor_record(func(*args), state)
    if not isinstance(new_type, _TensorClass):
        raise UnsafePickleError(f"tensor subclass {new_type!r} is not supported")
    return func(*args)


class _WrapperSubclass(SealedToken):
    """A tensor subclass `torch._utils._rebuild_wrapper_subclass` may name: `DTensor` only."""

    __slots__ = ()


@dataclass(frozen=True, kw_only=True, slots=True)
class _WrapperArgs:
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str
    requires_grad: bool


@dataclass(frozen=True, kw_only=True, slots=True)
class DTensorRecord:
    """A `torch.distributed.tensor.DTensor` as `torch.save` pickles it (FSDP2's sharded state
    dict): the global shape and dtype, this rank's local shard (a lazy `TensorRecord`) and
    its spec, an inert `DTensorSpec` (mesh and placements as data; none of their code runs)."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str
    requires_grad: bool
    local: TensorRecord
    spec: InertObject

    @property
    def placements(self) -> tuple[Any, ...]:
        """The spec's placements: inert `Shard` (field `dim`), `Replicate`, ... records."""
        found = self.spec.get("placements", ())
        return tuple(found) if isinstance(found, (tuple, list)) else ()


def _rebuild_wrapper_subclass(
    cls: Any,
    dtype: str,
    size: tuple[int, ...],
    stride: tuple[int, ...],
    storage_offset: int,
    layout: Any,
    device: Any,
    requires_grad: bool,
) -> _WrapperArgs:
    if not isinstance(cls, _WrapperSubclass):
        raise UnsafePickleError(f"wrapper tensor subclass {cls!r} is not supported")
    if layout != "strided":
        raise CheckpointFormatError(f"a DTensor has layout {layout!r}; only strided is read")
    return _WrapperArgs(
        shape=tuple(_exact_int(s, "size") for s in size),
        stride=tuple(_exact_int(s, "stride") for s in stride),
        dtype=str(dtype),
        requires_grad=bool(requires_grad),
    )


def _dtensor_record(wrapper: _WrapperArgs, state: Any) -> DTensorRecord:
    # `_set_obj_state`'s state: a dict, or `(dict state, slot state)` (DTensor has slots)
    fields: dict[str, Any] = {}
    parts = state if isinstance(state, tuple) and len(state) == 2 else (state,)
    for part in parts:
        if isinstance(part, dict):
            fields.update(part)
        elif part is not None:
            fields.clear()
            break
    local, spec = fields.get("_local_tensor"), fields.get("_spec")
    if not isinstance(local, TensorRecord) or not isinstance(spec, InertObject):
        raise CheckpointFormatError(
            "a DTensor is pickled without the `_local_tensor` and `_spec` torch.save writes "
            f"(found {sorted(fields) or type(state).__name__})"
        )
    if local.dtype != wrapper.dtype:
        raise CheckpointFormatError(
            f"a DTensor of dtype {wrapper.dtype} holds a local shard of dtype {local.dtype}"
        )
    return DTensorRecord(
        shape=wrapper.shape, stride=wrapper.stride, dtype=wrapper.dtype,
        requires_grad=wrapper.requires_grad, local=local, spec=spec,
    )  # fmt: skip


def _get_layout(name: str) -> str:
    # torch.serialization._get_layout('torch.strided'): only the strided layout is named.
    if name != "torch.strided":
        raise UnsafePickleError(f"tensor layout '{name}' is not supported")
    return "strided"


def _codecs_encode(text: str, encoding: str = "utf-8") -> bytes:
    # Protocol-2 pickles spell `bytes` objects as `_codecs.encode(text, 'latin1')`.
    if encoding not in ("latin1", "latin-1", "utf-8", "utf8"):
        raise UnsafePickleError(f"_codecs.encode with encoding '{encoding}' is not allowed")
    return text.encode(encoding)


def _bytearray_of_data(*args: Any) -> bytearray:
    # bytearray(10**12) would allocate whatever a file asks for: only data is accepted.
    if args and not isinstance(args[0], (bytes, str, list)):
        raise UnsafePickleError(
            f"bytearray({type(args[0]).__name__}) is not allowed: only bytearray(data)"
        )
    return bytearray(*args)


def _empty_bytes(*args: Any) -> bytes:
    # Protocol-2 pickles spell b"" as `bytes()`; any argument (`bytes(10**12)`) is refused.
    if args:
        raise UnsafePickleError(f"bytes{args!r} is not allowed; only bytes() is")
    return b""


def _torch_size(*args: Any) -> tuple[int, ...]:
    return TorchSize(args[0]) if args else TorchSize()


def _torch_device(*args: Any) -> str:
    return TorchDevice(":".join(str(a) for a in args))


_STORAGE_TYPES = {d.storage_class: d.name for d in DTYPES.values() if d.storage_class} | {
    "UntypedStorage": "uint8"
}

# Bookkeeping classes: kept as inert records, never constructed for real.
_INERT_GLOBALS = (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
    "deepspeed.runtime.zero.offload_config.OffloadDeviceEnum",
    "deepspeed.checkpoint.constants.ZeroStageEnum",
    "argparse.Namespace",
    # enums Megatron-LM's args hold (`--attention-backend` parses to `AttnBackend`, ...),
    # megatron-core 0.19.2: pickled as the class called with the member's value
    *(
        f"megatron.core.transformer.enums.{name}"
        for name in (
            "AttnBackend",
            "AttnMaskType",
            "AttnType",
            "CudaGraphModule",
            "CudaGraphScope",
            "LayerType",
            "ModelType",
        )
    ),  # fmt: skip
    "numpy.core.multiarray._reconstruct",
    "numpy._core.multiarray._reconstruct",
    "numpy.core.multiarray.scalar",
    "numpy._core.multiarray.scalar",
    "numpy.ndarray",
    "numpy.dtype",
)

DTENSOR_GLOBALS = (
    # FSDP2's sharded state dict (verl's `model_world_size_W_rank_R.pt`, torch_checkpointing's
    # `model_R.pt`): each DTensor's spec, its device mesh and placements, kept as inert records
    # (torch 2.13's pickle).
    "torch.distributed.tensor._dtensor_spec.DTensorSpec",
    "torch.distributed.tensor._dtensor_spec.TensorMeta",
    "torch.distributed.tensor._dtensor_spec.ShardOrderEntry",
    "torch.distributed.device_mesh.DeviceMesh",
    "torch.distributed._mesh_layout._MeshLayout",
    "torch.distributed._mesh_layout._FlatLayout",
    "torch.distributed.tensor.placement_types.Shard",
    "torch.distributed.tensor.placement_types.Replicate",
    # read so that a reader can refuse them by name, never converted
    "torch.distributed.tensor.placement_types.Partial",
    "torch.distributed.tensor.placement_types._StridedShard",
)

ALLOWED_GLOBALS: dict[str, Any] = {
    # Containers and plain data constructors.
    "collections.OrderedDict": collections.OrderedDict,
    "collections.defaultdict": collections.defaultdict,
    "builtins.set": set,
    "builtins.frozenset": frozenset,
    "builtins.complex": complex,
    "builtins.slice": slice,
    "builtins.bytearray": _bytearray_of_data,
    # Protocol-2 pickles (torch.save's default) spell builtins the Python 2 way.
    "__builtin__.set": set,
    "__builtin__.frozenset": frozenset,
    "__builtin__.complex": complex,
    "__builtin__.slice": slice,
    "__builtin__.bytearray": _bytearray_of_data,
    "__builtin__.bytes": _empty_bytes,
    "builtins.bytes": _empty_bytes,
    "_codecs.encode": _codecs_encode,
    # Tensor rebuild functions: all produce lazy `TensorRecord`s.
    "torch._utils._rebuild_tensor": _rebuild_tensor_v1,
    "torch._utils._rebuild_tensor_v2": _rebuild_tensor_v2,
    "torch._utils._rebuild_tensor_v3": _rebuild_tensor_v3,
    "torch._utils._rebuild_parameter": _rebuild_parameter,
    "torch._utils._rebuild_parameter_with_state": _rebuild_parameter_with_state,
    "torch._tensor._rebuild_from_type_v2": _rebuild_from_type_v2,
    "torch.Tensor": _TensorClass("torch.Tensor"),
    "torch.nn.parameter.Parameter": _TensorClass("torch.nn.parameter.Parameter"),
    "torch.Size": _torch_size,
    "torch.device": _torch_device,
    **{
        f"torch.{name}": _StorageType(f"torch.{name}", dtype=dtype)
        for name, dtype in _STORAGE_TYPES.items()
    },
    "torch.storage.UntypedStorage": _StorageType("torch.storage.UntypedStorage", dtype="uint8"),
    **{f"torch.{name}": _DTypeToken(name) for name in DTYPES},
    **{name: inert_class(name) for name in _INERT_GLOBALS},
    # DTensors: `_rebuild_from_type_v2(_rebuild_wrapper_subclass, DTensor, args, state)`
    "torch._utils._rebuild_wrapper_subclass": _rebuild_wrapper_subclass,
    "torch.distributed.tensor.DTensor": _WrapperSubclass("torch.distributed.tensor.DTensor"),
    "torch.serialization._get_layout": _get_layout,
    **{name: inert_class(name) for name in DTENSOR_GLOBALS},
}
"""Every global a checkpoint pickle may name, and what it becomes. Anything else is refused.
Sealed below: plain functions become `SealedFunction`s (compare `.function` for identity).
"""
seal_table(ALLOWED_GLOBALS)


class RestrictedUnpickler(GuardedUnpickler):
    """Unpickles `data` with `ALLOWED_GLOBALS` only; `storages` collects the storages named."""

    table = ALLOWED_GLOBALS

    def __init__(self, data: bytes | io.BytesIO, url: str) -> None:
        super().__init__(data, url)
        self.storages: dict[str, StorageRef] = {}

    def unknown_global(self, qualname: str) -> UnsafePickleError:
        return UnsafePickleError(
            f"{self._url}: the pickle names the global '{qualname}', which is not on "
            "zerosafe's allowlist, so the file was not loaded (loading it could run code). "
            "If this is a legitimate checkpoint, report the global so it can be added to "
            "ALLOWED_GLOBALS in zerosafe/formats/torch_pickle.py."
        )

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise CheckpointFormatError(f"{self._url}: unexpected persistent id {pid!r}")
        _, storage_type, key, location, numel = pid
        if not isinstance(storage_type, _StorageType):
            raise CheckpointFormatError(f"{self._url}: storage of unknown type {storage_type!r}")
        if type(numel) is not int or numel < 0:
            raise CheckpointFormatError(
                f"{self._url}: storage '{key}' has {numel!r} elements, expected a count >= 0; "
                "the file is corrupt or was not written by torch.save"
            )
        ref = StorageRef(
            key=str(key), dtype=storage_type.dtype, numel=numel, location=str(location)
        )
        known = self.storages.get(ref.key)
        if known is not None and known != ref:
            # torch.save refuses to save one storage under two types; a file that does would
            # size its views against whichever reference came first.
            raise CheckpointFormatError(
                f"{self._url}: storage '{key}' is named twice with different types or sizes "
                f"({known.numel} x {known.dtype}, then {ref.numel} x {ref.dtype}); the file "
                "was not written by torch.save"
            )
        self.storages[ref.key] = ref
        return (ref, storage_type.dtype)
