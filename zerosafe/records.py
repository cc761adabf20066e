"""One JSON form for the engine's records: dataclasses to and from JSON objects.

The records other runs, other versions and other tools read (task results, unit records, the
manifest, leases) are frozen dataclasses; their JSON is derived from their fields, in field
order, by `to_json` and read back by `from_json`, driven by the type hints:

- nested records, `tuple[X, ...]` and `list[X]` (JSON arrays), `dict[str, X]`, `X | None`,
  `Literal[...]` and `Enum` members (their values) are converted both ways;
- a field's JSON key is its name unless `json_meta(key=...)` gives the name on disk;
- `json_meta(omit_default=True)`: the key is left out while the field holds its default
  (a key written only when set);
- `json_meta(absent=value)`: what a key missing from the JSON reads as, where the field itself
  has no default (records written before the key existed);
- `json_meta(encode=f, decode=g)`: a field whose JSON is not derived from its type: `f(value)`
  is written and `g(json)` read back;
- `json_meta(skip=True)`: a field the record writes itself (its own `to_json`).

Reading ignores keys the record does not know (a newer writer's, or a flattened parent's),
fills a missing key with the field's default, and refuses a missing required key or a value
of the wrong kind with `RecordError`, naming the record, the key, what it expected and what
it found.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import sys
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, Literal, TypeVar, get_args, get_origin, get_type_hints

from zerosafe.errors import CheckpointFormatError

__all__ = ["JsonObject", "Record", "RecordError", "from_json", "json_meta", "to_json"]

JsonObject = dict[str, Any]
"""A JSON object as `json.loads` returns it: the one place its values are untyped."""

_META = "zerosafe.records"
_MISSING: Any = dataclasses.MISSING


class _NoAbsent:
    """`json_meta`'s `absent` when not given (`dataclasses.MISSING` cannot be a default)."""


_NO_ABSENT: Any = _NoAbsent()


class RecordError(CheckpointFormatError):
    """A record read back from JSON lacks a key or holds a value of another kind."""


@dataclasses.dataclass(frozen=True, slots=True)
class _FieldJson:
    key: str | None = None
    omit_default: bool = False
    absent: Any = _NO_ABSENT
    skip: bool = False
    encode: Callable[[Any], Any] | None = None
    decode: Callable[[Any], Any] | None = None


def json_meta(
    *,
    key: str | None = None,
    omit_default: bool = False,
    absent: Any = _NO_ABSENT,
    skip: bool = False,
    encode: Callable[[Any], Any] | None = None,
    decode: Callable[[Any], Any] | None = None,
) -> Mapping[str, object]:
    """A field's `metadata=` for `dataclasses.field`: how the field appears in JSON (see the
    module docstring)."""
    return {_META: _FieldJson(key, omit_default, absent, skip, encode, decode)}


def _field_json(f: dataclasses.Field[Any]) -> _FieldJson:
    meta = f.metadata.get(_META)
    return meta if isinstance(meta, _FieldJson) else _FieldJson()


def _default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not _MISSING:
        return f.default
    if callable(f.default_factory):
        return f.default_factory()
    return _MISSING


def to_json(obj: Any) -> JsonObject:
    """The JSON object of dataclass `obj`: its fields in order, under their JSON keys."""
    out: JsonObject = {}
    plain = _plain_fields(type(obj))
    for f in dataclasses.fields(obj):
        meta = _field_json(f)
        if meta.skip:
            continue
        value = getattr(obj, f.name)
        if meta.omit_default and value == _default(f):
            continue
        if meta.encode is not None:
            value = meta.encode(value)
        elif f.name in plain:  # JSON values already: a manifest's tensors are not walked
            value = plain[f.name](value)
        else:
            value = _dump(value)
        out[meta.key or f.name] = value
    return out


_PLAIN_TYPES = (str, int, float, bool, type(None))
_PLAIN: dict[type, dict[str, Callable[[Any], Any]]] = {}


def _is_plain(hint: Any) -> bool:
    """Whether values of `hint` are JSON values as they are (no record, enum or tuple)."""
    if hint is Any or hint is object or hint in _PLAIN_TYPES:
        return True
    origin = get_origin(hint)
    if origin is Literal:
        return True
    if origin in (typing.Union, types.UnionType, list, dict):
        return all(_is_plain(a) for a in get_args(hint) if a is not Ellipsis)
    return False


def _plain_fields(cls: type) -> dict[str, Callable[[Any], Any]]:
    """The fields of `cls` written without walking their values: field -> how (as they
    are, or a tuple of plain values as a list)."""
    plain = _PLAIN.get(cls)
    if plain is None:
        plain = {}
        for name, hint in _hints(cls).items():
            args = get_args(hint)
            if _is_plain(hint):
                plain[name] = _same
            elif get_origin(hint) is tuple and args[1:] == (Ellipsis,) and _is_plain(args[0]):
                plain[name] = list
        _PLAIN[cls] = plain
    return plain


def _same(value: Any) -> Any:
    return value


