"""Forge synthetic DeepSpeed ZeRO checkpoints, fast and in bounded memory.

The files follow DeepSpeed 0.19.8's on-disk format (as read off the real checkpoints in
``shared/fixtures/deepspeed``): the same file names, the same pickle structure and globals
(``collections.OrderedDict``, ``torch._utils._rebuild_tensor_v2``, ``torch.Size``, the storage
classes, DeepSpeed's ``LossScaler`` / ``ZeroStageEnum`` / ``fragment_address`` ...), torch's zip
container with 64-byte aligned records, CRC-32 per record and ZIP64 records past 4 GB.
Neither torch nor DeepSpeed is needed (or imported) to write them: the pickles are emitted by a
small pickler that names those globals itself, and the zip is written here, streaming.

Every value is a cheap function of (param name, element index, seed), so any range of any
output can be checked without a golden copy: see `expected_fp32`, `expected_16bit`,
`expected_buffer`. Adam moments are written as sparse holes by default (they read as zeros).

    python bench/forge.py DEST --params 500M --stage 3 --world-size 8 --dtype bf16
"""

from __future__ import annotations

import argparse
import hashlib
import io
import math
import os
import pickle
import re
import struct
import sys
import threading
import time
import zlib
from collections import OrderedDict, deque
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import numpy as np

# zip's CRC-32 of a concatenation and of a run of zeros (holes, padding), in O(log n)
from zerosafe.formats.crc import crc32_combine, crc32_zeros
from zerosafe.formats.torch_zip import contiguous_stride

DS_VERSION = "0.19.8"
ZIP64_LIMIT = 0xFFFFFFFF
"""Sizes and offsets at or above this are written as ZIP64 fields (the 32-bit field holds 0xFFFFFFFF)."""

_DTYPES = {
    # training dtype -> (storage class, itemsize, optimizer-file prefix)
    "bf16": ("BFloat16Storage", 2, "bf16_"),
    "fp16": ("HalfStorage", 2, ""),
    "fp32": ("FloatStorage", 4, ""),
}
_DTYPE_ALIASES = {
    "bf16": "bf16",
    "bfloat16": "bf16",
    "fp16": "fp16",
    "float16": "fp16",
    "half": "fp16",
    "fp32": "fp32",
    "float32": "fp32",
    "float": "fp32",
}
_STORAGE_ITEMSIZE = {"FloatStorage": 4, "BFloat16Storage": 2, "HalfStorage": 2, "LongStorage": 8}


# ----------------------------------------------------------------------------------------------
# Values
# ----------------------------------------------------------------------------------------------
# Element i of a param: u = (i * _MULT + K) mod 2**32; its top 23 bits become the mantissa of a
# float in [2**(E-127), 2**(E-126)); subtracting 1.5 * 2**(E-127) (exact, Sterbenz) centres it:
# values in [-2**(E-128), 2**(E-128)), full 23-bit mantissas, negatives, no two params alike.
# K and E come from a hash of (seed, name). Four in-place numpy passes per element.

_MULT = 0x9E3779B1
_BLOCK = 1 << 18  # elements per compute block (stays in cache)
_MUL_TABLE = np.arange(_BLOCK, dtype=np.uint32) * np.uint32(_MULT)


@cache
def _param_key(name: str, seed: int) -> tuple[int, int, np.float32]:
    h = hashlib.blake2b(f"{seed}\0{name}".encode(), digest_size=8).digest()
    k = int.from_bytes(h[:4], "little")
    e = 121 + h[4] % 6
    return k, e, np.float32(1.5 * 2.0 ** (e - 127))


def _fill_fp32(out: np.ndarray, name: str, seed: int, start: int) -> None:
    """Write the fp32 values of `name`, elements [start, start + len(out)), as bits into `out` (uint32)."""
    k, e, centre = _param_key(name, seed)
    ebits = np.uint32(e << 23)
    n = out.shape[0]
    pos = 0
    while pos < n:
        m = min(_BLOCK, n - pos)
        o = out[pos : pos + m]
        np.add(_MUL_TABLE[:m], np.uint32((k + (start + pos) * _MULT) & 0xFFFFFFFF), out=o)
        np.right_shift(o, np.uint32(9), out=o)
        np.bitwise_or(o, ebits, out=o)
        f = o.view(np.float32)
        np.subtract(f, centre, out=f)
        pos += m


def _bf16_bits(src: np.ndarray, dst: np.ndarray, tmp: np.ndarray) -> None:
    """Round-to-nearest-even float32 (as uint32 bits) -> bfloat16 bits (uint16). Finite inputs."""
    np.right_shift(src, np.uint32(16), out=tmp)
    np.bitwise_and(tmp, np.uint32(1), out=tmp)
    np.add(tmp, np.uint32(0x7FFF), out=tmp)
    np.add(tmp, src, out=tmp)
    np.right_shift(tmp, np.uint32(16), out=tmp)
    np.copyto(dst, tmp, casting="unsafe")


def _fill_16bit(
    out16: np.ndarray,
    name: str,
    seed: int,
    start: int,
    dtype: str,
    scratch: np.ndarray,
    tmp: np.ndarray,
) -> None:
    n = out16.shape[0]
    pos = 0
    while pos < n:
        m = min(_BLOCK, n - pos)
        s = scratch[:m]
        _fill_fp32(s, name, seed, start + pos)
        if dtype == "bf16":
            _bf16_bits(s, out16[pos : pos + m], tmp[:m])
        else:  # numpy's float32 -> float16 conversion rounds to nearest even
            np.copyto(
                out16[pos : pos + m].view(np.float16), s.view(np.float32), casting="same_kind"
            )
        pos += m


def expected_fp32(name: str, start: int = 0, count: int = 1, seed: int = 0) -> np.ndarray:
    """The fp32 master values the forge writes for param `name`, flat elements [start, start+count)."""
    out = np.empty(count, np.uint32)
    _fill_fp32(out, name, seed, start)
    return out.view(np.float32)


def expected_16bit(
    name: str, start: int = 0, count: int = 1, dtype: str = "bf16", seed: int = 0
) -> np.ndarray:
    """The 16-bit copy (bit patterns, uint16) of `expected_fp32`: round-to-nearest-even bf16 or fp16."""
    dtype = _norm_dtype(dtype)
    out = np.empty(count, np.uint16)
    scratch = np.empty(min(count, _BLOCK), np.uint32)
    _fill_16bit(out, name, seed, start, dtype, scratch, np.empty_like(scratch))
    return out


def expected_buffer(name: str, shape: Sequence[int], dtype: str, seed: int = 0) -> np.ndarray:
    """A buffer's values: float32 buffers use `expected_fp32`; int64 buffers i * 1000003 + hash."""
    n = math.prod(shape)
    if dtype == "float32":
        return expected_fp32(name, 0, n, seed).reshape(shape)
    if dtype == "int64":
        k = _param_key(name, seed)[0]
        return (np.arange(n, dtype=np.int64) * 1000003 + k).reshape(shape)
    raise ValueError(f"buffer dtype must be float32 or int64, not {dtype!r}")


