"""Weight-only quantization on the way out: the FP8 128x128 block format (`--quantize fp8-block`).

The format is the one transformers' fine-grained FP8 quantizer writes (`Fp8Quantize` in
`transformers/integrations/finegrained_fp8.py`; the layout of the DeepSeek-V3 and Qwen FP8
releases, which vLLM and SGLang load): a 2-D weight whose rows and columns both divide by 128
becomes `float8_e4m3fn` (safetensors `F8_E4M3`), and beside it `<module>.weight_scale_inv`,
float32, one value per 128x128 block (`[rows / 128, cols / 128]`). Per block, in float32:
`amax = max|w|`, `scale = 448 / amax` (448: the largest finite e4m3fn value), `inv = 1 / scale`
(stored), `q = e4m3fn(clamp(w * scale, -448, 448))`, rounded to nearest even; an all-zero
block gets `scale = inv = 1`. A weight whose shape does not divide by the block is left as it
is, as the reference leaves it; the plan lists it in `modules_to_not_convert`.

A block needs 128 whole rows, so a weight is quantized a band of 128 rows at a time
(`quantize_band`): the merge reads `128 * cols` source elements, writes the band's bytes and
keeps the band's scales, which are written as the next tensor once the weight is done.

Which tensors are quantized is decided in one place, `ConvertOptions.quantize_skip_reason`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = [
    "FP8_BLOCK",
    "FP8_DTYPE",
    "FP8_MAX",
    "QUANTIZE_SCHEMES",
    "SCALE_DTYPE",
    "SCALE_SUFFIX",
    "SKIPPED_MODULE",
    "QuantizedBand",
    "dequantize_band",
    "quantization_config",
    "quantize_band",
    "scale_name",
    "scale_shape",
]

QUANTIZE_SCHEMES = ("fp8-block",)
"""What `--quantize` writes."""
FP8_BLOCK = 128
"""Rows and columns of one block (`weight_block_size: [128, 128]`)."""
FP8_DTYPE = "float8_e4m3fn"
FP8_MAX = 448.0
"""The largest finite `float8_e4m3fn` value (`torch.finfo(torch.float8_e4m3fn).max`)."""
SCALE_DTYPE = "float32"
SCALE_SUFFIX = "_scale_inv"
SKIPPED_MODULE = re.compile(
    r"(^|\.)(embed_tokens|embed_in|embed_out|embeddings?|wte|wpe|word_embeddings|lm_head"
    r"|[^.]*norm[^.]*|gate|router|[^.]*_router|shared_expert_gate)$"
)
"""Module names (the tensor name without `.weight`) never quantized, as the reference recipes
leave them: embeddings, the output head, norms, and MoE routers and gates (`mlp.gate`; not
`gate_proj`, a linear layer)."""


def scale_name(weight_name: str) -> str:
    """The scale tensor's name: `<module>.weight_scale_inv` (the reference's rule)."""
    return weight_name + SCALE_SUFFIX


def scale_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """`[rows / 128, cols / 128]` of a weight that divides into blocks."""
    rows, cols = shape
    return rows // FP8_BLOCK, cols // FP8_BLOCK


def block_skip_reason(shape: tuple[int, ...]) -> str | None:
    """Why a 2-D weight of `shape` cannot be cut into 128x128 blocks, or None."""
    if len(shape) != 2:
        return f"a {len(shape)}-D tensor, not a 2-D weight"
    if shape[0] % FP8_BLOCK or shape[1] % FP8_BLOCK:
        return (
            f"shape {list(shape)} does not divide into {FP8_BLOCK}x{FP8_BLOCK} blocks "
            "(left unquantized, as transformers' quantizer leaves it)"
        )
    return None


@dataclass(frozen=True, slots=True)
class QuantizedBand:
    """One band of up to 128 rows, quantized: its `float8_e4m3fn` bytes (row-major) and its
    float32 `weight_scale_inv` row (one value per block of the band)."""

    data: bytes
    scales: Any
    """A float32 torch tensor of `cols / 128` values."""


def quantize_band(band: torch.Tensor) -> QuantizedBand:
    """Quantize `band` (float32, `[rows <= 128, cols]`, cols a multiple of 128) as one row of
    128x128 blocks, computing in float32 as the reference does."""
    import torch

    rows, cols = band.shape
    blocks = band.reshape(rows, cols // FP8_BLOCK, FP8_BLOCK)
    amax = blocks.abs().amax(dim=(0, 2))
    nonzero = amax > 0
    one = torch.ones_like(amax)
    scale = torch.where(nonzero, FP8_MAX / torch.where(nonzero, amax, one), one)
    inv = (1.0 / scale).to(torch.float32)
    scaled = blocks * scale.reshape(1, -1, 1)
    quantized = scaled.clamp(min=-FP8_MAX, max=FP8_MAX).to(torch.float8_e4m3fn)
    return QuantizedBand(quantized.reshape(rows, cols).view(torch.uint8).numpy().tobytes(), inv)


def dequantize_band(data: bytes, scales: torch.Tensor, cols: int) -> torch.Tensor:
    """The float32 values a band's bytes and scales stand for: `q * inv`, block by block."""
    import torch

    q = torch.frombuffer(bytearray(data), dtype=torch.float8_e4m3fn).to(torch.float32)
    blocks = q.reshape(-1, cols // FP8_BLOCK, FP8_BLOCK)
    return (blocks * scales.reshape(1, -1, 1)).reshape(-1, cols)


def quantization_config(scheme: str, modules_to_not_convert: list[str]) -> dict[str, Any]:
    """The `quantization_config` a release in `scheme` carries in its `config.json`, as the
    reference writes it (DeepSeek-V3's keys; transformers' `FineGrainedFP8Config` reads it)."""
    assert scheme == "fp8-block", scheme
    return {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
        "modules_to_not_convert": modules_to_not_convert,
    }
