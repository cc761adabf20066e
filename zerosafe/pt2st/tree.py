"""The structure of a torch object as JSON, and the safetensors names of its tensors.

A state dict's containers and non-tensor leaves go into the safetensors `__metadata__` as one
JSON document (no pickle), its tensors into safetensors entries. The encoding is lossless for
everything `torch.load` can give back from a checkpoint zerosafe reads: it keeps dict vs
`OrderedDict`, list vs tuple vs `torch.Size`, key types and order, every float bit (JSON has no
NaN or infinity), and which tensors share a storage.

JSON encoding of a value (`encode_tree` / `decode_tree`):

    None, bool, int, str            as themselves
    float                           as itself when finite; else {"float": "<16 hex digits>"},
                                    its IEEE-754 bits, little-endian (NaN payloads survive)
    list                            [items]
    tuple / torch.Size              {"tuple": [items]} / {"size": [ints]}
    dict / OrderedDict              {"dict": [[key, value], ...]} / {"odict": [...]}, in order;
                                    an OrderedDict's attributes (a module state dict's
                                    `_metadata`) in {"odict": [...], "attrs": [[name, value]]}
    defaultdict (no factory)        {"defaultdict": [[key, value], ...]}
    set / frozenset                 {"set": [items]} / {"frozenset": [items]}
    bytes / bytearray               {"bytes": "<base64>"} / {"bytearray": "<base64>"}
    complex                         {"complex": [real, imag]} (floats as above)
    slice                           {"slice": [start, stop, step]}
    torch.dtype / torch.device      {"dtype": "bfloat16"} / {"device": "cuda:0"}
    argparse.Namespace              {"namespace": [[name, value], ...]}
    numpy scalar / array            {"numpy": {"dtype": "<f4", "shape": [..] | null,
                                    "fortran": bool, "data": "<base64>"}} (numeric dtypes)
    DeepSpeed bookkeeping object    {"object": ["<module.Class>", [args], state]}, only for the
                                    classes in `REBUILT_CLASSES` (a loss scaler, a ZeRO stage
                                    enum, a fragment address): DeepSpeed's resume uses the
                                    objects themselves, so loading rebuilds them (see
                                    `rebuild_object`); anything else is refused when writing
    tensor                          {"tensor": "<entry>", ...} (see `zerosafe.pt2st.convert`)

Keys are encoded like values (they cannot be tensors). Every JSON object in the document is
one of these tagged nodes, so user data can never be mistaken for a tag.

Entry names (`entry_name` / `parse_entry_name`): the path of keys and indices from the root to
the tensor, joined with `/`. A string key is written as itself with `%` and `/` escaped as
`%25` and `%2F`; an int key or a list index as its decimal digits; any other key, and a string
key that is empty, starts with `@`, looks like an integer, equals `__metadata__` or is not valid
UTF-8, as `@` followed by its JSON encoding (escaped the same way). So a plain model state dict
keeps its names (`layers.0.weight`), an optimizer's `state/3/exp_avg` reads naturally, and every
name maps back to exactly one path. A tensor at the root is `@root`; names starting with `@` at
the first segment are otherwise only ever `@`-encoded keys.
"""

from __future__ import annotations

import argparse
import base64
import collections
import enum
import importlib
import json
import math
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from zerosafe.errors import CheckpointFormatError, UnsupportedCheckpointError
from zerosafe.formats.torch_pickle import (
    DTensorRecord,
    DTypeToken,
    InertObject,
    TensorRecord,
    TorchDevice,
    TorchSize,
)

__all__ = [
    "REBUILT_CLASSES",
    "ROOT_NAME",
    "TensorSite",
    "decode_tree",
    "encode_tree",
    "entry_name",
    "format_path",
    "parse_entry_name",
    "rebuild_object",
]

Key = Any
Path = tuple[Key, ...]

ROOT_NAME = "@root"
"""The entry name of a tensor that is the whole saved object."""

_INT_LIKE = re.compile(r"-?[0-9]+")
_ESCAPED = re.compile(r"%(25|2F)")
_NUMPY_KINDS = "biufc"  # bool, signed, unsigned, float, complex: plain bytes, no objects
_NUMPY_SCALAR = ("numpy.core.multiarray.scalar", "numpy._core.multiarray.scalar")
_NUMPY_ARRAY = ("numpy.core.multiarray._reconstruct", "numpy._core.multiarray._reconstruct")

