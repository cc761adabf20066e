"""Checks of quantized weights (`--quantize fp8-block`, `zerosafe.quantize`) that need no
source: each `F8_E4M3` weight has its `_scale_inv` tensor in the same file, of the block grid's
shape, every scale finite and positive; and the bits per parameter the file's quantized weights
take with their scales. With the source (`verify --against`), `within_rounding_bound` checks
dequantized values against the master weights.

Format: transformers' fine-grained FP8 (`transformers/integrations/finegrained_fp8.py`).
"""

from __future__ import annotations

from typing import Any

from zerosafe.io.storage import ByteSource
from zerosafe.quantize import FP8_BLOCK, SCALE_SUFFIX

__all__ = ["check_quantized", "within_rounding_bound"]

_E4M3_MIN_NORMAL_EXPONENT = -6
"""e4m3's smallest normal value is 2^-6; below it the step is the subnormals' 2^-9."""
_E4M3_MANTISSA_BITS = 3


def check_quantized(
    source: ByteSource, data_start: int, header: dict[str, Any]
) -> tuple[list[tuple[str, str]], dict[str, int]]:
    """The problems of one file's quantized weights, as `(tensor, detail)` of its `scales`
    check, and `{"tensors", "params", "bytes"}` (weights and scales) for the bits per
    parameter; an empty dict without any."""
    import numpy as np

    failures: list[tuple[str, str]] = []
    tensors = params = nbytes = 0
    for name, entry in header.items():
        if entry["dtype"] != "F8_E4M3":
            continue
        shape = list(entry["shape"])
        scale = header.get(name + SCALE_SUFFIX)
        grid = [-(-n // FP8_BLOCK) for n in shape]
        if scale is None or scale["dtype"] != "F32" or list(scale["shape"]) != grid:
            found = "none" if scale is None else f"{scale['dtype']} {list(scale['shape'])}"
            failures.append(
                (name, f"expected '{name}{SCALE_SUFFIX}' F32 {grid} beside it, found "
                 f"{found}; loaders would read the FP8 values unscaled. Convert again")
            )  # fmt: skip
            continue
        begin, end = scale["data_offsets"]
        values = np.frombuffer(source.read_range(data_start + begin, data_start + end), dtype="<f4")
        bad = int(np.count_nonzero(~(np.isfinite(values) & (values > 0))))
        if bad:
            failures.append(
                (name + SCALE_SUFFIX, f"{bad} of {values.size} scale(s) not finite and "
                 "positive (a block of non-finite or denormal values); the block cannot be "
                 "dequantized")
            )  # fmt: skip
        tensors += 1
        params += int(np.prod(shape))
        nbytes += entry["data_offsets"][1] - entry["data_offsets"][0] + end - begin
    return failures, ({"tensors": tensors, "params": params, "bytes": nbytes} if tensors else {})


def within_rounding_bound(
    quantized: bytes, scales: Any, master: Any, elements: Any, cols: int
) -> bool:
    """Whether FP8 bytes `quantized` of elements `elements` (flat indices of a `[rows, cols]`
    weight) are each within e4m3's rounding bound of `master` (float32, the same elements)
    scaled by its block's scale (`1 / scales`, float32 `[rows / 128, cols / 128]`): half a
    step of e4m3 at the scaled value (`2^(e - 4)` for a value in `[2^e, 2^(e + 1))`, `2^-10`
    among the subnormals), plus the float32 rounding of the scale. A value one step off fails;
    NaN matches NaN."""
    import ml_dtypes
    import numpy as np

    q = np.frombuffer(quantized, dtype=ml_dtypes.float8_e4m3fn).astype(np.float64)
    inv = np.asarray(scales, dtype=np.float64)[
        elements // cols // FP8_BLOCK, elements % cols // FP8_BLOCK
    ]
    with np.errstate(divide="ignore", invalid="ignore"):
        x = np.asarray(master, dtype=np.float64) / inv
    _, exponent = np.frexp(np.abs(x))  # |x| = m * 2^exponent, m in [0.5, 1)
    exponent = np.where(x == 0, _E4M3_MIN_NORMAL_EXPONENT, exponent - 1)
    exponent = np.maximum(exponent, _E4M3_MIN_NORMAL_EXPONENT)
    half_step = np.ldexp(1.0, exponent - _E4M3_MANTISSA_BITS - 1)
    bound = half_step * (1 + 2.0**-20) + np.abs(x) * 2.0**-20
    nan = np.isnan(x)
    return bool(np.all(np.where(nan, np.isnan(q), np.abs(q - x) <= bound)))
