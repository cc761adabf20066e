"""Pickle nodes that name torch's and DeepSpeed's globals without importing them, and the pickler
that writes them (protocol 2, storages as persistent ids) as torch.save does.
"""

from __future__ import annotations

import io
import pickle
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from zerosafe.formats.torch_pickle import contiguous_stride

STORAGE_ITEMSIZE = {"FloatStorage": 4, "BFloat16Storage": 2, "HalfStorage": 2, "LongStorage": 8}


class Global:
    """A module-level name, written as a GLOBAL opcode."""

    __slots__ = ("module", "qualname")
    _cache: dict[tuple[str, str], Global] = {}

    def __new__(cls, module: str, qualname: str) -> Global:
        key = (module, qualname)
        obj = cls._cache.get(key)
        if obj is None:
            obj = super().__new__(cls)
            obj.module, obj.qualname = module, qualname
            cls._cache[key] = obj
        return obj

    def __call__(self, *args: Any) -> Any:  # save_reduce wants a callable; never called
        raise TypeError("a pickled name, not a callable")

    def __repr__(self) -> str:
        return f"{self.module}.{self.qualname}"


class Reduce:
    """`func(*args)` (REDUCE), then `state` (BUILD) when given."""

    __slots__ = ("func", "args", "state")

    def __init__(self, func: Global, args: tuple[Any, ...], state: Any = None) -> None:
        self.func, self.args, self.state = func, args, state


class NewObj:
    """`cls.__new__(cls)` (NEWOBJ) then `__setstate__(state)` (BUILD): how dataclasses and plain
    objects such as DeepSpeed's LossScaler and fragment_address pickle."""

    __slots__ = ("cls", "state")

    def __init__(self, cls: Global, state: dict[str, Any]) -> None:
        self.cls, self.state = cls, state


G_REBUILD = Global("torch._utils", "_rebuild_tensor_v2")
G_FROM_TYPE = Global("torch._tensor", "_rebuild_from_type_v2")
G_TENSOR = Global("torch", "Tensor")
G_SIZE = Global("torch", "Size")
G_ZERO_STAGE = Global("deepspeed.runtime.zero.config", "ZeroStageEnum")
G_LOSS_SCALER = Global("deepspeed.runtime.fp16.loss_scaler", "LossScaler")
G_DYN_LOSS_SCALER = Global("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler")
G_FRAGMENT = Global("deepspeed.utils.tensor_fragment", "fragment_address")

Piece = tuple[str, str | None, int, int]
"""("vals", param name, start, count): that range of the param's values, in the storage's dtype;
or ("zeros", None, 0, count)."""


class Storage:
    """A storage record: its class, element count and how to produce its bytes.

    `pieces` is a list of ("vals", name, start, count) (the param's values, cast to the storage
    dtype) and ("zeros", None, 0, count); `raw` gives small contents directly; `hole` marks a
    record of zeros written as a sparse hole. The key is assigned when first pickled."""

    __slots__ = ("cls", "numel", "pieces", "raw", "hole", "key")

    def __init__(
        self,
        cls: str,
        numel: int,
        pieces: list[Piece] | None = None,
        raw: bytes | None = None,
        hole: bool = False,
    ) -> None:
        self.cls, self.numel, self.raw, self.hole, self.key = cls, numel, raw, hole, None
        self.pieces = pieces if pieces is not None else []
        if raw is not None:
            assert len(raw) == self.nbytes, (cls, numel, len(raw))
        elif not hole:
            assert sum(p[3] for p in self.pieces) == numel, (cls, numel, self.pieces[:4])

    @property
    def itemsize(self) -> int:
        return STORAGE_ITEMSIZE[self.cls]

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


def tensor(
    storage: Storage,
    shape: Sequence[int],
    offset: int = 0,
    requires_grad: bool = False,
    ds_id: str | None = None,
) -> Reduce:
    """A tensor as torch pickles it; with `ds_id`, as a ZeRO-3 flat group (a Tensor with a __dict__)."""
    args = (storage, offset, tuple(shape), contiguous_stride(shape), requires_grad, OrderedDict())
    if ds_id is None:
        return Reduce(G_REBUILD, args)
    return Reduce(G_FROM_TYPE, (G_REBUILD, G_TENSOR, args, {"ds_id": ds_id}))


def view_again(t: Reduce) -> Reduce:
    """Another tensor object on the same storage (torch pickles each tensor on its own, and the
    real files hold separate calls for a tied alias or a frozen fragment, not a memo reference)."""
    if t.func is G_FROM_TYPE:
        func, cls, args, state = t.args
        return Reduce(G_FROM_TYPE, (func, cls, args[:5] + (OrderedDict(),), dict(state)))
    return Reduce(t.func, t.args[:5] + (OrderedDict(),))


def torch_size(shape: Sequence[int]) -> Reduce:
    return Reduce(G_SIZE, (tuple(shape),))


class _Pickler(pickle._Pickler):  # type: ignore[name-defined,misc]  # pure-Python: extendable dispatch
    dispatch = pickle._Pickler.dispatch.copy()

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=2)
        self.storages: list[Storage] = []

    def persistent_id(self, obj: Any) -> Any:
        if type(obj) is Storage:
            if obj.key is None:
                obj.key = str(len(self.storages))
                self.storages.append(obj)
            return ("storage", Global("torch", obj.cls), obj.key, "cpu", obj.numel)
        return None

    def _save_global_node(self, obj: Global) -> None:
        self.write(pickle.GLOBAL + f"{obj.module}\n{obj.qualname}\n".encode())
        self.memoize(obj)

    def _save_reduce_node(self, obj: Reduce) -> None:
        self.save_reduce(obj.func, obj.args, obj.state, obj=obj)

    def _save_newobj_node(self, obj: NewObj) -> None:
        self.save(obj.cls)
        self.save(())
        self.write(pickle.NEWOBJ)
        self.memoize(obj)
        self.save(obj.state)
        self.write(pickle.BUILD)

    dispatch[Global] = _save_global_node
    dispatch[Reduce] = _save_reduce_node
    dispatch[NewObj] = _save_newobj_node


def pickle_with_storages(obj: Any) -> tuple[bytes, list[Storage]]:
    buf = io.BytesIO()
    p = _Pickler(buf)
    p.dump(obj)
    return buf.getvalue(), p.storages
