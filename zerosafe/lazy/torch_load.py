"""`with zerosafe.lazy_torch_load(): engine.load_checkpoint(CKPT_DIR)`: resume DeepSpeed (or
any code that calls `torch.load` on a path) from the `.pt` files' safetensors siblings.

Inside the block, `torch.load(path, map_location=...)` of a file whose sibling is current
(`zerosafe.lazy.siblings`) returns the sibling's object, as `zerosafe.pt2st.load_pt_like`
builds it: memory-mapped copy-on-write on the CPU, so nothing is read until used and pages
that are only read stay reclaimable page cache; on another device, copied there storage by
storage through one bounded host buffer. Every other call (a file-like object, a file with no
sibling or a stale one, a custom `pickle_module`, a `map_location` dict) goes to the real
`torch.load` unchanged. DeepSpeed's `TorchCheckpointEngine.load` calls `torch.load(path,
map_location=..., weights_only=False)` once per file, and each rank asks only for its own
optimizer file, so each rank maps only its own files.

`map_location`: a device (`"cpu"`, `"cuda:0"`, `torch.device`) puts every tensor there; a
function is asked once where a CPU storage goes (DeepSpeed's `lambda storage, loc: storage`
keeps it on the CPU); `None` loads on the CPU (siblings do not record the device a tensor
was saved from, where `torch.load` would restore it); a dict falls back to `torch.load`.

Threads: the patch is process-wide while any block is open (a module attribute is the only
place DeepSpeed looks up `torch.load`). Blocks may nest and overlap across threads: the first
one in installs it, the last one out restores the original. A call from a thread that has no
open block uses the options of the most recent block.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from zerosafe.io.storage import Storage
from zerosafe.lazy.siblings import sibling_state
from zerosafe.pt2st.load import load_pt_like

if TYPE_CHECKING:
    import torch

__all__ = ["LazyLoads", "lazy_torch_load"]

log = logging.getLogger(__name__)

_STAGING_BYTES = 64 * 2**20
_PASSED_THROUGH = {"weights_only", "mmap"}  # accepted and ignored: siblings never run code


@dataclass
class LazyLoads:
    """What one `lazy_torch_load` block did: files loaded from siblings, and the others."""

    staging_bytes: int = _STAGING_BYTES
    loaded: list[str] = field(default_factory=list)
    """`.pt` paths whose sibling was loaded instead."""
    fell_back: list[tuple[str, str]] = field(default_factory=list)
    """`(path or file name, why)` for calls that went to the real `torch.load`."""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def record(self, path: str, why: str | None) -> None:
        with self._lock:
            if why is None:
                self.loaded.append(path)
            else:
                self.fell_back.append((path, why))


class _Patch:
    """The one process-wide replacement of `torch.load`, shared by every open block."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.original: Callable[..., Any] | None = None
        self.blocks: list[LazyLoads] = []
        self.local = threading.local()

    def enter(self, block: LazyLoads) -> None:
        import torch

        with self.lock:
            if not self.blocks:
                self.original = torch.load
                torch.load = _lazy_load
            self.blocks.append(block)
        stack: list[LazyLoads] = getattr(self.local, "stack", [])
        self.local.stack = [*stack, block]

    def exit(self, block: LazyLoads) -> None:
        import torch

        self.local.stack = [b for b in getattr(self.local, "stack", []) if b is not block]
        with self.lock:
            self.blocks = [b for b in self.blocks if b is not block]
            if self.blocks:
                return
            if torch.load is _lazy_load:
                torch.load = self.original  # type: ignore[assignment]
            else:
                log.warning(
                    "torch.load was replaced again inside a lazy_torch_load block (by %r); "
                    "leaving that replacement in place",
                    torch.load,
                )
            self.original = None

    def current(self) -> tuple[LazyLoads | None, Callable[..., Any]]:
        with self.lock:
            original = self.original
            latest = self.blocks[-1] if self.blocks else None
        stack: list[LazyLoads] = getattr(self.local, "stack", [])
        if original is None:  # every block closed while this call was on its way in
            import torch

            return None, torch.load
        return (stack[-1] if stack else latest), original


_PATCH = _Patch()


def _device_for(map_location: Any) -> torch.device | None:
    """The device a sibling's tensors go to, or None when only `torch.load` can honour it."""
    import torch

    if map_location is None:
        return torch.device("cpu")
    if isinstance(map_location, (str, torch.device)):
        return torch.device(map_location)
    if callable(map_location):
        probe = torch.UntypedStorage(0)  # type: ignore[no-untyped-call]
        try:
            moved = map_location(probe, "cpu")
        except Exception:  # the function expects real storages: let torch.load call it
            return None
        if moved is None or moved is probe:
            return torch.device("cpu")
        if isinstance(moved, torch.UntypedStorage):
            return moved.device
    return None


def _why_not(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[str | None, str, Any]:
    """`(why the real torch.load must take this call, path, map_location)`."""
    f = args[0] if args else kwargs.get("f")
    map_location = args[1] if len(args) > 1 else kwargs.get("map_location")
    path = os.fspath(f) if isinstance(f, (str, os.PathLike)) else None
    if not isinstance(path, str):
        return "not a path", str(getattr(f, "name", type(f).__name__)), map_location
    extra = set(kwargs) - {"f", "map_location", "pickle_module"} - _PASSED_THROUGH
    if len(args) > 2 or extra or kwargs.get("pickle_module") is not None:
        return "a custom pickle_module or unpickler arguments", path, map_location
    return None, path, map_location


def _lazy_load(*args: Any, **kwargs: Any) -> Any:
    """Stands in for `torch.load` while a block is open."""
    block, original = _PATCH.current()
    if block is None:
        return original(*args, **kwargs)
    why, path, map_location = _why_not(args, kwargs)
    device = None
    if why is None:
        device = _device_for(map_location)
        if device is None:
            why = f"map_location {map_location!r} is not a device or a function of one"
    if why is None:
        state = sibling_state(Storage(), path) if os.path.isfile(path) else None
        if state is None:
            why = "no such file"
        elif state.state == "stale":
            log.warning(
                "%s: not using %s, which is stale (%s); run `zerosafe lazify` again",
                path,
                state.sibling_url,
                state.why,
            )
            why = f"stale sibling: {state.why}"
        elif state.state == "missing":
            why = "no sibling"
    if why is not None:
        block.record(path, why)
        return original(*args, **kwargs)
    assert device is not None and state is not None
    log.info("%s: loading %s lazily on %s", path, state.sibling_url, device)
    obj = load_pt_like(state.sibling_url, device=device, staging_bytes=block.staging_bytes)
    block.record(path, None)
    return obj


@contextmanager
def lazy_torch_load(*, staging_bytes: int = _STAGING_BYTES) -> Iterator[LazyLoads]:
    """Within the block, `torch.load` of a `.pt` path with a current sibling loads the
    sibling lazily (see the module docstring); everything else loads as usual.

        with zerosafe.lazy_torch_load() as loads:
            engine.load_checkpoint(CKPT_DIR)
        print(loads.loaded)  # the .pt files read through their siblings

    Args:
        staging_bytes: Host buffer for copies to a GPU (and the largest single read of a
            file that cannot be memory-mapped).

    Yields:
        A `LazyLoads` that records which calls used a sibling and which did not, and why.
    """
    block = LazyLoads(staging_bytes=staging_bytes)
    _PATCH.enter(block)
    try:
        yield block
    finally:
        _PATCH.exit(block)