REBUILT_CLASSES = (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.runtime.zero.offload_config.OffloadDeviceEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
)
"""Classes whose objects are stored by class name, constructor arguments and attributes, and
rebuilt as real objects when loading (DeepSpeed's `load_checkpoint` keeps the loss scaler it
finds). Rebuilding imports the class and sets attributes; it never runs the class's
`__init__` (an enum is looked up by value). Every name here is also in
`zerosafe.torch_zip.ALLOWED_GLOBALS`."""


@dataclass(slots=True)
class TensorSite:
    """One tensor found in the object: where it sits and the JSON node to fill in for it."""

    path: Path
    record: TensorRecord
    node: dict[str, Any] = field(default_factory=dict)
    """Empty until the planner fills it (the document holds this very dict)."""


# -- names ------------------------------------------------------------------------------------


def _escape(text: str) -> str:
    return text.replace("%", "%25").replace("/", "%2F")


def _unescape(text: str) -> str:
    return _ESCAPED.sub(lambda m: "%" if m.group(1) == "25" else "/", text)


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates, which pickles can carry
        return False
    return True


def _segment(key: Key) -> str:
    if type(key) is int:
        return str(key)
    if (
        type(key) is str
        and key
        and not key.startswith("@")
        and key != "__metadata__"
        and not _INT_LIKE.fullmatch(key)
        and _is_utf8(key)
    ):
        return _escape(key)
    return "@" + _escape(_dumps(_Encoder().encode_key(key)))


def entry_name(path: Path) -> str:
    """The safetensors name of the tensor at `path` (keys and list indices from the root)."""
    if not path:
        return ROOT_NAME
    return "/".join(_segment(k) for k in path)


def _parse_segment(segment: str) -> Key:
    if segment.startswith("@"):
        return _decode_key(json.loads(_unescape(segment[1:])))
    if _INT_LIKE.fullmatch(segment):
        return int(segment)
    return _unescape(segment)


def parse_entry_name(name: str) -> Path:
    """The path `entry_name` made `name` from (list indices come back as ints)."""
    if name == ROOT_NAME:
        return ()
    return tuple(_parse_segment(s) for s in name.split("/"))


def format_path(path: Path) -> str:
    """A path for messages: `['optimizer']['state'][0]['exp_avg']`."""
    return "".join(f"[{k!r}]" for k in path) or "the saved object itself"


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=True, separators=(",", ":"), allow_nan=False)


# -- encoding ---------------------------------------------------------------------------------


def _float(x: float) -> Any:
    if math.isfinite(x):
        return x
    return {"float": struct.pack("<d", x).hex()}


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _numpy_dtype(obj: Any, path: Path) -> str:
    """`'<f4'` from an inert `numpy.dtype`, refusing anything but plain numeric dtypes."""
    if not (isinstance(obj, InertObject) and obj.qualname == "numpy.dtype" and obj.args):
        raise UnsupportedCheckpointError(f"numpy value at {format_path(path)} has no dtype")
    code = str(obj.args[0])
    state = obj.state if isinstance(obj.state, tuple) else ()
    order = state[1] if len(state) > 1 and state[1] in ("<", ">") else ""
    if code[:1] not in _NUMPY_KINDS or (len(state) > 3 and state[3] is not None):
        raise UnsupportedCheckpointError(
            f"numpy value at {format_path(path)} has dtype '{code}'; only numeric numpy "
            "dtypes (bool, int, uint, float, complex) can be stored. Convert it to a tensor "
            "or a Python value before saving."
        )
    return order + code


