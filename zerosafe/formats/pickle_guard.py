"""What a restricted unpickler hands out, sealed so that no pickle can change it.

An allowlist maps each global a pickle may name to one object, and that object is shared by
every file loaded in the process. The pickle `BUILD` opcode applies state to whatever object
is on the stack (CPython's `Modules/_pickle.c`, `load_build`; `pickle.py`, `load_build`): it
calls the object's `__setstate__(state)` if it has one, otherwise writes a dict state into
its `__dict__` and sets each item of a slot-state dict (`(state, slotstate)`) with `setattr`.
On a shared object (a storage type, a class, a function: `setattr` reaches its
`__defaults__`), one hostile file would change how every later file is read (DESIGN.md,
invariant 11). So every value of a table is one of:
- a `SealedToken` or `SealedStr`: no `__dict__`, `setattr` refused, `__setstate__` refuses;
- a `SealedFunction`: a plain function (whose `__dict__`, `__defaults__` and `__code__` are
  writable) behind a sealed callable;
- a class made by `SealedClass` (the inert records): class-level `setattr` refused, and its
  `__setstate__` refuses when looked up on the class, while fresh instances keep their own;
- a builtin type (`set`, `OrderedDict`): immutable already (`Py_TPFLAGS_IMMUTABLETYPE`).

`seal_table` seals a table and checks this at import; `GuardedUnpickler` is the base of
every unpickler in zerosafe and turns a refused `BUILD` into one line naming the file.
"""

from __future__ import annotations

import functools
import io
import pickle
import types
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, NoReturn

from zerosafe.errors import UnsafePickleError

__all__ = [
    "GuardedUnpickler",
    "SealedClass",
    "SealedFunction",
    "SealedStr",
    "SealedToken",
    "StateRefusedError",
    "seal_table",
]

_IMMUTABLE_TYPE = 1 << 8
"""`Py_TPFLAGS_IMMUTABLETYPE` (Include/object.h, CPython 3.10+): the builtin types."""


class StateRefusedError(UnsafePickleError):
    """A pickle's `BUILD` targets a shared global; `GuardedUnpickler.load` adds the file."""

    def __init__(self, qualname: str) -> None:
        super().__init__(
            f"the pickle applies state (a BUILD opcode) to the global '{qualname}', which "
            "every later file would share"
        )
        self.qualname = qualname


def _refuse_state(qualname: str, state: Any) -> NoReturn:
    raise StateRefusedError(qualname)


def _refuse_change(qualname: str, name: str) -> NoReturn:
    raise AttributeError(f"'{qualname}' is shared by every unpickler: '{name}' cannot be changed")


class SealedToken:
    """A shared object a table hands out (`torch.FloatStorage`): read-only fields in slots."""

    __slots__ = ("qualname",)
    qualname: str

    def __init__(self, qualname: str, **fields: Any) -> None:
        object.__setattr__(self, "qualname", qualname)
        for name, value in fields.items():
            object.__setattr__(self, name, value)

    def __setattr__(self, name: str, value: Any) -> NoReturn:
        _refuse_change(self.qualname, name)

    def __delattr__(self, name: str) -> NoReturn:
        _refuse_change(self.qualname, name)

    def __setstate__(self, state: Any) -> NoReturn:
        _refuse_state(self.qualname, state)

    def __repr__(self) -> str:
        return f"<{self.qualname}>"


class SealedFunction(SealedToken):
    """A plain function as a table hands it out; calling it calls `function`."""

    __slots__ = ("function",)
    function: Callable[..., Any]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.function(*args, **kwargs)


class SealedStr(str):
    """A shared `str` token (a dtype name): no `__dict__`, and `__setstate__` refuses."""

    __slots__ = ()

    @property
    def qualname(self) -> str:
        """The global this token stands for."""
        return str(self)

    def __setstate__(self, state: Any) -> NoReturn:
        _refuse_state(self.qualname, state)


class SealedClass(type):
    """Metaclass of the classes a table hands out: the class itself cannot be changed.

    A `BUILD` on the class looks up `__setstate__` on it and finds this metaclass's property
    first (a data descriptor), which refuses; an instance looks it up on its class, so fresh
    instances are built as usual.
    """

    def __setattr__(cls, name: str, value: Any) -> NoReturn:
        _refuse_change(_class_name(cls), name)

    def __delattr__(cls, name: str) -> NoReturn:
        _refuse_change(_class_name(cls), name)

    @property
    def __setstate__(cls) -> Callable[[Any], NoReturn]:
        return functools.partial(_refuse_state, _class_name(cls))


def _class_name(cls: type) -> str:
    name = getattr(cls, "qualname", None)
    return name if isinstance(name, str) else f"{cls.__module__}.{cls.__qualname__}"


def _is_sealed(value: Any) -> bool:
    if isinstance(value, (SealedToken, SealedStr, SealedClass)):
        return True
    return isinstance(value, type) and bool(value.__flags__ & _IMMUTABLE_TYPE)


def seal_table(table: dict[str, Any]) -> None:
    """Seal every value of an allowlist table, in place, so that no pickle can change it.

    Args:
        table: Global qualname -> what it becomes. Plain functions are replaced by one
            `SealedFunction` per name; every other value must already be sealed.

    Raises:
        TypeError: If a value is mutable (a programming error, caught at import).
    """
    for qualname, value in table.items():
        if isinstance(value, types.FunctionType):
            table[qualname] = value = SealedFunction(qualname, function=value)
        if not _is_sealed(value):
            raise TypeError(
                f"allowlist entry '{qualname}' is a {type(value).__name__}, which a pickle's "
                "BUILD could change for every later load; make it a SealedToken, a "
                "SealedClass or a plain function"
            )


class GuardedUnpickler(pickle.Unpickler):
    """Unpickles with the globals of `table` only; the base of every unpickler in zerosafe.

    Subclasses set `table` (made by `seal_table`) and say how an unknown global is refused.
    """

    table: ClassVar[Mapping[str, Any]]

    def __init__(self, data: bytes | io.BytesIO, url: str) -> None:
        super().__init__(io.BytesIO(data) if isinstance(data, bytes) else data)
        self._url = url
        self.globals_found: set[str] = set()

    def find_class(self, module: str, name: str) -> Any:
        qualname = f"{module}.{name}"
        try:
            target = self.table[qualname]
        except KeyError:
            raise self.unknown_global(qualname) from None
        self.globals_found.add(qualname)
        return target

    def unknown_global(self, qualname: str) -> UnsafePickleError:
        """The error for a global outside `table`."""
        return UnsafePickleError(
            f"{self._url}: the pickle names the global '{qualname}', which is not on "
            "zerosafe's allowlist, so the file was not loaded (loading it could run code)"
        )

    def load(self) -> Any:
        """Unpickle the object.

        Raises:
            UnsafePickleError: If the pickle names a global outside `table`, or applies
                state to one of them.
        """
        try:
            return super().load()
        except StateRefusedError as e:
            raise UnsafePickleError(
                f"{self._url}: {e}; torch.save never writes this, so the file was not "
                "loaded. It was crafted or damaged: use the checkpoint as the training run "
                "wrote it."
            ) from e
