"""Weight-only quantization on the way out (`--quantize`): FP8 with 128x128 block scales
(`fp8-block`), FP8 with one scale per output channel (`fp8-dynamic`), or NVFP4 (`nvfp4a16`).

`fp8-block` is the format transformers' fine-grained FP8 quantizer writes (`Fp8Quantize` in
`transformers/integrations/finegrained_fp8.py`; the layout of the DeepSeek-V3 and Qwen FP8
releases, which vLLM and SGLang load): a 2-D weight whose rows and columns both divide by 128
becomes `float8_e4m3fn` (safetensors `F8_E4M3`), and beside it `<module>.weight_scale_inv`,
float32, one value per 128x128 block (`[rows / 128, cols / 128]`). Per block, in float32:
`amax = max|w|`, `scale = 448 / amax` (448: the largest finite e4m3fn value), `inv = 1 / scale`
(stored), `q = e4m3fn(clamp(w * scale, -448, 448))`, rounded to nearest even; an all-zero
block gets `scale = inv = 1`. With the `ue8m0` scale format (`scale_fmt`, DeepSeek's
power-of-two scales) `inv` is first rounded up to a power of two,
`2^ceil(log2(max(inv, tiny)))`, stored as `float8_e8m0fnu` (one byte), and `scale = 1 / inv`. A weight whose shape does not divide by the block is left as it
is, as the reference leaves it; the plan lists it in `modules_to_not_convert`.

`fp8-dynamic` is compressed-tensors' `float-quantized` format, as llm-compressor's
`FP8_DYNAMIC` scheme writes it (`compressed_tensors.quantization.utils.helpers.calculate_qparams`
and `...lifecycle.forward.quantize`): per output row, in float32, `scale = max|w| / 448` (an
all-zero row gets float32's eps), `q = e4m3fn(clamp(w / scale + 0, -448, 448))` (the `+ 0` is
the symmetric zero point llm-compressor initializes: a `-0.0` becomes `+0.0`), stored as
`<module>.weight_scale` float32 `[rows, 1]`; any 2-D shape. Activations are quantized per token
at run time (`dynamic`), so nothing else is stored.

`nvfp4a16` is compressed-tensors' `nvfp4-pack-quantized` format, as llm-compressor's
`NVFP4A16` scheme writes it (`...utils.helpers.generate_gparam` and `calculate_qparams`,
`compressors.nvfp4`): per tensor, in float32, `global = 448 * 6 / max|w|` (6: FP4 E2M1's
largest value; `max|w|` at least float32's smallest normal; a non-finite result becomes 1),
stored as `<module>.weight_global_scale` `[1]`; per group of 16 along a row,
`scale = e4m3fn(clamp(global * (max|w| / 6), -448, 448))` (an all-zero group: 0.125, e4m3's
eps there), stored as `<module>.weight_scale` `float8_e4m3fn` `[rows, cols / 16]`; each value
`x = w / (scale / global)` clamped to [-6, 6] and rounded to the nearest E2M1 value (ties to
even), its sign bit set when `x < 0`; two 4-bit codes a byte, the even column in the low
nibble, as `<module>.weight_packed` uint8 `[rows, cols / 2]`. The global scale needs the whole
tensor's `max|w|`: the merge reads the weight's bands twice, once for it. A weight whose
columns do not divide by 16 is refused, as compressed-tensors refuses it.

A weight is quantized a band of 128 rows at a time (`quantize_band`; a block needs 128 whole
rows): the merge reads `128 * cols` source elements, writes the band's bytes and keeps the
band's scales, which are written as the next tensor once the weight is done.

Which tensors are quantized is decided in one place, `ConvertOptions.quantize_skip_reason`.
"""

from __future__ import annotations