def _check_numpy_bytes(code: str, shape: list[int] | None, raw: bytes, path: Path) -> None:
    """Refuse numpy data that would not load back: an unknown dtype, or bytes that do not
    fill the shape exactly (numpy's own pickles always match)."""
    import numpy as np

    try:
        itemsize = np.dtype(code).itemsize
    except TypeError as e:
        raise UnsupportedCheckpointError(
            f"numpy value at {format_path(path)} has dtype '{code}', which numpy does not know"
        ) from e
    if shape is not None and any(s < 0 for s in shape):
        raise UnsupportedCheckpointError(
            f"numpy array at {format_path(path)} has shape {shape}; sizes must be >= 0"
        )
    want = itemsize * (math.prod(shape) if shape is not None else 1)
    if len(raw) != want:
        raise UnsupportedCheckpointError(
            f"numpy value at {format_path(path)} ({code}, shape {shape}) has {len(raw)} bytes "
            f"of data, expected {want}; the file is corrupt or was not written by numpy"
        )


class _Encoder:
    def __init__(self) -> None:
        self.sites: list[TensorSite] = []
        self._open: set[int] = set()  # containers on the current path (cycle check)
        self._key_depth = 0  # > 0 while encoding a dict key or a set member

    def encode_key(self, key: Key) -> Any:
        self._key_depth += 1
        try:
            return self.encode(key, ())
        finally:
            self._key_depth -= 1

    def _items(self, pairs: Any, path: Path) -> list[list[Any]]:
        return [[self.encode_key(k), self.encode(v, (*path, k))] for k, v in pairs]

    def encode(self, obj: Any, path: Path) -> Any:
        if obj is None or obj is True or obj is False:
            return obj
        kind = type(obj)
        if kind is int or kind is str:
            return obj
        if kind is float:
            return _float(obj)
        if isinstance(obj, TensorRecord):
            if self._key_depth:
                raise UnsupportedCheckpointError(
                    "a tensor is used in a dict key or a set; tensors can only be values"
                )
            site = TensorSite(path=path, record=obj)
            self.sites.append(site)
            return site.node
        if isinstance(obj, DTypeToken):
            return {"dtype": str(obj)}
        if isinstance(obj, TorchDevice):
            return {"device": str(obj)}
        if kind is bytes:
            return {"bytes": _b64(obj)}
        if kind is bytearray:
            return {"bytearray": _b64(bytes(obj))}
        if kind is complex:
            return {"complex": [_float(obj.real), _float(obj.imag)]}
        if isinstance(obj, InertObject):
            return self._encode_inert(obj, path)
        if id(obj) in self._open:
            raise UnsupportedCheckpointError(
                f"the container at {format_path(path)} contains itself; self-referencing "
                "structures cannot be written as JSON"
            )
        self._open.add(id(obj))
        try:
            return self._encode_container(obj, kind, path)
        finally:
            self._open.discard(id(obj))

    def _encode_container(self, obj: Any, kind: type, path: Path) -> Any:
        if kind is list:
            return [self.encode(v, (*path, i)) for i, v in enumerate(obj)]
        if kind is TorchSize:
            if not all(type(v) is int for v in obj):
                raise UnsupportedCheckpointError(
                    f"the torch.Size at {format_path(path)} holds {list(obj)!r}; a size holds "
                    "ints only (the file was not written by torch.save)"
                )
            return {"size": list(obj)}
        if kind is tuple:
            return {"tuple": [self.encode(v, (*path, i)) for i, v in enumerate(obj)]}
        if kind is dict:
            return {"dict": self._items(obj.items(), path)}
        if kind is collections.OrderedDict:
            node = {"odict": self._items(obj.items(), path)}
            bad = [k for k in vars(obj) if type(k) is not str or k.startswith("__")]
            if bad:
                # Loading sets each attribute again: a name like '__class__' or 1 would fail.
                raise UnsupportedCheckpointError(
                    f"the OrderedDict at {format_path(path)} has attribute(s) {bad!r}, which "
                    "cannot be set again when loading; save it without them"
                )
            if vars(obj):  # a module state dict's `_metadata` (versions for load_state_dict)
                node["attrs"] = self._items(vars(obj).items(), (*path, "__dict__"))
            return node
        if kind is collections.defaultdict and obj.default_factory is None:
            return {"defaultdict": self._items(obj.items(), path)}
        if kind is set or kind is frozenset:
            return {kind.__name__: [self.encode_key(v) for v in obj]}
        if kind is slice:
            return {"slice": [self.encode_key(v) for v in (obj.start, obj.stop, obj.step)]}
        if kind is DTensorRecord:
            raise UnsupportedCheckpointError(
                f"{format_path(path)} is a DTensor: one rank's shard of a sharded (FSDP2) state "
                "dict, not a whole tensor; convert the folder holding every rank's file with "
                "`zerosafe convert` (verl: the actor folder)"
            )
        raise UnsupportedCheckpointError(
            f"value of type '{kind.__module__}.{kind.__qualname__}' at {format_path(path)} "
            "cannot be stored as JSON; save it as a plain container instead"
        )

    def _encode_inert(self, obj: InertObject, path: Path) -> Any:
        if obj.qualname in REBUILT_CLASSES:
            args = [self.encode(a, (*path, "__args__", i)) for i, a in enumerate(obj.args)]
            return {"object": [obj.qualname, args, self.encode(obj.state, (*path, "__dict__"))]}
        if (
            obj.qualname == "argparse.Namespace"
            and isinstance(obj.state, dict)
            and all(type(k) is str for k in obj.state)
        ):
            return {"namespace": self._items(obj.state.items(), path)}
        if obj.qualname in _NUMPY_SCALAR and len(obj.args) == 2 and type(obj.args[1]) is bytes:
            dtype, raw = obj.args
            code = _numpy_dtype(dtype, path)
            _check_numpy_bytes(code, None, raw, path)
            return {"numpy": {"dtype": code, "shape": None, "fortran": False, "data": _b64(raw)}}
        if (
            obj.qualname in _NUMPY_ARRAY
            and isinstance(obj.state, tuple)
            and len(obj.state) == 5
            and isinstance(obj.state[4], bytes)
            and isinstance(obj.state[1], tuple)
            and all(type(s) is int for s in obj.state[1])
        ):
            _, shape, dtype, fortran, raw = obj.state
            code = _numpy_dtype(dtype, path)
            _check_numpy_bytes(code, list(shape), raw, path)
            return {
                "numpy": {
                    "dtype": code,
                    "shape": list(shape),
                    "fortran": bool(fortran),
                    "data": _b64(raw),
                }
            }
        raise UnsupportedCheckpointError(
            f"object of class '{obj.qualname}' at {format_path(path)} cannot be stored in "
            "safetensors metadata (only containers, numbers, strings, tensors, numpy numeric "
            "values and argparse.Namespace can); save the state dict without it"
        )


