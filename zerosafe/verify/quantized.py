"""Checks of quantized weights (`--quantize`, `zerosafe.quantize`) that need no source: each
`F8_E4M3` weight has its scales in the same file (`_scale_inv` of the 128x128 block grid's
shape, float32 or ue8m0, or `_scale` `[rows, 1]`), each NVFP4 `_packed` weight its `float8_e4m3fn` `_scale`
`[rows, cols / 16]` and float32 `_global_scale` `[1]`, every scale finite and positive; the
bits per parameter the file's quantized weights take with their scales; and the stored
weights against the `quantization_config` of the output's `config.json` (`check_scheme`: an
"NVFP4" release that holds FP8 weights, or a quantized module its `ignore` lists, fails).
With the source (`verify --against`), `within_rounding_bound` and `within_fp4_bound` check
dequantized values against the master weights.

Formats: transformers' fine-grained FP8 (`transformers/integrations/finegrained_fp8.py`),
compressed-tensors' `float-quantized` and `nvfp4-pack-quantized`.
"""

from __future__ import annotations

import json
from typing import Any

from zerosafe.io.storage import ByteSource, Storage, join_url
from zerosafe.quantize import FP4_GROUP, SCALE_SUFFIXES, expected_scale_shape

__all__ = [
    "as_checkpoint_names",
    "check_quantized",
    "check_scheme",
    "decode_scales",
    "find_scale",
    "fp4_values",
    "quantized_report",
    "within_fp4_bound",
    "within_rounding_bound",
]

