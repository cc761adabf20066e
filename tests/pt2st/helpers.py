"""Helpers for the pt2st tests: a round trip through real files, and an exact comparison."""

from __future__ import annotations

import argparse
import collections
import struct
from pathlib import Path
from typing import Any

import numpy as np
import torch

from zerosafe.pt2st import convert_pt, load_pt_like, verify_pt


def roundtrip(obj: Any, tmp: Path, name: str = "ckpt", **load_kw: Any) -> tuple[Any, Any, dict]:
    """Save `obj` with torch, convert, verify, load back: (loaded, torch.load's, summary)."""
    pt = tmp / f"{name}.pt"
    torch.save(obj, pt)
    return roundtrip_file(pt, **load_kw)


def roundtrip_file(pt: Path, **load_kw: Any) -> tuple[Any, Any, dict]:
    """Convert a file torch wrote, verify, load back: (loaded, torch.load's, summary)."""
    out = pt.with_suffix(".safetensors")
    summary = convert_pt(str(pt), str(out), overwrite=True)
    verify_pt(str(out), expected_sha256=summary["sha256"])
    # The oracle: torch's own loader on the file torch wrote (a fixture this test made).
    want = torch.load(pt, weights_only=False)
    return load_pt_like(str(out), **load_kw), want, summary


def _storage_bytes(t: torch.Tensor) -> torch.Tensor:
    st = t.untyped_storage()
    out = torch.empty(0, dtype=torch.uint8, device=t.device).set_(st, 0, (st.nbytes(),), (1,))
    return out.cpu()


def _float_bits(x: float) -> bytes:
    return struct.pack("<d", x)


def assert_same(got: Any, want: Any, path: str = "obj") -> None:
    """Same types, keys (with their types and order), values; tensors bit-exact with their
    dtype, shape, stride, storage offset, storage size, Parameter-ness and requires_grad."""
    assert type(got) is type(want), f"{path}: {type(got).__name__} != {type(want).__name__}"
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype, f"{path}: dtype {got.dtype} != {want.dtype}"
        assert got.shape == want.shape, f"{path}: shape {got.shape} != {want.shape}"
        assert got.stride() == want.stride(), f"{path}: stride {got.stride()} != {want.stride()}"
        assert got.storage_offset() == want.storage_offset(), f"{path}: storage offset"
        assert got.requires_grad == want.requires_grad, f"{path}: requires_grad"
        assert got.untyped_storage().nbytes() == want.untyped_storage().nbytes(), f"{path}"
        assert torch.equal(_storage_bytes(got), _storage_bytes(want)), f"{path}: bytes differ"
    elif isinstance(want, (dict, argparse.Namespace)):
        g, w = (vars(got), vars(want)) if isinstance(want, argparse.Namespace) else (got, want)
        assert [(type(k), k) for k in g] == [(type(k), k) for k in w], f"{path}: keys"
        for k in w:
            assert_same(g[k], w[k], f"{path}[{k!r}]")
        if isinstance(want, collections.OrderedDict):
            assert_same(dict(vars(got)), dict(vars(want)), f"{path}.__dict__")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), f"{path}: length {len(got)} != {len(want)}"
        for i, (g_item, w_item) in enumerate(zip(got, want, strict=True)):
            assert_same(g_item, w_item, f"{path}[{i}]")
    elif isinstance(want, float):
        assert _float_bits(got) == _float_bits(want), f"{path}: {got!r} != {want!r}"
    elif isinstance(want, complex):
        assert _float_bits(got.real) == _float_bits(want.real), path
        assert _float_bits(got.imag) == _float_bits(want.imag), path
    elif isinstance(want, (np.ndarray, np.generic)):
        assert got.dtype == want.dtype, f"{path}: numpy dtype"
        assert np.shape(got) == np.shape(want), f"{path}: numpy shape"
        if isinstance(want, np.ndarray):
            assert got.flags.f_contiguous == want.flags.f_contiguous, f"{path}: order"
        assert np.asarray(got).tobytes() == np.asarray(want).tobytes(), f"{path}: numpy bytes"
    else:
        assert got == want, f"{path}: {got!r} != {want!r}"
    if path == "obj":
        assert_same_sharing(got, want)


def tensors_of(obj: Any) -> list[torch.Tensor]:
    """Every tensor in `obj`, in traversal order (dict values, list items, attributes)."""
    found: list[torch.Tensor] = []

    def walk(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            found.append(x)
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
            if isinstance(x, collections.OrderedDict):
                walk(vars(x))
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)
        elif isinstance(x, argparse.Namespace):
            walk(vars(x))

    walk(obj)
    return found


def assert_same_sharing(got: Any, want: Any) -> None:
    """Tensors that shared a storage in `want` share one in `got`, and no others do."""

    def groups(obj: Any) -> list[int]:
        ids: dict[int, int] = {}
        out = []
        for t in tensors_of(obj):
            st = t.untyped_storage()
            if st.nbytes() == 0:
                out.append(-1)  # empty storages have no address to share
                continue
            out.append(ids.setdefault(st.data_ptr(), len(ids)))
        return out

    assert groups(got) == groups(want), "tensors share storages differently"


class CraftedStorage:
    """A storage for `craft_pt`: pickled as torch.save's persistent id, its bytes a record."""

    def __init__(self, key: str, storage_type: type, numel: int, data: bytes) -> None:
        self.key, self.storage_type, self.numel, self.data = key, storage_type, numel, data


class Rebuild:
    """`torch._utils._rebuild_tensor_v2(*args)` as a pickle names it, with any arguments."""

    def __init__(self, *args: Any) -> None:
        self.args = args

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (torch._utils._rebuild_tensor_v2, self.args)


def craft_pt(path: Path, obj: Any, storages: list[CraftedStorage]) -> Path:
    """Write a torch zip file whose pickle holds exactly `obj`: records torch.save would never
    write (a crafted or corrupted file), to test what the reader accepts."""
    import io
    import pickle

    class _Pickler(pickle.Pickler):
        def persistent_id(self, o: Any) -> Any:
            if isinstance(o, CraftedStorage):
                return ("storage", o.storage_type, o.key, "cpu", o.numel)
            return None

    buf = io.BytesIO()
    _Pickler(buf, protocol=2).dump(obj)
    return write_torch_zip(path, buf.getvalue(), {s.key: s.data for s in storages})


def write_torch_zip(path: Path, pickle_bytes: bytes, storages: dict[str, bytes]) -> Path:
    """A torch zip file (stored records, as torch.save writes) with this pickle and storages."""
    import zipfile

    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zf:
        zf.writestr("archive/data.pkl", pickle_bytes)
        zf.writestr("archive/byteorder", "little")
        for key, data in storages.items():
            zf.writestr(f"archive/data/{key}", data)
        zf.writestr("archive/version", "3\n")
    return path