def encode_tree(obj: Any) -> tuple[Any, list[TensorSite]]:
    """Encode the object `TorchZipFile.load` returned.

    Returns:
        The JSON document, and every tensor in the order met, each with the (empty) node that
        stands for it in the document; fill those in before serializing the document.

    Raises:
        UnsupportedCheckpointError: For a value JSON cannot hold exactly (names its path).
    """
    encoder = _Encoder()
    doc = encoder.encode(obj, ())
    return doc, encoder.sites


def dumps_tree(doc: Any) -> str:
    """The document as compact ASCII JSON (NaN can never appear: floats are encoded)."""
    return _dumps(doc)


# -- decoding ---------------------------------------------------------------------------------


def _unfloat(value: Any) -> float:
    if isinstance(value, dict):
        result: float = struct.unpack("<d", bytes.fromhex(value["float"]))[0]
        return result
    return float(value)


def _decode_numpy(spec: dict[str, Any]) -> Any:
    import numpy as np

    dtype = np.dtype(spec["dtype"])
    raw = base64.b64decode(spec["data"])
    if spec["shape"] is None:
        return np.frombuffer(raw, dtype=dtype)[0]
    order: Literal["C", "F"] = "F" if spec["fortran"] else "C"
    array = np.frombuffer(raw, dtype=dtype).reshape(tuple(spec["shape"]), order=order)
    return array.copy(order=order)  # writable, in its own memory, as unpickling gives


def _import_class(qualname: str) -> type:
    if qualname not in REBUILT_CLASSES:
        raise CheckpointFormatError(
            f"the structure names class '{qualname}', which zerosafe does not rebuild; the "
            "file was edited or written by another zerosafe"
        )
    module, name = qualname.rsplit(".", 1)
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise CheckpointFormatError(
            f"the structure holds a '{qualname}' object, and loading it needs that class: "
            f"{e}. Install the DeepSpeed that wrote the checkpoint (`pip install deepspeed`)."
        ) from e
    if not isinstance(cls, type):
        raise CheckpointFormatError(f"'{qualname}' is not a class in this DeepSpeed")
    return cls