def to_bf16_bits(values: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even float32 -> bfloat16 bit patterns (uint16)."""
    src = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32).ravel()
    out = np.empty(src.shape, np.uint16)
    _bf16_bits(src, out, np.empty_like(src))
    return out.reshape(np.shape(values))


# ----------------------------------------------------------------------------------------------
# Pickle: nodes that name torch's and DeepSpeed's globals without importing them
# ----------------------------------------------------------------------------------------------


class _Global:
    """A module-level name, written as a GLOBAL opcode."""

    __slots__ = ("module", "qualname")
    _cache: dict[tuple[str, str], _Global] = {}

    def __new__(cls, module: str, qualname: str) -> _Global:
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


class _Reduce:
    """`func(*args)` (REDUCE), then `state` (BUILD) when given."""

    __slots__ = ("func", "args", "state")

    def __init__(self, func: _Global, args: tuple[Any, ...], state: Any = None) -> None:
        self.func, self.args, self.state = func, args, state


class _NewObj:
    """`cls.__new__(cls)` (NEWOBJ) then `__setstate__(state)` (BUILD): how dataclasses and plain
    objects such as DeepSpeed's LossScaler and fragment_address pickle."""

    __slots__ = ("cls", "state")

    def __init__(self, cls: _Global, state: dict[str, Any]) -> None:
        self.cls, self.state = cls, state


_G_REBUILD = _Global("torch._utils", "_rebuild_tensor_v2")
_G_FROM_TYPE = _Global("torch._tensor", "_rebuild_from_type_v2")
_G_TENSOR = _Global("torch", "Tensor")
_G_SIZE = _Global("torch", "Size")
_G_ZERO_STAGE = _Global("deepspeed.runtime.zero.config", "ZeroStageEnum")
_G_LOSS_SCALER = _Global("deepspeed.runtime.fp16.loss_scaler", "LossScaler")
_G_DYN_LOSS_SCALER = _Global("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler")
_G_FRAGMENT = _Global("deepspeed.utils.tensor_fragment", "fragment_address")


class _Storage:
    """A storage record: its class, element count and how to produce its bytes.

    `pieces` is a list of ("vals", name, start, count) (the param's values, cast to the storage
    dtype) and ("zeros", None, 0, count); `raw` gives small contents directly; `hole` marks a
    record of zeros written as a sparse hole. The key is assigned when first pickled."""

    __slots__ = ("cls", "numel", "pieces", "raw", "hole", "key")

    def __init__(
        self,
        cls: str,
        numel: int,
        pieces: list[tuple[str, str | None, int, int]] | None = None,
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
        return _STORAGE_ITEMSIZE[self.cls]

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


def _tensor(
    storage: _Storage,
    shape: Sequence[int],
    offset: int = 0,
    requires_grad: bool = False,
    ds_id: str | None = None,
) -> _Reduce:
    """A tensor as torch pickles it; with `ds_id`, as a ZeRO-3 flat group (a Tensor with a __dict__)."""
    args = (storage, offset, tuple(shape), contiguous_stride(shape), requires_grad, OrderedDict())
    if ds_id is None:
        return _Reduce(_G_REBUILD, args)
    return _Reduce(_G_FROM_TYPE, (_G_REBUILD, _G_TENSOR, args, {"ds_id": ds_id}))


def _view_again(t: _Reduce) -> _Reduce:
    """Another tensor object on the same storage (torch pickles each tensor on its own, and the
    real files hold separate calls for a tied alias or a frozen fragment, not a memo reference)."""
    if t.func is _G_FROM_TYPE:
        func, cls, args, state = t.args
        return _Reduce(_G_FROM_TYPE, (func, cls, args[:5] + (OrderedDict(),), dict(state)))
    return _Reduce(t.func, t.args[:5] + (OrderedDict(),))


def _size(shape: Sequence[int]) -> _Reduce:
    return _Reduce(_G_SIZE, (tuple(shape),))


class _Pickler(pickle._Pickler):  # type: ignore[name-defined,misc]  # pure-Python: extendable dispatch
    dispatch = pickle._Pickler.dispatch.copy()

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=2)
        self.storages: list[_Storage] = []

    def persistent_id(self, obj: Any) -> Any:
        if type(obj) is _Storage:
            if obj.key is None:
                obj.key = str(len(self.storages))
                self.storages.append(obj)
            return ("storage", _Global("torch", obj.cls), obj.key, "cpu", obj.numel)
        return None

    def _save_global_node(self, obj: _Global) -> None:
        self.write(pickle.GLOBAL + f"{obj.module}\n{obj.qualname}\n".encode())
        self.memoize(obj)

    def _save_reduce_node(self, obj: _Reduce) -> None:
        self.save_reduce(obj.func, obj.args, obj.state, obj=obj)

    def _save_newobj_node(self, obj: _NewObj) -> None:
        self.save(obj.cls)
        self.save(())
        self.write(pickle.NEWOBJ)
        self.memoize(obj)
        self.save(obj.state)
        self.write(pickle.BUILD)

    dispatch[_Global] = _save_global_node
    dispatch[_Reduce] = _save_reduce_node
    dispatch[_NewObj] = _save_newobj_node


def _pickle(obj: Any) -> tuple[bytes, list[_Storage]]:
    buf = io.BytesIO()
    p = _Pickler(buf)
    p.dump(obj)
    return buf.getvalue(), p.storages


# ----------------------------------------------------------------------------------------------
# torch's zip container, streamed
# ----------------------------------------------------------------------------------------------


@dataclass
class _Entry:
    name: bytes
    offset: int
    size: int
    zip64: bool
    crc: int = 0
    done: int = 0


class _ZipWriter:
    """Writes a zip the way torch.save lays it out: stored records, data 64-byte aligned (an
    'FB' padding extra field), CRC and sizes in a data descriptor after each record (flag 0x0808),
    then the central directory, a ZIP64 end record and locator, and the end record. Entries or
    offsets at or above `zip64_threshold` get ZIP64 fields. Records are streamed: chunks, or
    holes (sparse zeros), with the CRC combined as they go."""

    def __init__(self, path: str, zip64_threshold: int = ZIP64_LIMIT) -> None:
        self.path = path
        self.thr = zip64_threshold
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self.pos = 0
        self.written = 0
        self.entries: list[_Entry] = []
        self.cur: _Entry | None = None

    def _write(self, data: bytes | memoryview) -> None:
        mv = memoryview(data).cast("B")
        while mv:
            n = os.write(self.fd, mv)
            mv = mv[n:]
            self.pos += n
            self.written += n

    def begin(self, name: str, size: int) -> None:
        assert self.cur is None
        name_b = name.encode()
        zip64 = size >= self.thr
        extra = struct.pack("<HHQQ", 1, 16, 0, 0) if zip64 else b""
        header_len = 30 + len(name_b) + len(extra) + 4
        pad = (-(self.pos + header_len)) % 64
        extra += b"FB" + struct.pack("<H", pad) + b"Z" * pad
        sizes = 0xFFFFFFFF if zip64 else 0
        local = struct.pack(
            "<IHHHHHIIIHH",
            0x04034B50,
            45 if zip64 else 0,
            0x0808,
            0,
            0,
            0,
            0,
            sizes,
            sizes,
            len(name_b),
            len(extra),
        )
        self.cur = _Entry(name_b, self.pos, size, zip64)
        self._write(local + name_b + extra)
        assert self.pos % 64 == 0

    def data(self, chunk: memoryview | bytes, crc: int | None = None) -> None:
        cur = self.cur
        assert cur is not None
        n = memoryview(chunk).nbytes
        if crc is None:
            crc = zlib.crc32(chunk)
        cur.crc = crc32_combine(cur.crc, crc, n) if cur.done else crc
        cur.done += n
        self._write(chunk)

    def hole(self, nbytes: int) -> None:
        """`nbytes` zeros, as a sparse hole (seek past them)."""
        cur = self.cur
        assert cur is not None
        os.lseek(self.fd, nbytes, os.SEEK_CUR)
        self.pos += nbytes
        cur.crc = crc32_zeros(nbytes, cur.crc)
        cur.done += nbytes

    def end(self) -> None:
        cur = self.cur
        assert cur is not None
        if cur.done != cur.size:
            raise RuntimeError(
                f"{self.path}: record {cur.name.decode()} got {cur.done} bytes, expected {cur.size}"
            )
        if cur.zip64:
            dd = struct.pack("<IIQQ", 0x08074B50, cur.crc, cur.size, cur.size)
        else:
            dd = struct.pack("<IIII", 0x08074B50, cur.crc, cur.size, cur.size)
        self._write(dd)
        self.entries.append(cur)
        self.cur = None

    def add(self, name: str, data: bytes) -> None:
        self.begin(name, len(data))
        if data:
            self.data(data)
        self.end()

    def close(self) -> None:
        cd_start = self.pos
        parts = []
        for e in self.entries:
            fields = []
            size32 = e.size
            off32 = e.offset
            if e.size >= self.thr:
                fields += [e.size, e.size]
                size32 = 0xFFFFFFFF
            if e.offset >= self.thr:
                fields.append(e.offset)
                off32 = 0xFFFFFFFF
            extra = (
                struct.pack(f"<HH{len(fields)}Q", 1, 8 * len(fields), *fields) if fields else b""
            )
            parts.append(
                struct.pack(
                    "<IHHHHHHIIIHHHHHII",
                    0x02014B50,
                    0,
                    45 if fields else 0,
                    0x0808,
                    0,
                    0,
                    0,
                    e.crc,
                    size32,
                    size32,
                    len(e.name),
                    len(extra),
                    0,
                    0,
                    0,
                    0,
                    off32,
                )
            )
            parts.append(e.name)
            parts.append(extra)
        self._write(b"".join(parts))
        cd_size = self.pos - cd_start
        n = len(self.entries)
        eocd64 = self.pos
        tail = struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 0x031E, 45, 0, 0, n, n, cd_size, cd_start)
        tail += struct.pack("<IIQI", 0x07064B50, 0, eocd64, 1)
        tail += struct.pack(
            "<IHHHHIIH",
            0x06054B50,
            0,
            0,
            min(n, 0xFFFF),
            min(n, 0xFFFF),
            cd_size if cd_size < self.thr else 0xFFFFFFFF,
            cd_start if cd_start < self.thr else 0xFFFFFFFF,
            0,
        )
        self._write(tail)
        os.close(self.fd)
        self.fd = -1

    def abort(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


# ----------------------------------------------------------------------------------------------
# Chunk pipeline: worker threads fill and CRC chunks (numpy and zlib release the GIL), the caller
# writes them in order; a fixed pool of buffers bounds memory.
# ----------------------------------------------------------------------------------------------


class _Pipeline:
    def __init__(self, chunk_bytes: int, threads: int, seed: int) -> None:
        self.chunk_bytes = max(1 << 16, chunk_bytes - chunk_bytes % 64)
        self.threads = max(1, threads)
        self.seed = seed
        self.nbuf = self.threads + 2
        self.free: list[np.ndarray] = []
        self.allocated = 0
        self.zero: np.ndarray | None = None
        self.local = threading.local()
        self.ex = (
            ThreadPoolExecutor(self.threads, thread_name_prefix="forge")
            if self.threads > 1
            else None
        )

    def close(self) -> None:
        if self.ex is not None:
            self.ex.shutdown()

    def _buffer(self) -> np.ndarray:
        if self.free:
            return self.free.pop()
        self.allocated += 1
        return np.empty(self.chunk_bytes, np.uint8)

    def _scratch(self) -> tuple[np.ndarray, np.ndarray]:
        s = getattr(self.local, "s", None)
        if s is None:
            s = self.local.s = (np.empty(_BLOCK, np.uint32), np.empty(_BLOCK, np.uint32))
        return s

    def _fill(
        self, task: list[tuple[str, str | None, int, int]], buf: np.ndarray, cls: str
    ) -> tuple[np.ndarray, memoryview, int]:
        itemsize = _STORAGE_ITEMSIZE[cls]
        if len(task) == 1 and task[0][0] == "zeros":
            n = task[0][3] * itemsize
            assert self.zero is not None
            return buf, memoryview(self.zero)[:n], crc32_zeros(n)
        pos = 0
        for kind, name, start, count in task:
            region = buf[pos * itemsize : (pos + count) * itemsize]
            if kind == "zeros":
                region.fill(0)
            elif cls == "FloatStorage":
                _fill_fp32(region.view(np.uint32), name, self.seed, start)  # type: ignore[arg-type]
            else:
                scratch, tmp = self._scratch()
                dt = "bf16" if cls == "BFloat16Storage" else "fp16"
                _fill_16bit(region.view(np.uint16), name, self.seed, start, dt, scratch, tmp)  # type: ignore[arg-type]
            pos += count
        mv = memoryview(buf)[: pos * itemsize]
        return buf, mv, zlib.crc32(mv)

    def _tasks(self, st: _Storage) -> Iterator[list[tuple[str, str | None, int, int]]]:
        per_chunk = self.chunk_bytes // st.itemsize
        task: list[tuple[str, str | None, int, int]] = []
        room = per_chunk
        for kind, name, start, count in st.pieces:
            off = 0
            while off < count:
                k = min(room, count - off)
                task.append((kind, name, start + off, k))
                off += k
                room -= k
                if room == 0:
                    yield task
                    task, room = [], per_chunk
        if task:
            yield task

    def write_storage(self, zw: _ZipWriter, name: str, st: _Storage) -> None:
        zw.begin(name, st.nbytes)
        if st.hole:
            if st.nbytes:
                zw.hole(st.nbytes)
        elif st.raw is not None:
            if st.raw:
                zw.data(st.raw)
        else:
            if self.zero is None:
                self.zero = np.zeros(self.chunk_bytes, np.uint8)
            inflight: deque[Future[Any] | tuple[np.ndarray, memoryview, int]] = deque()

            def drain() -> None:
                item = inflight.popleft()
                buf, mv, crc = item.result() if isinstance(item, Future) else item
                zw.data(mv, crc)
                self.free.append(buf)

            for task in self._tasks(st):
                if len(inflight) >= self.nbuf:
                    drain()
                buf = self._buffer()
                if self.ex is None:
                    inflight.append(self._fill(task, buf, st.cls))
                else:
                    inflight.append(self.ex.submit(self._fill, task, buf, st.cls))
            while inflight:
                drain()
        zw.end()


# ----------------------------------------------------------------------------------------------
# Model shapes
# ----------------------------------------------------------------------------------------------


def parse_count(text: str | int | float) -> int:
    """'500M' -> 500_000_000, '7B' -> 7_000_000_000, '1.5e9', 1000 -> 1000."""
    if isinstance(text, (int, float)):
        return int(text)
    m = re.fullmatch(r"\s*([0-9.eE+-]+)\s*([kKmMbBgGtT]?)\s*", text)
    if not m:
        raise ValueError(f"not a count: {text!r}")
    mult = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}[m.group(2).lower()]
    return int(float(m.group(1)) * mult)


