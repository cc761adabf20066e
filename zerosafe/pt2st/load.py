"""Load a safetensors file written by `zerosafe.pt2st.convert_pt` back into the object that
`torch.load` gives for the original `.pt`, lazily and without unpickling anything.

On the CPU the file is memory-mapped copy-on-write (as `torch.load(mmap=True)` does) and each
storage is a zero-copy window onto its entry, so loading costs no memory until values are
touched and writes never reach the file. On another device (`cuda:0`) each storage is
allocated there and filled in chunks through one small staging buffer, so host memory stays
bounded by that buffer whatever the size of the checkpoint.

Format: see `zerosafe.pt2st.convert` (entries) and `zerosafe.pt2st.tree` (the structure).
"""

from __future__ import annotations

import io
import json
import logging
import mmap
import os
from typing import TYPE_CHECKING, Any

from zerosafe.dtypes import dtype_info, from_safetensors_code, torch_dtype
from zerosafe.errors import CheckpointFormatError
from zerosafe.formats.safetensors import SafetensorsHeader, StoredEntry, read_entries, read_header
from zerosafe.formats.torch_pickle import contiguous_stride
from zerosafe.io.storage import ByteSource, Storage, is_local, local_path
from zerosafe.pt2st.convert import (
    FORMAT_VERSION,
    META_SOURCE_BYTES,
    META_TREE,
    META_VERSION,
    safetensors_path_for,
    view_end_bytes,
)
from zerosafe.pt2st.tree import decode_tree

if TYPE_CHECKING:
    import torch

__all__ = ["load_pt", "load_pt_like", "safetensors_path_for"]

log = logging.getLogger(__name__)

_STAGING_BYTES = 64 * 2**20


class _Storages:
    """The storages of one file on one device, each made once and shared by its views."""

    def __init__(
        self,
        src: ByteSource,
        entries: SafetensorsHeader,
        data_start: int,
        *,
        device: torch.device,
        use_mmap: bool,
        staging_bytes: int,
    ) -> None:
        self.src = src
        self.entries = entries
        self.data_start = data_start
        self.device = device
        self.staging_bytes = staging_bytes
        self._cache: dict[str, torch.UntypedStorage] = {}
        self._staging: torch.Tensor | None = None
        self._mm: mmap.mmap | None = None
        if use_mmap and device.type == "cpu" and is_local(src.url) and src.size_bytes:
            with open(local_path(src.url), "rb") as f:
                # Copy-on-write: tensors are writable, and writes stay in this process.
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)

    def _entry(self, name: str) -> StoredEntry:
        try:
            return self.entries[name]
        except KeyError:
            raise CheckpointFormatError(
                f"{self.src.url}: the structure names entry '{name}', which the file does not "
                "hold; the file is damaged or was edited"
            ) from None

    def _fill(self, start: int, nbytes: int) -> torch.UntypedStorage:
        """A storage of `nbytes` on the device, read in chunks of at most `staging_bytes`."""
        import torch

        out = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        if self.device.type == "cpu":  # read straight into place
            target = out.numpy().data
            for pos in range(0, nbytes, self.staging_bytes):
                n = min(self.staging_bytes, nbytes - pos)
                self.src.readinto_at(start + pos, target[pos : pos + n])
            return out.untyped_storage()
        if self._staging is None:
            largest = max(e.nbytes for e in self.entries.values())
            self._staging = torch.empty(
                min(self.staging_bytes, largest),
                dtype=torch.uint8,
                pin_memory=self.device.type == "cuda",
            )
        staging = self._staging
        view = staging.numpy().data
        for pos in range(0, nbytes, len(view)):
            n = min(len(view), nbytes - pos)
            self.src.readinto_at(start + pos, view[:n])
            out[pos : pos + n].copy_(staging[:n])  # synchronous: the buffer is reused next
        return out.untyped_storage()

    def storage(self, name: str) -> torch.UntypedStorage:
        import torch

        cached = self._cache.get(name)
        if cached is not None:
            return cached
        begin, end = self._entry(name).data_offsets
        start, nbytes = self.data_start + begin, end - begin
        if nbytes == 0:
            result = torch.UntypedStorage(0, device=self.device)  # type: ignore[no-untyped-call]
        elif self._mm is not None:
            result = torch.frombuffer(
                self._mm, dtype=torch.uint8, count=nbytes, offset=start
            ).untyped_storage()
        else:
            result = self._fill(start, nbytes)
        self._cache[name] = result
        return result

    def tensor(self, node: dict[str, Any]) -> torch.Tensor:
        import torch

        name = node["tensor"]
        entry = self._entry(name)
        dtype = node.get("dtype") or from_safetensors_code(entry.dtype).name
        shape = node.get("shape", list(entry.shape))
        stride = node.get("stride", contiguous_stride(shape))
        offset = node.get("offset", 0)
        storage = self.storage(name)
        if view_end_bytes(shape, stride, offset, dtype_info(dtype).itemsize) > storage.nbytes():
            raise CheckpointFormatError(
                f"{self.src.url}: a tensor viewing '{name}' (shape {shape}, stride {stride}, "
                f"offset {offset}) reaches past its {storage.nbytes()} bytes; the file is damaged"
            )
        tensor = torch.empty(0, dtype=torch_dtype(dtype), device=self.device)
        tensor.set_(storage, offset, shape, stride)
        if node.get("parameter"):
            return torch.nn.Parameter(tensor, requires_grad=bool(node.get("requires_grad")))
        if node.get("requires_grad"):
            tensor.requires_grad_(True)
        return tensor