def rebuild_object(qualname: str, args: list[Any], state: Any) -> Any:
    """The object an `{"object": ...}` node stands for, as unpickling would have built it:
    an enum member by value; otherwise `cls.__new__(cls, *args)` with its attributes set
    from `state` (through the class's own `__setstate__` where it has one).

    Raises:
        CheckpointFormatError: For a class outside `REBUILT_CLASSES`, or one that cannot be
            imported here (DeepSpeed not installed).
    """
    cls = _import_class(qualname)
    if issubclass(cls, enum.Enum):
        return cls(*args)
    obj = cls.__new__(cls, *args)
    if state is None:
        return obj
    setstate = getattr(cls, "__setstate__", None)  # plain classes have none
    if setstate is not None:
        setstate(obj, state)
        return obj
    slots: dict[str, Any] = {}
    if isinstance(state, tuple) and len(state) == 2:
        state, slots = state
    if state:
        obj.__dict__.update(state)
    for name, value in (slots or {}).items():
        setattr(obj, name, value)
    return obj


def _decode_key(value: Any) -> Key:
    return decode_tree(value, _no_tensor)


def _no_tensor(node: dict[str, Any]) -> Any:
    raise CheckpointFormatError(f"a tensor node {node!r} where a key was expected")


def decode_tree(
    value: Any,
    make_tensor: Callable[[dict[str, Any]], Any],
    make_object: Callable[[str, list[Any], Any], Any] = rebuild_object,
) -> Any:
    """Rebuild the object a document encodes; `make_tensor` turns a tensor node into a tensor,
    `make_object` an object node (class name, decoded arguments, decoded state) into an
    object (by default the real one, `rebuild_object`).

    Raises:
        CheckpointFormatError: If the document holds a node this version does not know.
    """

    def items(pairs: list[list[Any]]) -> list[tuple[Any, Any]]:
        return [(_decode_key(k), decode(v)) for k, v in pairs]

    def decode(v: Any) -> Any:
        if v is None or isinstance(v, (bool, int, float, str)):
            return v
        if isinstance(v, list):
            return [decode(x) for x in v]
        if not isinstance(v, dict):
            raise CheckpointFormatError(f"unexpected JSON value {v!r} in the structure")
        if "tensor" in v:
            return make_tensor(v)
        if not v:
            raise CheckpointFormatError("an empty node {} in the structure")
        tag = next(iter(v))
        payload: Any = v[tag]
        if tag == "odict":
            odict = collections.OrderedDict(items(payload))
            for name, attr in items(v.get("attrs", [])):
                setattr(odict, name, attr)
            return odict
        if len(v) != 1:
            raise CheckpointFormatError(f"unknown node {v!r} in the structure")
        if tag == "dict":
            return dict(items(payload))
        if tag == "tuple":
            return tuple(decode(x) for x in payload)
        if tag == "float":
            return _unfloat(v)
        if tag == "size":
            import torch

            return torch.Size(payload)
        if tag == "dtype":
            import torch

            return getattr(torch, payload)
        if tag == "device":
            import torch

            return torch.device(payload)
        if tag == "bytes":
            return base64.b64decode(payload)
        if tag == "bytearray":
            return bytearray(base64.b64decode(payload))
        if tag == "complex":
            return complex(_unfloat(payload[0]), _unfloat(payload[1]))
        if tag == "set":
            return {_decode_key(x) for x in payload}
        if tag == "frozenset":
            return frozenset(_decode_key(x) for x in payload)
        if tag == "slice":
            return slice(*(_decode_key(x) for x in payload))
        if tag == "defaultdict":
            return collections.defaultdict(None, items(payload))
        if tag == "namespace":
            return argparse.Namespace(**dict(items(payload)))
        if tag == "numpy":
            return _decode_numpy(payload)
        if tag == "object":
            qualname, args, state = payload
            return make_object(str(qualname), [decode(a) for a in args], decode(state))
        raise CheckpointFormatError(
            f"unknown node '{tag}' in the structure; written by a newer zerosafe?"
        )

    return decode(value)
