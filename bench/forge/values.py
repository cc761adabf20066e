"""The forge's values: every element a cheap function of (param name, element index, seed).

`expected_fp32`, `expected_16bit` and `expected_buffer` give any range of any output, so a test
checks a conversion without a golden copy; the pipeline fills storages with the same functions.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from functools import cache

import numpy as np

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


# Element i of a param: u = (i * _MULT + K) mod 2**32; its top 23 bits become the mantissa of a
# float in [2**(E-127), 2**(E-126)); subtracting 1.5 * 2**(E-127) (exact, Sterbenz) centres it:
# values in [-2**(E-128), 2**(E-128)), full 23-bit mantissas, negatives, no two params alike.
# K and E come from a hash of (seed, name). Four in-place numpy passes per element.

_MULT = 0x9E3779B1
BLOCK = 1 << 18  # elements per compute block (stays in cache)
_MUL_TABLE = np.arange(BLOCK, dtype=np.uint32) * np.uint32(_MULT)


@cache
def _param_key(name: str, seed: int) -> tuple[int, int, np.float32]:
    h = hashlib.blake2b(f"{seed}\0{name}".encode(), digest_size=8).digest()
    k = int.from_bytes(h[:4], "little")
    e = 121 + h[4] % 6
    return k, e, np.float32(1.5 * 2.0 ** (e - 127))


def fill_fp32(out: np.ndarray, name: str, seed: int, start: int) -> None:
    """Write the fp32 values of `name`, elements [start, start + len(out)), as bits into `out` (uint32)."""
    k, e, centre = _param_key(name, seed)
    ebits = np.uint32(e << 23)
    n = out.shape[0]
    pos = 0
    while pos < n:
        m = min(BLOCK, n - pos)
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


def fill_16bit(
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
        m = min(BLOCK, n - pos)
        s = scratch[:m]
        fill_fp32(s, name, seed, start + pos)
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
    fill_fp32(out, name, seed, start)
    return out.view(np.float32)


def expected_16bit(
    name: str, start: int = 0, count: int = 1, dtype: str = "bf16", seed: int = 0
) -> np.ndarray:
    """The 16-bit copy (bit patterns, uint16) of `expected_fp32`: round-to-nearest-even bf16 or fp16."""
    dtype = norm_dtype(dtype)
    out = np.empty(count, np.uint16)
    scratch = np.empty(min(count, BLOCK), np.uint32)
    fill_16bit(out, name, seed, start, dtype, scratch, np.empty_like(scratch))
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


def norm_dtype(dtype: str) -> str:
    try:
        return _DTYPE_ALIASES[dtype.lower()]
    except KeyError:
        raise ValueError(f"dtype must be bf16, fp16 or fp32, not {dtype!r}") from None