def load_pt_like(
    url: str,
    *,
    device: str | torch.device = "cpu",
    mmap: bool = True,
    storage_options: dict[str, Any] | None = None,
    staging_bytes: int = _STAGING_BYTES,
) -> Any:
    """Load a `zerosafe pt2st` output as the object `torch.load` gives for its source.

    Same structure, key types, container types and leaves; tensors bit-exact, with their
    dtype, shape, stride and storage offset; tensors that shared a storage share one again;
    `nn.Parameter`s come back as parameters with their `requires_grad`. A safetensors file
    without zerosafe's structure loads as a dict of its tensors, like
    `safetensors.torch.load_file`.

    Args:
        url: The `.safetensors` file (local, NFS or an fsspec URL).
        device: Where tensors live. On `cpu` a local file is memory-mapped (nothing is read
            until used); elsewhere tensors are copied there one storage at a time.
        mmap: On `cpu`, map the file (the default) instead of reading it into memory.
        storage_options: fsspec options for a remote `url`.
        staging_bytes: Largest read without a memory map, and the host buffer for copies to
            another device.

    Raises:
        CheckpointFormatError: If the file is not safetensors, or was written by a newer
            zerosafe format.
    """
    import torch

    storage = Storage(storage_options)
    src = storage.open_source(url)
    try:
        entries, metadata, data_start = read_entries(src)
        storages = _Storages(
            src,
            entries,
            data_start,
            device=torch.device(device),
            use_mmap=mmap,
            staging_bytes=staging_bytes,
        )
        if META_TREE not in metadata:
            return {name: storages.tensor({"tensor": name}) for name in entries}
        if metadata.get(META_VERSION) != FORMAT_VERSION:
            raise CheckpointFormatError(
                f"{url}: written in zerosafe pt2st format '{metadata.get(META_VERSION)}'; this "
                f"zerosafe reads format '{FORMAT_VERSION}'. Upgrade zerosafe."
            )
        return decode_tree(json.loads(metadata[META_TREE]), storages.tensor)
    finally:
        src.close()  # the memory map, if any, holds its own reference to the file


def _is_stale(storage: Storage, pt_url: str, st_url: str) -> str | None:
    """Why the safetensors beside `pt_url` does not hold its current content, or None."""
    if not storage.exists(pt_url):
        return None
    src = storage.open_source(st_url)
    try:
        _, metadata, _ = read_header(src)
    finally:
        src.close()
    pt = storage.identity(pt_url)
    recorded = metadata.get(META_SOURCE_BYTES)
    if recorded is not None and int(recorded) != pt.size_bytes:
        return f"it was converted from a {recorded}-byte file; '{pt_url}' has {pt.size_bytes}"
    if (
        is_local(pt_url)
        and os.stat(local_path(pt_url)).st_mtime > os.stat(local_path(st_url)).st_mtime
    ):
        return f"'{pt_url}' was written after it"
    return None


def load_pt(
    path: str,
    *,
    device: str | torch.device = "cpu",
    storage_options: dict[str, Any] | None = None,
) -> Any:
    """Load a torch checkpoint for resuming, from its safetensors conversion when there is one.

    Given `x.pt`, loads `x.safetensors` beside it when present and not older than `x.pt`
    (lazily, see `load_pt_like`), so a training script resumes without staging the whole
    checkpoint in host memory. Otherwise loads `x.pt` with `torch.load(weights_only=True)`,
    memory-mapped when local (a remote `x.pt` is read whole into memory).

    Args:
        path: The `.pt` path (it need not exist when the `.safetensors` does).
        device: Where tensors go (`cpu`, `cuda:0`, ...), as `map_location`.
        storage_options: fsspec options for remote paths.
    """
    import torch

    storage = Storage(storage_options)
    st_url = safetensors_path_for(path)
    if storage.exists(st_url):
        stale = _is_stale(storage, path, st_url)
        if stale is None:
            log.info("%s: loading %s instead", path, st_url)
            return load_pt_like(st_url, device=device, storage_options=storage_options)
        log.warning("%s: not using %s: %s", path, st_url, stale)
    if is_local(path):
        return torch.load(local_path(path), map_location=device, weights_only=True, mmap=True)
    # A remote .pt cannot be memory-mapped: torch.load needs it whole in memory.
    return torch.load(io.BytesIO(storage.read_bytes(path)), map_location=device, weights_only=True)
