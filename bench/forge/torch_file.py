"""One torch.save-style file: the pickle of a node tree, then its storages streamed into the zip."""

from __future__ import annotations

import hashlib
import os
from typing import Any

from .pickles import pickle_with_storages
from .pipeline import Pipeline
from .zipwriter import ZIP64_LIMIT, ZipWriter


def _serialization_id(seed: int, path: str) -> bytes:
    tag_and_name = "/".join(
        os.path.normpath(path).split(os.sep)[-2:]
    )  # not the folder: same bytes anywhere
    h = hashlib.blake2b(f"{seed}\0{tag_and_name}".encode(), digest_size=17).digest()
    return f"{int.from_bytes(h, 'little') % 10**40:040d}".encode()


def write_torch_file(
    path: str,
    obj: Any,
    *,
    pipeline: Pipeline | None = None,
    seed: int = 0,
    zip64_threshold: int = ZIP64_LIMIT,
) -> dict[str, Any]:
    """Write `obj` (built from this module's nodes) as a torch.save-style zip at `path`, streaming
    the storages' contents. Written to a temporary name and renamed when complete."""
    data_pkl, storages = pickle_with_storages(obj)
    archive = os.path.splitext(os.path.basename(path))[0]
    own = pipeline is None
    pipe = pipeline or Pipeline(8 << 20, 1, seed)
    tmp = os.path.join(os.path.dirname(path) or ".", f".{os.path.basename(path)}.tmp")
    zw = ZipWriter(tmp, zip64_threshold)
    try:
        zw.add(f"{archive}/data.pkl", data_pkl)
        zw.add(f"{archive}/.format_version", b"1")
        zw.add(f"{archive}/.storage_alignment", b"64")
        zw.add(f"{archive}/byteorder", b"little")
        for st in storages:
            pipe.write_storage(zw, f"{archive}/data/{st.key}", st)
        zw.add(f"{archive}/version", b"3\n")
        zw.add(f"{archive}/.data/serialization_id", _serialization_id(seed, path))
        zw.close()
    except BaseException:
        zw.abort()
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    finally:
        if own:
            pipe.close()
    os.replace(tmp, path)
    return {
        "path": path,
        "apparent_bytes": zw.pos,
        "written_bytes": zw.written,
        "storages": [(st.cls, st.numel, st.hole) for st in storages],
    }
