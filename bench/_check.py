"""Check a converted output folder against the forge's deterministic values, streaming.

Every tensor the forged model has must be there with the right dtype and shape, and its bytes
must equal the forge's fp32 values cast the way the output dtype asks: bfloat16 and float16 as
round-to-nearest-even casts (`expected_16bit`), float32 bit for bit. `full` compares every
element; `sample` compares three windows (start, middle, end) and a few random ones per tensor.
Memory stays bounded: each tensor is compared in blocks of `_BLOCK` elements.
"""

from __future__ import annotations

import json
import math
import os
import random
import struct
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from bench.forge.values import expected_16bit, expected_buffer, expected_fp32

__all__ = ["check_output"]

_BLOCK = 4 * 2**20
_SAMPLE = 1 << 16
_ST_DTYPES = {
    "BF16": ("bfloat16", 2),
    "F16": ("float16", 2),
    "F32": ("float32", 4),
    "I64": ("int64", 8),
}
_OUT = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def _headers(out_dir: str) -> dict[str, tuple[str, dict[str, Any], int]]:
    """name -> (file path, header entry, data start) over every safetensors file of the output."""
    index = os.path.join(out_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    out: dict[str, tuple[str, dict[str, Any], int]] = {}
    for name in files:
        path = os.path.join(out_dir, name)
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        header.pop("__metadata__", None)
        for tensor, entry in header.items():
            out[tensor] = (path, entry, 8 + n)
    return out


def _expected(
    kind: str, name: str, start: int, count: int, out_dtype: str, seed: int, buffer: Any
) -> np.ndarray:
    """The expected raw values (as unsigned ints of the output's item size)."""
    if kind == "int64":
        return expected_buffer(name, buffer[0], "int64", seed).ravel()[start : start + count]
    if out_dtype == "float32":
        return expected_fp32(name, start, count, seed).view(np.uint32)
    dt = "bf16" if out_dtype == "bfloat16" else "fp16"
    return expected_16bit(name, start, count, dt, seed)


def _windows(numel: int, mode: str, rng: random.Random) -> list[tuple[int, int]]:
    if mode == "full" or numel <= 4 * _SAMPLE:
        return [(s, min(_BLOCK, numel - s)) for s in range(0, numel, _BLOCK)]
    starts = {0, numel // 2 - _SAMPLE // 2, numel - _SAMPLE}
    starts |= {rng.randrange(0, numel - _SAMPLE) for _ in range(3)}
    return [(s, _SAMPLE) for s in sorted(starts)]


def check_output(
    out_dir: str,
    *,
    params: dict[str, tuple[int, ...]],
    buffers: dict[str, tuple[tuple[int, ...], str]],
    seed: int,
    out_dtype: str = "bf16",
    mode: str = "full",
    threads: int = 2,
) -> dict[str, Any]:
    """Compare an output folder with the forge's values.

    Args:
        params: name -> shape of every param (the forge's `ForgeInfo.params`); forged without
            tied aliases, so every param is a stored tensor.
        buffers: name -> (shape, "float32" | "int64").
        out_dtype: bf16, fp16 or fp32: what floating tensors must have been cast to.
        mode: `full` (every element) or `sample`.

    Returns:
        `ok`, `problems` (the first 20), and counts of tensors and elements compared.
    """
    want_dtype = _OUT[out_dtype]
    problems: list[str] = []
    try:
        found = _headers(out_dir)
    except (OSError, ValueError, KeyError) as e:
        return {"ok": False, "problems": [f"output unreadable: {e}"], "tensors": 0, "elements": 0}
    expected_names = set(params) | set(buffers)
    if set(found) != expected_names:
        problems.append(
            f"names: missing {sorted(expected_names - set(found))[:5]}, "
            f"extra {sorted(set(found) - expected_names)[:5]}"
        )
    rng = random.Random(seed)
    jobs = []
    for name in sorted(expected_names & set(found)):
        path, entry, data_start = found[name]
        if name in buffers:
            shape, kind = buffers[name]
            dtype = "int64" if kind == "int64" else want_dtype
        else:
            shape, kind, dtype = params[name], "param", want_dtype
        got_dtype, itemsize = _ST_DTYPES.get(entry["dtype"], (entry["dtype"], 0))
        if got_dtype != dtype or tuple(entry["shape"]) != tuple(shape):
            problems.append(f"{name}: {got_dtype}{entry['shape']}, expected {dtype}{list(shape)}")
            continue
        numel = math.prod(shape)
        begin = entry["data_offsets"][0]
        jobs.append(
            (name, path, data_start + begin, itemsize, kind, shape, _windows(numel, mode, rng))
        )

    def one(job: tuple[Any, ...]) -> tuple[int, list[str]]:
        name, path, offset, itemsize, kind, shape, windows = job
        unsigned = {2: np.uint16, 4: np.uint32, 8: np.int64}[itemsize]
        bad: list[str] = []
        elements = 0
        fd = os.open(path, os.O_RDONLY)
        try:
            for start, count in windows:
                raw = os.pread(fd, count * itemsize, offset + start * itemsize)
                got = np.frombuffer(raw, dtype=unsigned)
                want = _expected(
                    "int64" if kind == "int64" else "float", name, start, count,
                    want_dtype, seed, (shape,),
                ).view(unsigned)  # fmt: skip
                elements += count
                if got.shape != want.shape or not np.array_equal(got, want):
                    diff = np.flatnonzero(got != want) if got.shape == want.shape else [0]
                    bad.append(
                        f"{name}: {len(diff)} of {count} elements differ from element "
                        f"{start + int(diff[0])} on"
                    )
                    break
        finally:
            os.close(fd)
        return elements, bad

    elements = 0
    with ThreadPoolExecutor(max(1, threads)) as pool:
        for n, bad in pool.map(one, jobs):
            elements += n
            problems.extend(bad)
    return {
        "ok": not problems,
        "mode": mode,
        "tensors": len(jobs),
        "elements": elements,
        "problems": problems[:20],
    }