import functools
import re
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = [
    "BAND_BYTES_PER_COLUMN",
    "FP4_GROUP",
    "SCALE_FORMATS",
    "BAND_ROWS",
    "COMPRESSED_TENSORS_VERSION",
    "FP8_BLOCK",
    "FP8_DTYPE",
    "FP8_MAX",
    "QUANTIZE_SCHEMES",
    "SCALE_DTYPE",
    "SCALE_SUFFIXES",
    "SKIPPED_MODULE",
    "QuantizedBand",
    "block_skip_reason",
    "e4m3fn_codes",
    "global_scale",
    "quantized_tensors",
    "expected_scale_shape",
    "quantization_config",
    "quantize_band",
    "scale_name",
    "scale_shape",
]

QUANTIZE_SCHEMES = ("fp8-block", "fp8-dynamic", "nvfp4a16")
"""What `--quantize` writes."""
BAND_ROWS = 128
"""Rows of a weight quantized at once (a row of 128x128 blocks for `fp8-block`)."""
BAND_BYTES_PER_COLUMN = 2048
"""What quantizing one band holds per column of the weight: the float32 band (512 bytes) and
the quantization's temporaries and output (measured with tracemalloc at 65536 columns: 260
more for `fp8-block`, 640 for `fp8-dynamic`, which run in numpy; 1153 when they ran in torch,
and `nvfp4a16`, still in torch, 4% above that), with room for the codes the writer has not
taken yet."""
COMPRESSED_TENSORS_VERSION = "0.20.0"
"""The compressed-tensors release whose `float-quantized` format `fp8-dynamic` writes (its
`quantization_config.version`)."""
FP8_BLOCK = 128
"""Rows and columns of one block (`weight_block_size: [128, 128]`)."""
FP8_DTYPE = "float8_e4m3fn"
FP8_MAX = 448.0
"""The largest finite `float8_e4m3fn` value (`torch.finfo(torch.float8_e4m3fn).max`)."""
SCALE_DTYPE = "float32"
SCALE_FORMATS = ("float", "ue8m0")
"""`fp8-block`'s scale formats (transformers' `scale_fmt`): float32, or powers of two stored as
`float8_e8m0fnu`."""
SCALE_SUFFIXES = {"fp8-block": "_scale_inv", "fp8-dynamic": "_scale", "nvfp4a16": "_scale"}
"""A quantized weight's scales are `<weight name><suffix>`: `<module>.weight_scale_inv`
(transformers' fine-grained FP8) or `<module>.weight_scale` (compressed-tensors)."""
FP4_GROUP = 16
"""Values of one NVFP4 group (`group_size: 16`), along a row."""
FP4_MAX = 6.0
"""The largest FP4 E2M1 value."""
_FP4_ROUNDING = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False),
                 (3.5, True), (5.0, False))  # fmt: skip
"""E2M1's magnitude codes 1..7 (0.5, 1, 1.5, 2, 3, 4, 6) begin above (or at, where True)
these midpoints: round to nearest, ties to the even code."""
_FP8_EPS = 0.125
"""compressed-tensors' scale of an all-zero NVFP4 group (its `_get_dtype_eps` of e4m3fn)."""
_FLOAT32_EPS = 2.0**-23
_FLOAT32_TINY = 2.0**-126
"""`torch.finfo(torch.float32).tiny`."""
"""`torch.finfo(torch.float32).eps`: compressed-tensors' scale of an all-zero row."""
_CHUNK = 1 << 16
"""Elements scaled and cast at once: their temporaries (float32, the table index, the tie
mask: 17 bytes an element) stay in a core's L2."""
SKIPPED_MODULE = re.compile(
    r"(^|\.)(embed_tokens|embed_in|embed_out|embeddings?|wte|wpe|word_embeddings|lm_head"
    r"|[^.]*norm[^.]*|gate|router|[^.]*_router|shared_expert_gate)$"
)
"""Module names (the tensor name without `.weight`) never quantized, as the reference recipes
leave them: embeddings, the output head, norms, and MoE routers and gates (`mlp.gate`; not
`gate_proj`, a linear layer)."""


def scale_name(scheme: str, weight_name: str) -> str:
    """The scale tensor's name: `<module>.weight_scale_inv` or `<module>.weight_scale`."""
    return weight_name + SCALE_SUFFIXES[scheme]