def transformer_shapes(
    num_params: int | str | None = None,
    *,
    vocab: int | None = None,
    width: int | None = None,
    layers: int | None = None,
    ffn: int | None = None,
    kv_width: int | None = None,
    qkv_bias: bool = True,
    out_bias: bool = True,
    tied: bool = True,
) -> list[tuple[str, tuple[int, ...]]]:
    """Llama-like param shapes, in module order, with about `num_params` parameters.

    An embedding `embed.weight` [vocab, width]; per layer an attention norm, q/k/v/o projections
    (q/k/v with biases when `qkv_bias`; k/v narrower: grouped-query attention), an MLP norm and a
    gated MLP (gate/up [ffn, width], down [width, ffn]); a final `norm.weight`; and
    `lm_head.weight` [vocab, width] unless `tied` (then forge it with `tied=True`, which records
    `lm_head.weight` as an alias of `embed.weight`), then `lm_head.bias` [vocab] when `out_bias`.
    Sizes are deliberately odd: vocab and ffn are odd, and `lm_head.bias` has an odd element
    count, so ZeRO padding shows up at any world size. Any size given explicitly is kept."""
    n_target = parse_count(num_params) if num_params is not None else None
    if width is None:
        if n_target is None:
            raise ValueError("give num_params or width")
        # ~12 * width**2 per layer, layers ~ width / 128: total ~ 0.094 * width**3
        width = max(64, 64 * round((n_target / 0.09375) ** (1 / 3) / 64))
    if vocab is None:
        if n_target is None or n_target >= 100_000_000:
            vocab = 32003
        else:  # keep the embedding near a tenth of the model
            vocab = max(67, int(n_target * 0.1 / width)) | 1
    if ffn is None:
        ffn = (8 * width // 3) | 1
    if kv_width is None:
        kv_width = width // 4 if width >= 256 else width // 2
    per_layer = (
        2 * width * width
        + 2 * kv_width * width
        + 3 * width * ffn
        + 2 * width
        + (width + 2 * kv_width if qkv_bias else 0)
    )
    fixed = vocab * width * (1 if tied else 2) + width + (vocab if out_bias else 0)
    if layers is None:
        layers = 1 if n_target is None else max(1, round((n_target - fixed) / per_layer))
    shapes: list[tuple[str, tuple[int, ...]]] = [("embed.weight", (vocab, width))]
    for i in range(layers):
        p = f"layers.{i}."
        shapes.append((p + "attn_norm.weight", (width,)))
        for proj, out in (("q_proj", width), ("k_proj", kv_width), ("v_proj", kv_width)):
            shapes.append((f"{p}attn.{proj}.weight", (out, width)))
            if qkv_bias:
                shapes.append((f"{p}attn.{proj}.bias", (out,)))
        shapes.append((p + "attn.o_proj.weight", (width, width)))
        shapes.append((p + "mlp_norm.weight", (width,)))
        shapes.append((p + "mlp.gate_proj.weight", (ffn, width)))
        shapes.append((p + "mlp.up_proj.weight", (ffn, width)))
        shapes.append((p + "mlp.down_proj.weight", (width, ffn)))
    shapes.append(("norm.weight", (width,)))
    if not tied:
        shapes.append(("lm_head.weight", (vocab, width)))
    if out_bias:
        shapes.append(("lm_head.bias", (vocab,)))
    return shapes


DEFAULT_BUFFERS: tuple[tuple[str, tuple[int, ...], str], ...] = (
    ("rotary.inv_freq", (37,), "float32"),
    ("position_ids", (1, 129), "int64"),
)


# ----------------------------------------------------------------------------------------------
# Layout and file contents
# ----------------------------------------------------------------------------------------------


@dataclass
class _Param:
    name: str
    shape: tuple[int, ...]
    index: int  # module order among all params (DeepSpeed's ds_id)
    frozen: bool
    group: int = -1

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class ForgeInfo:
    """What `forge_checkpoint` wrote."""

    dest: str
    tag: str
    stage: int
    world_size: int
    dtype: str
    seed: int
    params: dict[str, tuple[int, ...]]
    """Every param (trainable and frozen) in module order, aliases excluded."""
    frozen: list[str]
    buffers: dict[str, tuple[tuple[int, ...], str]]
    aliases: dict[str, str]
    param_groups: list[list[str]]
    flat_groups: list[list[str]]
    """ZeRO-2: the optimizer groups; ZeRO-3: the flat sub-groups (what param_shapes lists)."""
    files: list[dict[str, Any]] = field(default_factory=list)
    fp32_bytes: int = 0
    """Bytes of fp32 master weights (all ranks, padding included)."""
    lowp_bytes: int = 0
    moment_bytes: int = 0
    apparent_bytes: int = 0
    written_bytes: int = 0
    seconds: float = 0.0
    peak_buffers: int = 0

    @property
    def gbps(self) -> float:
        """Bytes written (holes excluded) per second, in GB/s."""
        return self.written_bytes / max(self.seconds, 1e-9) / 1e9

    def summary(self) -> str:
        n = sum(math.prod(s) for s in self.params.values())
        lines = [
            f"forged ZeRO-{self.stage} {self.dtype} ws={self.world_size} tag={self.tag}: {n:,} params "
            f"({len(self.params)} tensors, {len(self.frozen)} frozen, aliases {self.aliases or 'none'})"
        ]
        for f in self.files:
            lines.append(
                f"  {os.path.basename(f['path']):60s} {f['apparent_bytes'] / 1e9:9.3f} GB"
                f"  (written {f['written_bytes'] / 1e9:.3f} GB)"
            )
        lines.append(
            f"fp32 masters {self.fp32_bytes / 1e9:.3f} GB, 16-bit {self.lowp_bytes / 1e9:.3f} GB, "
            f"moments {self.moment_bytes / 1e9:.3f} GB; apparent {self.apparent_bytes / 1e9:.3f} GB, "
            f"written {self.written_bytes / 1e9:.3f} GB in {self.seconds:.2f} s = {self.gbps:.2f} GB/s "
            f"({self.apparent_bytes / max(self.seconds, 1e-9) / 1e9:.2f} GB/s apparent)"
        )
        return "\n".join(lines)


def _norm_dtype(dtype: str) -> str:
    try:
        return _DTYPE_ALIASES[dtype.lower()]
    except KeyError:
        raise ValueError(f"dtype must be bf16, fp16 or fp32, not {dtype!r}") from None


def _module_metadata(names: Sequence[str]) -> OrderedDict[str, dict[str, int]]:
    meta: OrderedDict[str, dict[str, int]] = OrderedDict()
    meta[""] = {"version": 1}
    for name in names:
        parts = name.split(".")[:-1]
        for i in range(1, len(parts) + 1):
            prefix = ".".join(parts[:i])
            if prefix not in meta:
                meta[prefix] = {"version": 1}
    return meta


class _Spec:
    """The model and run settings, and everything derived from them."""

    def __init__(
        self,
        shapes: Sequence[tuple[str, Sequence[int]]],
        stage: int,
        world_size: int,
        dtype: str,
        tag: str,
        sub_group_numel: int | None,
        tied: bool | Mapping[str, str],
        frozen: Sequence[str],
        groups: int,
        buffers: Sequence[tuple[str, Sequence[int], str]] | None,
        seed: int,
        ds_config: dict[str, Any] | None,
        global_steps: int | None,
        skipped_steps: int,
        micro_batch: int,
        lr: float,
        betas: tuple[float, float],
        eps: float,
        weight_decay: tuple[float, float],
    ) -> None:
        if stage not in (1, 2, 3):
            raise ValueError(f"stage must be 1, 2 or 3, not {stage}")
        if world_size < 1:
            raise ValueError("world_size must be >= 1")
        self.stage, self.ws, self.dtype, self.tag, self.seed = (
            stage,
            world_size,
            _norm_dtype(dtype),
            tag,
            seed,
        )
        self.lowp_cls, self.lowp_itemsize, self.prefix = _DTYPES[self.dtype]
        names = [n for n, _ in shapes]
        if len(set(names)) != len(names):
            raise ValueError("duplicate param names")
        frozen_set = set(frozen)
        if not frozen_set <= set(names):
            raise ValueError(
                f"frozen names not among the params: {sorted(frozen_set - set(names))}"
            )
        self.params = [
            _Param(n, tuple(int(d) for d in s), i, n in frozen_set)
            for i, (n, s) in enumerate(shapes)
        ]
        self.by_name = {p.name: p for p in self.params}
        if tied is True:
            tied = {"lm_head.weight": "embed.weight"}
        self.aliases: dict[str, str] = dict(tied) if tied else {}
        for alias, target in self.aliases.items():
            if alias in self.by_name:
                raise ValueError(
                    f"tied alias {alias!r} is also a real param (use transformer_shapes(tied=True))"
                )
            if target not in self.by_name or self.by_name[target].frozen:
                raise ValueError(f"tied target {target!r} is not a trainable param")
        # module (state_dict) order: an alias sits before the first param of its own module
        # (lm_head.weight before lm_head.bias), else at the end
        self.module_order = [p.name for p in self.params]
        for alias in self.aliases:
            owner = alias.rsplit(".", 1)[0] + "."
            at = next(
                (i for i, n in enumerate(self.module_order) if n.startswith(owner)),
                len(self.module_order),
            )
            self.module_order.insert(at, alias)
        self.buffers = [
            (n, tuple(s), dt) for n, s, dt in (DEFAULT_BUFFERS if buffers is None else buffers)
        ]
        trainable = [p for p in self.params if not p.frozen]
        if not trainable:
            raise ValueError("no trainable params")
        if groups == 1:
            self.groups = [trainable]
        elif (
            groups == 2
        ):  # matrices (with weight decay), then vectors (without): DeepSpeed's usual split
            self.groups = [
                g
                for g in (
                    [p for p in trainable if len(p.shape) >= 2],
                    [p for p in trainable if len(p.shape) < 2],
                )
                if g
            ]
        else:
            raise ValueError("groups must be 1 or 2")
        for gi, g in enumerate(self.groups):
            for p in g:
                p.group = gi
        self.weight_decay = weight_decay if len(self.groups) == 2 else (weight_decay[0],)
        self.frozen = [p for p in self.params if p.frozen]
        # ZeRO-3 flat sub-groups: within each optimizer group, close a sub-group once its params'
        # per-rank pieces (ceil(numel / ws) each) add up to sub_group_numel (DeepSpeed's
        # sub_group_size, default 1e9), as the real fixtures show
        self.sub_group_numel = int(sub_group_numel) if sub_group_numel else 1_000_000_000
        self.sub_groups: list[list[_Param]] = []
        self.sub_group_owner: list[int] = []
        for gi, g in enumerate(self.groups):
            cur: list[_Param] = []
            total = 0
            for p in g:
                cur.append(p)
                total += -(-p.numel // self.ws)
                if total >= self.sub_group_numel:
                    self.sub_groups.append(cur)
                    self.sub_group_owner.append(gi)
                    cur, total = [], 0
            if cur:
                self.sub_groups.append(cur)
                self.sub_group_owner.append(gi)
        m = re.fullmatch(r"global_step(\d+)", tag)
        self.global_steps = (
            global_steps if global_steps is not None else (int(m.group(1)) if m else 1)
        )
        self.skipped_steps = skipped_steps
        self.micro_batch = micro_batch
        self.lr, self.betas, self.eps = lr, betas, eps
        self.ds_config = ds_config if ds_config is not None else self._default_ds_config()

    # -- shared pieces --------------------------------------------------------------------------
    def _default_ds_config(self) -> dict[str, Any]:
        zero: dict[str, Any] = {"stage": self.stage}
        if self.stage == 3:
            zero["sub_group_size"] = self.sub_group_numel
            zero["stage3_param_persistence_threshold"] = 0
        cfg: dict[str, Any] = {
            "train_micro_batch_size_per_gpu": self.micro_batch,
            "gradient_accumulation_steps": 1,
            "steps_per_print": 100000,
            "gradient_clipping": 1.0,
            "zero_optimization": zero,
            "optimizer": {
                "type": "AdamW",
                "params": {
                    "lr": self.lr,
                    "betas": list(self.betas),
                    "eps": self.eps,
                    "weight_decay": self.weight_decay[0],
                    "torch_adam": True,
                },
            },
        }
        if self.dtype == "bf16":
            cfg["bf16"] = {"enabled": True}
        elif self.dtype == "fp16":
            cfg["fp16"] = {
                "enabled": True,
                "loss_scale": 0,
                "initial_scale_power": 16,
                "loss_scale_window": 1000,
                "hysteresis": 2,
                "min_loss_scale": 1,
            }
        return cfg

    def loss_scaler(self) -> _NewObj:
        if self.dtype != "fp16":
            return _NewObj(_G_LOSS_SCALER, {"cur_scale": 1.0, "dynamic": False})
        fp16 = self.ds_config.get("fp16", {})
        return _NewObj(
            _G_DYN_LOSS_SCALER,
            {
                "cur_scale": float(2 ** fp16.get("initial_scale_power", 16)),
                "dynamic": True,
                "cur_iter": self.global_steps,
                "last_overflow_iter": -1,
                "scale_factor": 2.0,
                "scale_window": fp16.get("loss_scale_window", 1000),
                "min_scale": fp16.get("min_loss_scale", 1),
                "delayed_shift": fp16.get("hysteresis", 2),
                "cur_hysteresis": fp16.get("hysteresis", 2),
                "consecutive_hysteresis": False,
                "raise_error_at_min_scale": True,
                "dtype": _Global("torch", "float16"),
            },
        )

    def param_group_dict(self, gi: int, params: list[int]) -> dict[str, Any]:
        # with client param groups (2 groups) torch keeps the client's key first; otherwise AdamW's order
        d: dict[str, Any] = {"weight_decay": self.weight_decay[gi]} if len(self.groups) > 1 else {}
        d.update(
            {
                "lr": self.lr,
                "betas": tuple(self.betas),
                "eps": self.eps,
                "weight_decay": self.weight_decay[gi],
                "amsgrad": False,
                "maximize": False,
                "foreach": None,
                "capturable": False,
                "differentiable": False,
                "fused": None,
                "decoupled_weight_decay": True,
                "params": params,
            }
        )
        return d

    def adam_state(self, numel: int, moments: str) -> dict[str, Any]:
        step = struct.pack("<f", float(self.global_steps - self.skipped_steps))
        return {
            "step": _tensor(_Storage("FloatStorage", 1, raw=step), ()),
            "exp_avg": _tensor(self._moment(numel, moments), (numel,)),
            "exp_avg_sq": _tensor(self._moment(numel, moments), (numel,)),
        }

    @staticmethod
    def _moment(numel: int, moments: str) -> _Storage:
        if moments == "sparse":
            return _Storage("FloatStorage", numel, hole=True)
        return _Storage("FloatStorage", numel, pieces=[("zeros", None, 0, numel)] if numel else [])

    def buffer_tensors(self) -> list[tuple[str, _Reduce]]:
        out = []
        for name, shape, dt in self.buffers:
            data = expected_buffer(name, shape, dt, self.seed)
            cls = "FloatStorage" if dt == "float32" else "LongStorage"
            out.append(
                (
                    name,
                    _tensor(
                        _Storage(
                            cls, data.size, raw=data.astype(data.dtype.newbyteorder("<")).tobytes()
                        ),
                        shape,
                    ),
                )
            )
        return out

    def lowp_storage(self, pieces: list[tuple[str, str | None, int, int]], numel: int) -> _Storage:
        return _Storage(self.lowp_cls, numel, pieces=pieces)

    def module_dict(self, param_tensors: Mapping[str, _Reduce]) -> OrderedDict[str, Any]:
        module: OrderedDict[str, Any] = OrderedDict()
        for name, t in self.buffer_tensors():
            module[name] = t
        for name in self.module_order:
            module[name] = param_tensors[name]
        module._metadata = _module_metadata([b[0] for b in self.buffers] + self.module_order)  # type: ignore[attr-defined]
        return module

    def model_states(
        self,
        module: OrderedDict[str, Any],
        param_shapes: list[OrderedDict[str, Any]],
        frozen_fragments: OrderedDict[str, Any],
        rank: int,
    ) -> dict[str, Any]:
        frozen_shapes: OrderedDict[str, Any] | None = OrderedDict(
            (p.name, _size(p.shape)) for p in self.frozen
        )
        if (
            self.stage == 1
        ):  # DeepSpeed saves frozen params' shapes and fragments only from stage 2 on
            frozen_shapes = frozen_fragments = None  # type: ignore[assignment]
        return {
            "module": module,
            "buffer_names": [b[0] for b in self.buffers],
            "optimizer": None,
            "param_shapes": param_shapes,
            "frozen_param_shapes": frozen_shapes,
            "shared_params": dict(self.aliases) if rank == 0 else {},
            "frozen_param_fragments": frozen_fragments,
            "lr_scheduler": None,
            "data_sampler": None,
            "random_ltd": None,
            "skipped_steps": self.skipped_steps,
            "global_steps": self.global_steps,
            "global_samples": self.global_steps * self.micro_batch * self.ws,
            "dp_world_size": self.ws,
            "mp_world_size": 1,
            "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1},
            "ds_config": self.ds_config,
            "ds_version": DS_VERSION,
        }

    # -- ZeRO-1/2 -------------------------------------------------------------------------------
    def zero2_layout(self) -> list[dict[str, Any]]:
        """Per optimizer group: params with their flat offsets, padded size, partition size, padding."""
        out = []
        align = 2 * self.ws
        for g in self.groups:
            offsets = []
            total = 0
            for p in g:
                offsets.append(total)
                total += p.numel
            padded = -(-total // align) * align
            part = padded // self.ws
            pad = padded - total
            if pad >= part:
                raise ValueError(
                    f"an optimizer group of {total} elements is too small for world size {self.ws}: "
                    f"its padding ({pad}) would cover the last rank's whole partition ({part})"
                )
            out.append(
                {
                    "params": g,
                    "offsets": offsets,
                    "total": total,
                    "padded": padded,
                    "part": part,
                    "pad": pad,
                }
            )
        return out

    def zero2_files(self, moments: str) -> list[tuple[str, dict[str, Any]]]:
        layout = self.zero2_layout()
        files = []
        # model states: the full 16-bit (training dtype) weights, as views into per-group flat storages
        tensors: dict[str, _Reduce] = {}
        for lay in layout:
            pieces: list[tuple[str, str | None, int, int]] = [
                ("vals", p.name, 0, p.numel) for p in lay["params"]
            ]
            if lay["pad"]:
                pieces.append(("zeros", None, 0, lay["pad"]))
            st = self.lowp_storage(pieces, lay["padded"])
            for p, off in zip(lay["params"], lay["offsets"], strict=True):
                tensors[p.name] = _tensor(st, p.shape, off)
        frozen_fragments: OrderedDict[str, Any] = OrderedDict()
        for p in self.frozen:
            t = _tensor(self.lowp_storage([("vals", p.name, 0, p.numel)], p.numel), p.shape)
            tensors[p.name] = t
            frozen_fragments[p.name] = _view_again(t)
        for alias, target in self.aliases.items():
            tensors[alias] = _view_again(tensors[target])
        param_shapes = [
            OrderedDict((p.name, _size(p.shape)) for p in lay["params"]) for lay in layout
        ]
        files.append(
            (
                "mp_rank_00_model_states.pt",
                self.model_states(self.module_dict(tensors), param_shapes, frozen_fragments, 0),
            )
        )
        for r in range(self.ws):
            state: dict[int, Any] = {}
            partitions = []
            paddings = []
            mappings = []
            for gi, lay in enumerate(layout):
                part = lay["part"]
                lo_r, hi_r = r * part, (r + 1) * part
                pieces = []
                mapping: OrderedDict[str, Any] = OrderedDict()
                for p, off in zip(lay["params"], lay["offsets"], strict=True):
                    lo, hi = max(off, lo_r), min(off + p.numel, hi_r)
                    if lo < hi:
                        pieces.append(("vals", p.name, lo - off, hi - lo))
                        mapping[p.name] = _NewObj(
                            _G_FRAGMENT, {"numel": hi - lo, "start": lo - lo_r}
                        )
                tail = hi_r - max(lay["total"], lo_r)
                if tail > 0:
                    pieces.append(("zeros", None, 0, tail))
                pad = lay["pad"] if r == self.ws - 1 else 0
                state[gi] = self.adam_state(part, moments)
                partitions.append(
                    _tensor(
                        _Storage("FloatStorage", part, pieces=pieces),
                        (part - pad,),
                        requires_grad=True,
                    )
                )
                paddings.append(pad)
                mappings.append(mapping)
            osd = {
                "loss_scaler": self.loss_scaler(),
                "dynamic_loss_scale": self.dtype == "fp16",
                "overflow": False,
                "clip_grad": float(self.ds_config.get("gradient_clipping", 1.0)),
                "base_optimizer_state": {
                    "state": state,
                    "param_groups": [self.param_group_dict(gi, [gi]) for gi in range(len(layout))],
                },
                "single_partition_of_fp32_groups": partitions,
                "zero_stage": _Reduce(_G_ZERO_STAGE, (self.stage,)),
                "group_paddings": paddings,
                "param_alignment_paddings": [[0] * len(lay["params"]) for lay in layout],
                "partition_count": [self.ws] * len(layout),
                "ds_version": DS_VERSION,
                "param_slice_mappings": mappings,
            }
            files.append(
                (
                    f"{self.prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt",
                    {
                        "optimizer_state_dict": osd,
                        "ds_config": self.ds_config,
                        "ds_version": DS_VERSION,
                    },
                )
            )
        return files

    # -- ZeRO-3 ---------------------------------------------------------------------------------
    def _z3_pieces(self, p: _Param, r: int) -> list[tuple[str, str | None, int, int]]:
        c = -(-p.numel // self.ws)
        lo, hi = min(p.numel, r * c), min(p.numel, (r + 1) * c)
        pieces: list[tuple[str, str | None, int, int]] = []
        if hi > lo:
            pieces.append(("vals", p.name, lo, hi - lo))
        if c - (hi - lo):
            pieces.append(("zeros", None, 0, c - (hi - lo)))
        return pieces

    def zero3_files(self, moments: str) -> list[tuple[str, dict[str, Any]]]:
        files = []
        param_shapes_proto = [[(p.name, p.shape) for p in sg] for sg in self.sub_groups]
        for r in range(self.ws):
            tensors: dict[str, _Reduce] = {}
            for p in self.params:
                tensors[p.name] = _tensor(_Storage(self.lowp_cls, 0, pieces=[]), (0,))
            for alias, target in self.aliases.items():
                tensors[alias] = _view_again(tensors[target])
            frozen_fragments: OrderedDict[str, Any] = OrderedDict()
            for p in self.frozen:
                c = -(-p.numel // self.ws)
                frozen_fragments[p.name] = _tensor(
                    self.lowp_storage(self._z3_pieces(p, r), c), (c,)
                )
            param_shapes = [OrderedDict((n, _size(s)) for n, s in sg) for sg in param_shapes_proto]
            files.append(
                (
                    f"zero_pp_rank_{r}_mp_rank_00_model_states.pt",
                    self.model_states(self.module_dict(tensors), param_shapes, frozen_fragments, r),
                )
            )
        for r in range(self.ws):
            state: dict[int, Any] = {}
            flat = []
            for si, sg in enumerate(self.sub_groups):
                pieces = [pc for p in sg for pc in self._z3_pieces(p, r)]
                numel = sum(-(-p.numel // self.ws) for p in sg)
                state[si] = self.adam_state(numel, moments)
                flat.append(
                    _tensor(
                        _Storage("FloatStorage", numel, pieces=pieces),
                        (numel,),
                        requires_grad=True,
                        ds_id=f"{sg[0].index}_{sg[-1].index}",
                    )
                )
            groups = [
                [si for si, owner in enumerate(self.sub_group_owner) if owner == gi]
                for gi in range(len(self.groups))
            ]
            osd = {
                "zero_stage": _Reduce(_G_ZERO_STAGE, (3,)),
                "loss_scaler": self.loss_scaler(),
                "dynamic_loss_scale": self.dtype == "fp16",
                "overflow": False,
                "partition_count": self.ws,
                "optimizer_state_dict": {
                    "state": state,
                    "param_groups": [self.param_group_dict(gi, g) for gi, g in enumerate(groups)],
                },
                "fp32_flat_groups": flat,
            }
            files.append(
                (
                    f"{self.prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt",
                    {
                        "optimizer_state_dict": osd,
                        "ds_config": self.ds_config,
                        "ds_version": DS_VERSION,
                    },
                )
            )
        return files


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
    pipeline: _Pipeline | None = None,
    seed: int = 0,
    zip64_threshold: int = ZIP64_LIMIT,
) -> dict[str, Any]:
    """Write `obj` (built from this module's nodes) as a torch.save-style zip at `path`, streaming
    the storages' contents. Written to a temporary name and renamed when complete."""
    data_pkl, storages = _pickle(obj)
    archive = os.path.splitext(os.path.basename(path))[0]
    own = pipeline is None
    pipe = pipeline or _Pipeline(8 << 20, 1, seed)
    tmp = os.path.join(os.path.dirname(path) or ".", f".{os.path.basename(path)}.tmp")
    zw = _ZipWriter(tmp, zip64_threshold)
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


def forge_checkpoint(
    dest: str | os.PathLike[str],
    *,
    shapes: Sequence[tuple[str, Sequence[int]]],
    stage: int,
    world_size: int,
    dtype: str = "bf16",
    tag: str = "global_step1",
    sub_group_numel: int | None = None,
    tied: bool | Mapping[str, str] = True,
    frozen: Sequence[str] = (),
    groups: int = 2,
    buffers: Sequence[tuple[str, Sequence[int], str]] | None = None,
    seed: int = 0,
    moments: str = "sparse",
    chunk_bytes: int = 8 << 20,
    threads: int | None = None,
    zip64_threshold: int = ZIP64_LIMIT,
    ds_config: dict[str, Any] | None = None,
    global_steps: int | None = None,
    skipped_steps: int = 0,
    micro_batch: int = 1,
    lr: float = 3e-4,
    betas: tuple[float, float] = (0.9, 0.95),
    eps: float = 1e-8,
    weight_decay: tuple[float, float] = (0.1, 0.0),
    write_latest: bool = True,
) -> ForgeInfo:
    """Write a DeepSpeed 0.19.8 ZeRO checkpoint of `shapes` into `dest` (`dest/latest`, `dest/<tag>/`).

    Args:
        shapes: (name, shape) of every param in module order (see `transformer_shapes`).
        stage: 1, 2 or 3 (1 and 2 differ only in `zero_stage`).
        world_size: data-parallel ranks (any, odd included).
        dtype: training precision: "bf16", "fp16" or "fp32" (the module / frozen copies' dtype,
            the `bf16_` file prefix, the loss scaler).
        sub_group_numel: ZeRO-3 `sub_group_size`: an optimizer group's params are cut into flat
            sub-groups, each closed once it holds at least this many elements per rank
            (None: DeepSpeed's default, 1e9).
        tied: True records `lm_head.weight` as an alias of `embed.weight` (`shared_params`);
            a dict gives {alias: target}; False: none.
        frozen: names of params with requires_grad=False (saved in the training dtype only).
        groups: 2 optimizer groups (matrices with weight decay, vectors without) or 1.
        buffers: (name, shape, "float32" | "int64") module buffers; default: one of each.
        seed: changes every value (see `expected_fp32`).
        moments: "sparse" (Adam moments as holes: zeros that take no disk) or "zeros" (written).
        chunk_bytes: bytes per write; memory stays near (threads + 2) * chunk_bytes.
        threads: workers filling chunks (default: up to 8, by CPU count).
        zip64_threshold: sizes/offsets at or above it get ZIP64 fields (lower it to test ZIP64).
        ds_config, global_steps, skipped_steps, micro_batch, lr, betas, eps, weight_decay:
            bookkeeping copied into the files.
    """
    if moments not in ("sparse", "zeros"):
        raise ValueError("moments must be 'sparse' or 'zeros'")
    spec = _Spec(
        shapes,
        stage,
        world_size,
        dtype,
        tag,
        sub_group_numel,
        tied,
        frozen,
        groups,
        buffers,
        seed,
        ds_config,
        global_steps,
        skipped_steps,
        micro_batch,
        lr,
        betas,
        eps,
        weight_decay,
    )
    dest = os.fspath(dest)
    tag_dir = os.path.join(dest, tag)
    os.makedirs(tag_dir, exist_ok=True)
    threads = threads if threads is not None else max(1, min(8, os.cpu_count() or 1))
    info = ForgeInfo(
        dest=dest,
        tag=tag,
        stage=stage,
        world_size=world_size,
        dtype=spec.dtype,
        seed=seed,
        params={p.name: p.shape for p in spec.params},
        frozen=[p.name for p in spec.frozen],
        buffers={n: (s, dt) for n, s, dt in spec.buffers},
        aliases=dict(spec.aliases),
        param_groups=[[p.name for p in g] for g in spec.groups],
        flat_groups=[[p.name for p in g] for g in (spec.sub_groups if stage == 3 else spec.groups)],
    )
    started = time.perf_counter()
    pipe = _Pipeline(chunk_bytes, threads, seed)
    try:
        file_objs = spec.zero3_files(moments) if stage == 3 else spec.zero2_files(moments)
        for fname, obj in file_objs:
            rec = write_torch_file(
                os.path.join(tag_dir, fname),
                obj,
                pipeline=pipe,
                seed=seed,
                zip64_threshold=zip64_threshold,
            )
            rec.pop("storages")
            info.files.append(rec)
            info.apparent_bytes += rec["apparent_bytes"]
            info.written_bytes += rec["written_bytes"]
    finally:
        pipe.close()
    info.peak_buffers = pipe.allocated
    # byte accounting from the layout (independent of how the moments were written)
    fp32 = lowp = 0
    if stage == 3:
        per_rank = sum(-(-p.numel // world_size) for sg in spec.sub_groups for p in sg)
        fp32 = per_rank * world_size * 4
        lowp = sum(-(-p.numel // world_size) for p in spec.frozen) * world_size * spec.lowp_itemsize
    else:
        lay = spec.zero2_layout()
        fp32 = sum(g["padded"] for g in lay) * 4
        lowp = (
            sum(g["padded"] for g in lay) + sum(p.numel for p in spec.frozen)
        ) * spec.lowp_itemsize
    info.fp32_bytes, info.lowp_bytes, info.moment_bytes = fp32, lowp, 2 * fp32
    if write_latest:
        with open(os.path.join(dest, "latest"), "w") as fh:
            fh.write(tag)
    info.seconds = time.perf_counter() - started
    return info


def expected_state(info: ForgeInfo, name: str) -> np.ndarray:
    """The full fp32 value of a param (or alias) of a forged checkpoint, shaped."""
    target = info.aliases.get(name, name)
    shape = info.params[target]
    return expected_fp32(target, 0, math.prod(shape), info.seed).reshape(shape)


# ----------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Forge a synthetic DeepSpeed 0.19.8 ZeRO checkpoint.")
    ap.add_argument("dest")
    ap.add_argument("--params", default="100M", help="approximate param count: 500M, 7B, ...")
    ap.add_argument("--stage", type=int, default=3, choices=(1, 2, 3))
    ap.add_argument("--world-size", type=int, default=8)
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    ap.add_argument("--tag", default="global_step1")
    ap.add_argument("--vocab", type=int)
    ap.add_argument("--width", type=int)
    ap.add_argument("--layers", type=int)
    ap.add_argument(
        "--sub-group", type=parse_count, default=None, help="ZeRO-3 sub_group_size (elements)"
    )
    ap.add_argument(
        "--no-tied", action="store_true", help="a separate lm_head.weight instead of a tied alias"
    )
    ap.add_argument("--freeze", action="append", default=[], help="freeze this param (repeatable)")
    ap.add_argument("--groups", type=int, default=2, choices=(1, 2))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--moments", default="sparse", choices=("sparse", "zeros"))
    ap.add_argument("--chunk-mb", type=float, default=8)
    ap.add_argument("--threads", type=int)
    ap.add_argument("--fsync", action="store_true", help="fsync every file before timing stops")
    args = ap.parse_args(argv)
    shapes = transformer_shapes(
        args.params, vocab=args.vocab, width=args.width, layers=args.layers, tied=not args.no_tied
    )
    info = forge_checkpoint(
        args.dest,
        shapes=shapes,
        stage=args.stage,
        world_size=args.world_size,
        dtype=args.dtype,
        tag=args.tag,
        sub_group_numel=args.sub_group,
        tied=not args.no_tied,
        frozen=args.freeze,
        groups=args.groups,
        seed=args.seed,
        moments=args.moments,
        chunk_bytes=int(args.chunk_mb * (1 << 20)),
        threads=args.threads,
    )
    if args.fsync:
        t = time.perf_counter()
        for f in info.files:
            fd = os.open(f["path"], os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
        info.seconds += time.perf_counter() - t
    print(info.summary())
    if sys.platform.startswith("linux"):
        import resource

        print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
