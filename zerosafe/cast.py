"""Casting buffers of elements between float dtypes: numpy where it rounds as torch does, so a
conversion to bfloat16 or float32 never imports torch.

torch's import is the longest wait of a short command: 1 s with the CPU wheel, and on a GPU
node about 3 s with CUDA's libraries (bench/device_command.sh's profile: a 2B command's merges
waited 2.9 s for it after planning). float32 -> bfloat16 through `ml_dtypes` (a dependency) is
round-to-nearest-even, as torch's cast is: every one of the 2^32 float32 values gave the same
bfloat16 in both, but a NaN (checked once, 87 s; `tests/test_cast.py` checks every rounding
case of every bfloat16 value). It is also faster: 4.1 GB/s of float32 in one thread here
against torch's 2.3. Widening casts give torch's values for every input but a NaN.

NaN: numpy gives bfloat16's quiet NaN with the input's sign (0x7FC0 / 0xFFC0); torch gives
0xFFFF from its vectorized loop and 0x7FC0 from its scalar one, so torch's bits depend on where
a NaN falls; a signalling float16 NaN widens signalling in numpy, quiet in torch. A NaN fails a
conversion's checks unless `--allow-nonfinite`; then it stays a NaN of the same sign.

Other pairs (to float16: numpy ran at 1.2 GB/s against torch's 2.7; anything else) use torch.
"""

from __future__ import annotations

import sys
from typing import Any

from zerosafe.dtypes import dtype_info, torch_dtype

__all__ = [
    "NUMPY_CASTS",
    "cast_bytes",
    "cast_into",
    "needs_torch",
    "numpy_dtype",
    "output_needs_torch",
    "serial_torch",
]

NUMPY_CASTS = frozenset({("float32", "bfloat16"), ("bfloat16", "float32"), ("float16", "float32")})
"""(from, to) dtype pairs cast by numpy, with the values torch gives (NaN's bits aside)."""
TORCH_STEP = 32768 - 64
"""Elements per torch call while torch runs more than one thread of its own: below torch's
parallel grain (`at::internal::GRAIN_SIZE`), so a call never fans out over its OpenMP pool, a
multiple of 64."""
TORCH_STEP_SERIAL = 1 << 20
"""Elements per torch call once torch runs one thread (`serial_torch`):
a call can then be long; each call takes the GIL once, and with short calls many parallel
tasks queued on it (16 tasks on 16 cores ran at the speed of 2, measured)."""

_numpy: Any = None
_torch: Any = None
_serial = False


def serial_torch() -> None:
    """Have torch run every operation on its calling thread (`torch.set_num_threads(1)`), now
    if torch is imported, else when a cast first imports it: this never imports torch.

    A conversion runs its own threads (tasks, readers, casters, hashers), each on a core; torch's
    OpenMP pool would add a thread per core per call, spinning between calls. With it off, a cast
    runs in long calls that release the GIL (`TORCH_STEP_SERIAL`). The `zerosafe` command, the
    flows and the worker processes call this; a library caller that keeps torch's pool casts at
    the shorter steps (correct, and slower when many tasks run at once).
    """
    global _serial
    _serial = True
    torch = _torch
    if torch is None:
        loaded = sys.modules.get("torch")  # fully imported: a preload's `then`, a caller's import
        torch = loaded if hasattr(loaded, "set_num_threads") else None
    if torch is not None and torch.get_num_threads() != 1:
        torch.set_num_threads(1)


def _torch_module() -> Any:
    """torch, imported once (an `import` per call would take the import lock each time), made
    serial on first use where `serial_torch` asked for it."""
    global _torch
    if _torch is None:
        import torch

        if _serial and torch.get_num_threads() != 1:
            torch.set_num_threads(1)
        _torch = torch
    return _torch


def needs_torch(src_dtype: str, out_dtype: str) -> bool:
    """Whether casting `src_dtype` to `out_dtype` goes through torch."""
    return src_dtype != out_dtype and (src_dtype, out_dtype) not in NUMPY_CASTS


def output_needs_torch(out_dtype: str) -> bool:
    """Whether a conversion to `out_dtype` will likely cast through torch, before its plan
    says: from float32 masters (DeepSpeed's, most DCP checkpoints'). It decides only what
    imports torch early (the command's background import, the workers' server); a cast that
    needs torch imports it in any case."""
    return needs_torch("float32", out_dtype)


def _np() -> Any:
    """numpy, with `ml_dtypes`'s types (bfloat16) registered."""
    global _numpy
    if _numpy is None:
        import ml_dtypes  # noqa: F401 - registers bfloat16 and the float8 types with numpy
        import numpy

        _numpy = numpy
    return _numpy


def numpy_dtype(name: str) -> Any:
    """numpy's dtype for a zerosafe dtype name (`ml_dtypes`'s for bfloat16)."""
    return _np().dtype(name)


def cast_into(src: Any, src_dtype: str, out: Any, out_dtype: str, count: int) -> None:
    """Cast the first `count` elements of buffer `src` into buffer `out`, rounding to nearest
    even. Releases the GIL while it copies (numpy and torch both), so threads can split a
    buffer between them."""
    if count == 0:
        return
    if (src_dtype, out_dtype) in NUMPY_CASTS:
        np = _np()
        a = np.frombuffer(src, dtype=numpy_dtype(src_dtype), count=count)
        o = np.frombuffer(out, dtype=numpy_dtype(out_dtype), count=count)
        with np.errstate(invalid="ignore", over="ignore"):  # NaN and overflow cast as torch's
            np.copyto(o, a, casting="unsafe")
        return
    torch = _torch_module()
    src_t = torch.frombuffer(src, dtype=torch_dtype(src_dtype), count=count)
    out_t = torch.frombuffer(out, dtype=torch_dtype(out_dtype), count=count)
    step = TORCH_STEP_SERIAL if torch.get_num_threads() == 1 else TORCH_STEP
    if count <= step:
        out_t.copy_(src_t)
        return
    for d, s in zip(out_t.split(step), src_t.split(step), strict=True):
        d.copy_(s)


def cast_bytes(raw: bytes | bytearray | memoryview, src_dtype: str, out_dtype: str) -> bytes:
    """`raw`'s elements cast to `out_dtype`, as bytes (a copy of `raw` when the dtypes agree)."""
    if src_dtype == out_dtype:
        return bytes(raw)
    count = len(raw) // dtype_info(src_dtype).itemsize
    out = bytearray(count * dtype_info(out_dtype).itemsize)
    src = raw if (src_dtype, out_dtype) in NUMPY_CASTS else bytearray(raw)  # torch: writable
    cast_into(src, src_dtype, out, out_dtype, count)
    return bytes(out)
