"""Checks of quantized weights (`--quantize`, `zerosafe.quantize`) that need no source: each
`F8_E4M3` weight has its scales in the same file (`_scale_inv` of the 128x128 block grid's
shape, or `_scale` `[rows, 1]`), every scale finite and positive; and the bits per parameter the file's quantized weights
take with their scales. With the source (`verify --against`), `within_rounding_bound` checks
dequantized values against the master weights.

Formats: transformers' fine-grained FP8 (`transformers/integrations/finegrained_fp8.py`),
compressed-tensors' `float-quantized`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from zerosafe.io.storage import ByteSource

if TYPE_CHECKING:
    from zerosafe.formats.safetensors import SafetensorsHeader
from zerosafe.quantize import SCALE_SUFFIXES, expected_scale_shape

__all__ = ["check_quantized", "find_scale", "within_rounding_bound"]

_E4M3_MIN_NORMAL_EXPONENT = -6
"""e4m3's smallest normal value is 2^-6; below it the step is the subnormals' 2^-9."""
_E4M3_MANTISSA_BITS = 3


def check_quantized(
    source: ByteSource, data_start: int, header: SafetensorsHeader
) -> tuple[list[tuple[str, str]], dict[str, int]]:
    """The problems of one file's quantized weights, as `(tensor, detail)` of its `scales`
    check, and `{"tensors", "params", "bytes"}` (weights and scales) for the bits per
    parameter; an empty dict without any."""
    import numpy as np

    failures: list[tuple[str, str]] = []
    tensors = params = nbytes = 0
    for name, entry in header.items():
        if entry.dtype != "F8_E4M3":
            continue
        shape = list(entry.shape)
        suffix = find_scale(name, header)
        scale = header.get(name + suffix)
        grid = expected_scale_shape(suffix, shape)
        if scale is None or scale.dtype != "F32" or list(scale.shape) != grid:
            found = "none" if scale is None else f"{scale.dtype} {list(scale.shape)}"
            failures.append(
                (name, f"expected '{name}{suffix}' F32 {grid} beside it, found "
                 f"{found}; loaders would read the FP8 values unscaled. Convert again")
            )  # fmt: skip
            continue
        begin, end = scale.data_offsets
        values = np.frombuffer(source.read_range(data_start + begin, data_start + end), dtype="<f4")
        bad = int(np.count_nonzero(~(np.isfinite(values) & (values > 0))))
        if bad:
            failures.append(
                (name + suffix, f"{bad} of {values.size} scale(s) not finite and "
                 "positive (a block of non-finite or denormal values); the block cannot be "
                 "dequantized")
            )  # fmt: skip
        tensors += 1
        params += int(np.prod(shape))
        nbytes += entry.data_offsets[1] - entry.data_offsets[0] + end - begin
    return failures, ({"tensors": tensors, "params": params, "bytes": nbytes} if tensors else {})


def find_scale(name: str, header: SafetensorsHeader) -> str:
    """The suffix of weight `name`'s scales in `header` (`_scale_inv` or `_scale`; the first
    where there is none)."""
    found = [s for s in SCALE_SUFFIXES.values() if name + s in header]
    return found[0] if found else next(iter(SCALE_SUFFIXES.values()))


def within_rounding_bound(quantized: bytes, scales: Any, master: Any) -> bool:
    """Whether FP8 bytes `quantized` are each within e4m3's rounding bound of `master` (the
    same elements, float32) divided by its scale (`scales`, one per element: its block's
    `weight_scale_inv` or its row's `weight_scale`): half a step of e4m3 at the scaled value
    (`2^(e - 4)` for a value in `[2^e, 2^(e + 1))`, `2^-10` among the subnormals), plus the
    float32 rounding of the scale. A value one step off fails; NaN matches NaN."""
    import ml_dtypes
    import numpy as np

    q = np.frombuffer(quantized, dtype=ml_dtypes.float8_e4m3fn).astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        x = np.asarray(master, dtype=np.float64) / np.asarray(scales, dtype=np.float64)
    _, exponent = np.frexp(np.abs(x))  # |x| = m * 2^exponent, m in [0.5, 1)
    exponent = np.where(x == 0, _E4M3_MIN_NORMAL_EXPONENT, exponent - 1)
    exponent = np.maximum(exponent, _E4M3_MIN_NORMAL_EXPONENT)
    half_step = np.ldexp(1.0, exponent - _E4M3_MANTISSA_BITS - 1)
    bound = half_step * (1 + 2.0**-20) + np.abs(x) * 2.0**-20
    nan = np.isnan(x)
    return bool(np.all(np.where(nan, np.isnan(q), np.abs(q - x) <= bound)))