_E4M3_MIN_NORMAL_EXPONENT = -6
"""e4m3's smallest normal value is 2^-6; below it the step is the subnormals' 2^-9."""
_E4M3_MANTISSA_BITS = 3
_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""FP4 E2M1's magnitudes by code (the low 3 bits; bit 3 is the sign)."""
_SCHEME_BITS = {
    "fp8": (8.0, 40.0), "float-quantized": (8.0, 40.0), "nvfp4-pack-quantized": (4.5, 4.6),
}  # fmt: skip
"""The bits per parameter (values and scales) a `quantization_config` implies, `[low, high)`:
FP8 is 8 plus its float32 scales (at most 32 a value, one column); NVFP4 is 4 plus an 8-bit
scale per 16 values (and a float32 a tensor)."""
_CONFIG_MAX_BYTES = 2**24


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
        packed = name.endswith("_packed") and entry["dtype"] == "U8" and len(entry["shape"]) == 2
        if entry["dtype"] != "F8_E4M3" and not packed:
            continue
        if not packed and name.endswith("_scale") and name[: -len("_scale")] + "_packed" in header:
            continue  # an NVFP4 weight's group scales
        shape = list(entry["shape"])
        if packed:
            weight = name.removesuffix("_packed")
            rows, cols = shape[0], shape[1] * 2
            scales = [
                ("_scale", "F8_E4M3", [rows, cols // FP4_GROUP]),
                ("_global_scale", "F32", [1]),
            ]
        else:
            weight = name
            rows, cols = shape if len(shape) == 2 else (0, 0)
            suffix = find_scale(name, header)
            found = (header.get(name + suffix) or {}).get("dtype")
            dtype = "F8_E8M0" if suffix == "_scale_inv" and found == "F8_E8M0" else "F32"
            scales = [(suffix, dtype, expected_scale_shape(suffix, shape))]
        size = entry["data_offsets"][1] - entry["data_offsets"][0]
        for suffix, dtype, grid in scales:
            scale = header.get(weight + suffix)
            if scale is None or scale["dtype"] != dtype or list(scale["shape"]) != grid:
                found = "none" if scale is None else f"{scale['dtype']} {list(scale['shape'])}"
                failures.append(
                    (name, f"expected '{weight}{suffix}' {dtype} {grid} beside it, found "
                     f"{found}; loaders would read the quantized values unscaled. Convert again")
                )  # fmt: skip
                size = -1
                break
            begin, end = scale["data_offsets"]
            raw = source.read_range(data_start + begin, data_start + end)
            values = decode_scales(raw, dtype)
            bad = int(np.count_nonzero(~(np.isfinite(values) & (values > 0))))
            if bad:
                failures.append(
                    (weight + suffix, f"{bad} of {values.size} scale(s) not finite and "
                     "positive (a block of non-finite or denormal values); the block cannot be "
                     "dequantized")
                )  # fmt: skip
            size += end - begin
        if size < 0:
            continue
        tensors += 1
        params += rows * cols if packed else int(np.prod(shape))
        nbytes += size
    return failures, ({"tensors": tensors, "params": params, "bytes": nbytes} if tensors else {})


def decode_scales(raw: bytes, dtype: str) -> Any:
    """Float64 values of little-endian `F32`, `F8_E4M3` or `F8_E8M0` (ue8m0) bytes."""
    import ml_dtypes
    import numpy as np

    if dtype == "F32":
        return np.frombuffer(raw, dtype="<f4").astype(np.float64)
    kind = ml_dtypes.float8_e4m3fn if dtype == "F8_E4M3" else ml_dtypes.float8_e8m0fnu
    return np.frombuffer(raw, dtype=kind).astype(np.float64)


def quantized_report(parts: list[dict[str, int]]) -> dict[str, Any]:
    """`{"quantized": {tensors, params, bits_per_parameter}}` over every file's quantized
    weights and their scales (`check_quantized`'s counts); empty when there are none."""
    parts = [p for p in parts if p]
    if not parts:
        return {}
    params = sum(p["params"] for p in parts)
    return {
        "quantized": {
            "tensors": sum(p["tensors"] for p in parts),
            "params": params,
            "bits_per_parameter": round(8 * sum(p["bytes"] for p in parts) / params, 4),
        }
    }


def check_scheme(
    storage: Storage,
    out_url: str,
    stored: dict[str, tuple[str, dict[str, Any]]],
    quantized: dict[str, Any],
) -> list[tuple[str, str, str]]:
    """The stored weights against the `quantization_config` of the output's `config.json`, as
    `(file, tensor, detail)` of its `quantization` check:
    quantized weights without one (loaders would read them unscaled), a config whose format
    the weights do not have (FP8 values in an NVFP4 release: its bits per parameter), a
    quantized module the config's ignore list names, or an NVFP4 group size other than 16.

    Args:
        stored: tensor name -> (file, {"dtype", "shape"}) of the output.
        quantized: `quantized_report`'s `quantized` (empty without quantized weights).
    """
    url = join_url(out_url, "config.json")
    config = {}
    if storage.exists(url):
        raw = storage.read_small(url, limit_bytes=_CONFIG_MAX_BYTES, what="the model's config")
        config = json.loads(raw)
    scheme = config.get("quantization_config") if isinstance(config, dict) else None
    known = isinstance(scheme, dict) and scheme.get("quant_method") in ("fp8", "compressed-tensors")
    if not quantized and not known:
        return []
    if not isinstance(scheme, dict):
        return [
            ("config.json", "*",
                    f"{quantized['tensors']} quantized weight(s) but no `quantization_config`; "
                    "loaders would read them unscaled. Convert again")
        ]  # fmt: skip
    form = scheme.get("format") if scheme.get("quant_method") == "compressed-tensors" else "fp8"
    low, high = _SCHEME_BITS.get(str(form), (0.0, 64.0))
    bits = quantized.get("bits_per_parameter", 0.0)
    failures = []
    if not low <= bits < high:
        failures.append(
            ("config.json", "*",
                    f"`quantization_config` says {form}, expected {low} to {high} bits per "
                    f"parameter, found {bits} in the weights; the release holds another format")
        )  # fmt: skip
    groups = [g.get("weights") or {} for g in (scheme.get("config_groups") or {}).values()]
    if form == "nvfp4-pack-quantized" and any(g.get("group_size") != FP4_GROUP for g in groups):
        failures.append(
            ("config.json", "*",
                    f"`quantization_config` groups of {[g.get('group_size') for g in groups]}, "
                    f"expected {FP4_GROUP}: the scales stored are per {FP4_GROUP} values")
        )  # fmt: skip
    ignored = set(scheme.get("ignore") or scheme.get("modules_to_not_convert") or [])
    for name, (file, info) in stored.items():
        module = name.removesuffix("_packed").removesuffix(".weight")
        values = info["dtype"] == "float8_e4m3fn" and name.endswith(".weight")
        if (values or name.endswith(".weight_packed")) and module in ignored:
            failures.append(
                (file, name,
                        f"quantized, but `quantization_config` lists '{module}' as not "
                        "converted; loaders would read its values unscaled")
            )  # fmt: skip
    return failures


def as_checkpoint_names(
    stored: dict[str, tuple[str, dict[str, Any]]],
) -> dict[str, tuple[str, dict[str, Any]]]:
    """`stored` as the checkpoint names it: an NVFP4 `<w>_packed` as `<w>` with its shape
    (two values a byte), and the scales of a quantized weight (which the conversion
    computes) left out."""
    out: dict[str, tuple[str, dict[str, Any]]] = {}
    for name, (file, info) in stored.items():
        if name.endswith(".weight_packed") and info["dtype"] == "uint8":
            rows, cols = info["shape"]
            out[name.removesuffix("_packed")] = (file, {**info, "shape": [rows, cols * 2]})
        elif not _is_scale_of(name, stored):
            out[name] = (file, info)
    return out


def _is_scale_of(name: str, stored: dict[str, tuple[str, dict[str, Any]]]) -> bool:
    """Whether `name` is the scales of a stored quantized weight."""
    for suffix in (*SCALE_SUFFIXES.values(), "_global_scale"):
        weight = stored.get(name.removesuffix(suffix)) if name.endswith(suffix) else None
        if weight is not None and weight[1]["dtype"] == "float8_e4m3fn":
            return True
        if name.endswith(suffix) and name.removesuffix(suffix) + "_packed" in stored:
            return True
    return False


def find_scale(name: str, header: dict[str, Any]) -> str:
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


def fp4_values(packed: bytes) -> Any:
    """The FP4 E2M1 values (float64) of packed bytes, two a byte, the low nibble first."""
    import numpy as np

    raw = np.frombuffer(packed, dtype=np.uint8)
    codes = np.stack([raw & 0x0F, raw >> 4], axis=1).reshape(-1)
    magnitude = np.asarray(_E2M1_VALUES)[codes & 0x07]
    return np.where(codes & 0x08, -magnitude, magnitude)


def within_fp4_bound(values: Any, scales: Any, master: Any) -> bool:
    """Whether FP4 `values` (`fp4_values`) are each within E2M1's rounding bound of `master`
    (float32) divided by its effective scale (`scales`: its group's `weight_scale` over the
    `weight_global_scale`, one per element): half a step at the scaled value (0.25 below 2,
    0.5 below 4, 1 up to 6; beyond 6, where e4m3's rounding of the scale put it, the clamp
    to 6), plus float32's rounding. A value a code off, away from a tie, fails."""
    import numpy as np

    with np.errstate(divide="ignore", invalid="ignore"):
        x = np.asarray(master, dtype=np.float64) / np.asarray(scales, dtype=np.float64)
    size = np.abs(x)
    half_step = np.where(size < 2, 0.25, np.where(size < 4, 0.5, 1.0))
    bound = half_step + size * 2.0**-20
    return bool(np.all(np.abs(np.asarray(values) - x) <= bound))