def scale_shape(scheme: str, shape: tuple[int, ...]) -> tuple[int, int]:
    """`[rows / 128, cols / 128]` (`fp8-block`), `[rows, 1]` (`fp8-dynamic`) or
    `[rows, cols / 16]` (`nvfp4a16`)."""
    rows, cols = shape
    if scheme == "fp8-block":
        return rows // FP8_BLOCK, cols // FP8_BLOCK
    if scheme == "nvfp4a16":
        return rows, cols // FP4_GROUP
    return rows, 1


def quantized_tensors(
    scheme: str, weight_name: str, shape: tuple[int, ...], scale_fmt: str = "float"
) -> list[tuple[str, str, tuple[int, ...]]]:
    """What weight `weight_name` of `shape` is stored as in `scheme`, in file order, as
    `(name, dtype, shape)`: its values, then its scales (`fp8-*`: the FP8 weight under its
    own name and a float32 scale, `float8_e8m0fnu` under `scale_fmt` ue8m0; `nvfp4a16`:
    `weight_packed`, `weight_scale` and `weight_global_scale`)."""
    dtype = "float8_e8m0fnu" if scale_fmt == "ue8m0" else SCALE_DTYPE
    scales = (scale_name(scheme, weight_name), dtype, scale_shape(scheme, shape))
    if scheme != "nvfp4a16":
        return [(weight_name, FP8_DTYPE, shape), scales]
    rows, cols = shape
    return [
        (weight_name + "_packed", "uint8", (rows, cols // 2)),
        (scales[0], FP8_DTYPE, scales[2]),
        (weight_name + "_global_scale", SCALE_DTYPE, (1,)),
    ]


def expected_scale_shape(suffix: str, shape: list[int]) -> list[int]:
    """The shape of the scales named `<weight><suffix>` of a weight of `shape` (verify: the
    file tells the scheme by the name)."""
    if suffix == SCALE_SUFFIXES["fp8-block"]:
        return [-(-n // FP8_BLOCK) for n in shape]
    return [shape[0], 1] if len(shape) == 2 else [-1]


def block_skip_reason(scheme: str, shape: tuple[int, ...]) -> str | None:
    """Why a weight of `shape` cannot be quantized in `scheme` (not 2-D; for `fp8-block`, not
    cut into 128x128 blocks), or None."""
    if len(shape) != 2:
        return f"a {len(shape)}-D tensor, not a 2-D weight"
    if scheme == "fp8-block" and (shape[0] % FP8_BLOCK or shape[1] % FP8_BLOCK):
        return (
            f"shape {list(shape)} does not divide into {FP8_BLOCK}x{FP8_BLOCK} blocks "
            "(left unquantized, as transformers' quantizer leaves it)"
        )
    return None


@dataclass(frozen=True, slots=True)
class QuantizedBand:
    """One band of up to 128 rows, quantized: its `float8_e4m3fn` bytes (row-major) and its
    scales, a 2-D float32 numpy array (`[1, cols / 128]` or `[rows, 1]`): a weight's scales
    are its bands' concatenated on axis 0."""

    data: bytes
    scales: Any
    """A float32 numpy array."""


def global_scale(amax: torch.Tensor) -> torch.Tensor:
    """NVFP4's `weight_global_scale` (float32 `[1]`) of a weight whose largest magnitude is
    `amax` (a float32 scalar; NaN where the weight holds one), as compressed-tensors'
    `generate_gparam` computes it."""
    import torch

    amax = amax.reshape(1).to(torch.float32)
    scale = (FP8_MAX * FP4_MAX) / amax.clamp(min=torch.finfo(torch.float32).tiny)
    return torch.nan_to_num(scale, nan=1.0, posinf=1.0, neginf=1.0)


def quantize_band(
    scheme: str,
    band: Any,
    global_scale: torch.Tensor | None = None,
    *,
    scale_fmt: str = "float",
) -> QuantizedBand:
    """Quantize `band` (float32, `[rows <= 128, cols]`, a numpy array or a CPU torch tensor)
    in `scheme`, computing in float32 as the reference does (for `fp8-block`, cols a
    multiple of 128: one row of blocks, its scales in `scale_fmt`; for `nvfp4a16`, cols a
    multiple of 16, with the weight's `global_scale`).

    `fp8-block` with float scales and `fp8-dynamic` run in numpy (their scales a numpy
    array), `nvfp4a16` and `ue8m0` scales in torch (`_quantize_in_torch`; a torch tensor).
    In numpy, single-threaded, so a merge needs no torch (its import costs more than the
    whole quantization of a 0.5B model) and threads can quantize bands side by side. Each
    float32 operation is the reference's, rounded alike: transformers' `448 / amax` is torch's
    `Tensor.__rdiv__`, `reciprocal(amax) * 448`; its `1 / scale` a reciprocal;
    compressed-tensors' `amax / 448` and `w / scale` true divisions. The cast to
    `float8_e4m3fn` with the reference's clamp to +-448 is `e4m3fn_codes`'s. After the
    scales, the band is scaled and cast `_CHUNK` elements at a time, so what it holds beside
    the band is its codes and one chunk's temporaries.
    """
    if scheme == "nvfp4a16" or scale_fmt == "ue8m0":
        return _quantize_in_torch(scheme, band, global_scale, scale_fmt)
    import numpy as np

    band = np.asarray(band, dtype=np.float32)
    rows, cols = band.shape
    codes = np.empty(rows * cols, dtype=np.uint8)
    step = max(1, _CHUNK // cols)  # rows at once
    with np.errstate(all="ignore"):  # zero, subnormal and non-finite blocks: as the reference
        if scheme == "fp8-block":
            blocks = band.reshape(rows, cols // FP8_BLOCK, FP8_BLOCK)
            # max |w| per block, down the rows first (SIMD-wide), as max(max, -min): no |w| copy
            amax = np.maximum(blocks.max(axis=0), -blocks.min(axis=0)).max(axis=1)
            nonzero = amax > 0
            one = np.float32(1.0)
            safe = np.where(nonzero, amax, one)
            scale = np.where(nonzero, np.reciprocal(safe) * np.float32(FP8_MAX), one)
            scratch = np.empty((step, *blocks.shape[1:]), dtype=np.float32)
            for r in range(0, rows, step):
                scaled = scratch[: min(step, rows - r)]
                np.multiply(blocks[r : r + step], scale.reshape(1, -1, 1), out=scaled)
                _codes_into(scaled.reshape(-1), codes[r * cols : (r + step) * cols])
            return QuantizedBand(codes.tobytes(), np.reciprocal(scale).reshape(1, -1))
        assert scheme == "fp8-dynamic", scheme
        scale = np.abs(band).max(axis=1, keepdims=True) / np.float32(FP8_MAX)
        scale = np.where(scale == 0, np.float32(_FLOAT32_EPS), scale)
        scratch = np.empty((step, cols), dtype=np.float32)
        for r in range(0, rows, step):
            scaled = scratch[: min(step, rows - r)]
            np.divide(band[r : r + step], scale[r : r + step], out=scaled)
            scaled += np.float32(0.0)  # the symmetric zero point: -0.0 becomes +0.0
            _codes_into(scaled.reshape(-1), codes[r * cols : (r + step) * cols])
    return QuantizedBand(codes.tobytes(), scale)


def e4m3fn_codes(values: Any) -> Any:
    """The `float8_e4m3fn` bytes (uint8 numpy array) of float32 `values` clamped to
    +-448, as `torch.clamp(values, -448, 448).to(torch.float8_e4m3fn)` gives them: rounded
    to nearest even, NaN to 0x7F with its sign.

    The code of a float32 is a function of its top 16 bits, but for the round-half-even
    ties, which need to know whether its low 16 bits are zero (below the rounding point of
    every e4m3 value, subnormals included, they only break ties; they also tell NaN from
    infinity): one lookup per value in a table of 65536 codes (`_e4m3fn_tables`: low bits
    nonzero), a second for the few whose low half is zero.
    """
    import numpy as np

    flat = np.ascontiguousarray(values, dtype=np.float32).reshape(-1)
    codes = np.empty(flat.size, dtype=np.uint8)
    for i in range(0, flat.size, _CHUNK):
        _codes_into(flat[i : i + _CHUNK], codes[i : i + _CHUNK])
    return codes


def _codes_into(values: Any, out: Any) -> None:
    """`e4m3fn_codes` of `values` (contiguous float32, one chunk) into `out` (uint8)."""
    import numpy as np

    bits = values.view(np.uint32)
    high = np.right_shift(bits, np.uint32(16)).astype(np.intp)
    nonzero_low, zero_low = _e4m3fn_tables()
    nonzero_low.take(high, out=out, mode="clip")  # in range: clip only skips the checks
    low = np.left_shift(bits, np.uint32(16))
    exact = np.flatnonzero(low == 0)
    if exact.size:
        out[exact] = zero_low.take(high[exact])


@functools.cache
def _e4m3fn_tables() -> tuple[Any, Any]:
    """The codes of every top-16-bit pattern, with the low 16 bits nonzero and zero: c10's
    `fp8e4m3fn_from_fp32_value` (torch's cast) on the values clamped to +-448."""
    import numpy as np

    if sys.byteorder != "little":  # pragma: no cover - every platform torch ships for
        raise RuntimeError("e4m3fn_codes reads float32 halves as a little-endian machine")
    high = np.arange(1 << 16, dtype=np.uint32) << np.uint32(16)
    tables = []
    for low in (1, 0):
        with np.errstate(invalid="ignore"):  # NaN patterns, each its own code
            value = np.clip((high | np.uint32(low)).view(np.float32), -FP8_MAX, FP8_MAX)
            sub = value.view(np.uint32) & np.uint32(0x7FFFFFFF)
            sub = (sub.view(np.float32) + np.float32(2.0**14)).view(np.uint32)
        bits = value.view(np.uint32)
        mag = bits & np.uint32(0x7FFFFFFF)
        # normal: drop 20 mantissa bits, rounding half to even, and rebias the exponent
        odd = (mag >> np.uint32(20)) & np.uint32(1)
        code = (mag + np.uint32((((7 - 127) << 23) + 0x7FFFF) & 0xFFFFFFFF) + odd) >> np.uint32(20)
        # subnormal (under 2**-6): rounded by a float addition of 2**14, as c10 does
        code = np.where(mag < np.uint32(121 << 23), sub - np.uint32(141 << 23), code)
        code = np.where(mag >= np.uint32(1087 << 20), np.uint32(0x7F), code)  # NaN
        tables.append((code | ((bits >> np.uint32(24)) & np.uint32(0x80))).astype(np.uint8))
    return tables[0], tables[1]


def _quantize_in_torch(
    scheme: str, band: Any, global_scale: torch.Tensor | None, scale_fmt: str
) -> QuantizedBand:
    """`quantize_band` for `nvfp4a16` and `fp8-block`'s `ue8m0` scales, in torch (their
    `log2` and E2M1 rounding are torch's own); the scales a torch tensor."""
    import torch

    band = torch.as_tensor(band)
    if scheme == "nvfp4a16":
        assert global_scale is not None
        return _quantize_nvfp4(band, global_scale)

    assert scheme == "fp8-block" and scale_fmt == "ue8m0", (scheme, scale_fmt)
    rows, cols = band.shape
    blocks = band.reshape(rows, cols // FP8_BLOCK, FP8_BLOCK)
    amax = blocks.abs().amax(dim=(0, 2))
    nonzero = amax > 0
    one = torch.ones_like(amax)
    scale = torch.where(nonzero, FP8_MAX / torch.where(nonzero, amax, one), one)
    inv = (1.0 / scale).to(torch.float32)
    inv = torch.pow(2.0, torch.ceil(torch.log2(inv.clamp(min=_FLOAT32_TINY))))
    inv = inv.to(torch.float8_e8m0fnu)
    scale = 1.0 / inv.to(torch.float32)
    inv = inv.view(torch.uint8)
    scaled = blocks * scale.reshape(1, -1, 1)
    quantized = scaled.clamp(min=-FP8_MAX, max=FP8_MAX).to(torch.float8_e4m3fn)
    data = quantized.reshape(rows, cols).view(torch.uint8).numpy().tobytes()
    return QuantizedBand(data, inv.reshape(1, -1))


def quantization_config(
    scheme: str, modules_to_not_convert: list[str], scale_fmt: str = "float"
) -> dict[str, Any]:
    """The `quantization_config` a release in `scheme` carries in its `config.json`, as the
    reference writes it: DeepSeek-V3's keys, which transformers' `FineGrainedFP8Config`
    reads (`fp8-block`); or what compressed-tensors' `ModelCompressor.update_config` writes
    for llm-compressor's `FP8_DYNAMIC` (`fp8-dynamic`) or `NVFP4A16` (`nvfp4a16`) scheme,
    `modules_to_not_convert` as its `ignore`."""
    if scheme == "fp8-block":
        return {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
            **({"scale_fmt": scale_fmt} if scale_fmt != "float" else {}),
            "modules_to_not_convert": modules_to_not_convert,
        }
    fp8 = {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None}
    if scheme == "fp8-dynamic":
        weights: dict[str, Any] = {**fp8, "strategy": "channel", "dynamic": False}
        inputs: dict[str, Any] | None = {**fp8, "strategy": "token", "dynamic": True}
        form = "float-quantized"
    else:
        assert scheme == "nvfp4a16", scheme
        weights = {
            "num_bits": 4, "type": "float", "symmetric": True, "group_size": FP4_GROUP,
            "strategy": "tensor_group", "dynamic": False, "scale_dtype": "torch.float8_e4m3fn",
        }  # fmt: skip
        inputs, form = None, "nvfp4-pack-quantized"
    return {
        "version": COMPRESSED_TENSORS_VERSION,
        "quant_method": "compressed-tensors",
        "sparsity_config": {},
        "transform_config": {},
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": weights,
                "input_activations": inputs,
                "output_activations": None,
                "format": None,
            }
        },
        "kv_cache_scheme": None,
        "format": form,
        "quantization_status": "compressed",
        "global_compression_ratio": None,
        "ignore": modules_to_not_convert,
        "moe_sparsity_config": None,
    }


def _quantize_nvfp4(band: torch.Tensor, global_scale: torch.Tensor) -> QuantizedBand:
    """`nvfp4a16` on one band: its packed codes and its `float8_e4m3fn` group scales (as
    uint8, `[rows, cols / 16]`); see the module docstring for the formula."""
    import torch

    rows, cols = band.shape
    groups = band.reshape(rows, cols // FP4_GROUP, FP4_GROUP)
    scale = groups.abs().amax(dim=2) / FP4_MAX
    scale = (global_scale * scale).clamp(min=-FP8_MAX, max=FP8_MAX)
    scale = scale.to(torch.float8_e4m3fn).to(torch.float32)
    scale = torch.where(scale == 0, torch.full_like(scale, _FP8_EPS), scale)
    stored = scale.to(torch.float8_e4m3fn).view(torch.uint8)  # exact: e4m3fn values
    x = groups / (scale / global_scale).unsqueeze(2)
    x = x.clamp(min=-FP4_MAX, max=FP4_MAX)
    negative = x < 0
    magnitude = x.abs_()
    codes = torch.zeros(magnitude.shape, dtype=torch.uint8)
    for bound, inclusive in _FP4_ROUNDING:
        codes += (magnitude >= bound) if inclusive else (magnitude > bound)
    codes |= negative.to(torch.uint8) << 3
    pairs = codes.reshape(rows, cols // 2, 2)
    packed = pairs[:, :, 0] | (pairs[:, :, 1] << 4)
    return QuantizedBand(packed.numpy().tobytes(), stored)