def _dump(value: Any) -> Any:
    if isinstance(value, Record):
        return value.to_json()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return to_json(value)
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, tuple | list):
        return [_dump(v) for v in value]
    if isinstance(value, dict):
        return {k: _dump(v) for k, v in value.items()}
    return value


_R = TypeVar("_R")
_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    hints = _HINTS.get(cls)
    if hints is None:
        module = sys.modules.get(cls.__module__)
        hints = _HINTS[cls] = get_type_hints(cls, vars(module) if module else None)
    return hints


def from_json(cls: type[_R], data: object) -> _R:
    """A `cls` (a dataclass) read from its JSON object.

    Raises:
        RecordError: If `data` is not an object, lacks a key `cls` needs, or holds a value of
            another kind than the field's type.
    """
    if not isinstance(data, Mapping):
        raise RecordError(
            f"{cls.__name__}: expected a JSON object, found {type(data).__name__}; the file "
            "was not written by zerosafe or is damaged"
        )
    hints = _hints(cls)
    kwargs: dict[str, object] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        meta = _field_json(f)
        if not f.init or meta.skip:
            continue
        key = meta.key or f.name
        if key in data and meta.decode is not None:
            kwargs[f.name] = meta.decode(data[key])
        elif key in data:
            kwargs[f.name] = _load(hints[f.name], data[key], f"{cls.__name__}.{key}")
        elif meta.absent is not _NO_ABSENT:
            kwargs[f.name] = copy.copy(meta.absent)
        elif _default(f) is _MISSING:
            raise RecordError(
                f"{cls.__name__}: expected the key '{key}', found {sorted(data)}; the file was "
                "not written by zerosafe or by a version that wrote another form"
            )
    return cls(**kwargs)


_SCALARS: dict[type, tuple[type, ...]] = {
    bool: (bool,),
    int: (int,),
    float: (float, int),
    str: (str,),
}


def _load(hint: Any, value: Any, where: str) -> Any:
    """`value` (from JSON) as type `hint`."""
    if hint is Any or hint is object:
        return value
    origin = get_origin(hint)
    if origin is typing.Union or origin is types.UnionType:
        arms = get_args(hint)
        if value is None and type(None) in arms:
            return None
        errors = []
        for arm in (a for a in arms if a is not type(None)):
            try:
                return _load(arm, value, where)
            except RecordError as e:
                errors.append(str(e))
        raise RecordError(
            errors[0] if len(errors) == 1 else f"{where}: {value!r} is none of {hint}"
        )
    if origin is Literal:
        if value not in get_args(hint):
            _wrong(where, f"one of {list(get_args(hint))}", value)
        return value
    if origin in (tuple, list):
        if not isinstance(value, list | tuple):
            _wrong(where, "an array", value)
        args = get_args(hint)
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            if len(args) != len(value):
                _wrong(where, f"an array of {len(args)}", value)
            return tuple(_load(a, v, where) for a, v in zip(args, value, strict=True))
        item = args[0] if args else Any
        if item is Any:
            return tuple(value) if origin is tuple else list(value)
        loaded = [_load(item, v, where) for v in value]
        return tuple(loaded) if origin is tuple else loaded
    if origin is dict:
        if not isinstance(value, Mapping):
            _wrong(where, "an object", value)
        _, item = get_args(hint) or (str, Any)
        if item is Any:
            return dict(value)
        if get_origin(item) is dict and get_args(item)[1:] == (Any,):  # records by name
            if not all(isinstance(v, Mapping) for v in value.values()):
                _wrong(where, "an object of objects", value)
            return {k: dict(v) for k, v in value.items()}
        return {k: _load(item, v, where) for k, v in value.items()}
    if isinstance(hint, type):
        return _load_type(hint, value, where)
    return value


def _load_type(hint: type, value: Any, where: str) -> Any:
    if issubclass(hint, Record):
        return hint.from_json(value)
    if dataclasses.is_dataclass(hint):
        return from_json(hint, value)
    if issubclass(hint, enum.Enum):
        try:
            return hint(value)
        except ValueError:
            _wrong(where, f"one of {[m.value for m in hint]}", value)
    if hint is type(None):
        if value is not None:
            _wrong(where, "null", value)
        return None
    kinds = _SCALARS.get(hint)
    if kinds is not None:
        if not isinstance(value, kinds) or (hint is not bool and isinstance(value, bool)):
            _wrong(where, hint.__name__, value)
        return value
    if not isinstance(value, hint):
        _wrong(where, hint.__name__, value)
    return value


def _wrong(where: str, expected: str, found: Any) -> typing.NoReturn:
    shown = repr(found)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    raise RecordError(f"{where}: expected {expected}, found {shown}")


class Record:
    """Base of a dataclass record: `to_json()` and `cls.from_json(data)` by this module's
    rules; a record whose JSON has more than its fields overrides them around these."""

    __slots__ = ()

    def to_json(self) -> JsonObject:
        return to_json(self)

    @classmethod
    def from_json(cls: type[_R], data: object) -> _R:
        return from_json(cls, data)
