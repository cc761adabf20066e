"""`--quantize fp8-dynamic` on plain values and a synthetic layout (issue 41): compressed-tensors'
`float-quantized` format as llm-compressor's `FP8_DYNAMIC` writes it, the per-channel math
bit-exact against the `compressed-tensors` library's own `calculate_qparams` and compressor,
and the `quantization_config` its `ModelCompressor` writes."""

from __future__ import annotations

from typing import Any

import compressed_tensors  # a test dependency (the `test` extra): a missing one fails
import numpy as np
import torch
from compressed_tensors.compressors.naive_quantized.base import FloatQuantizationCompressor
from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme
from compressed_tensors.quantization.utils.helpers import calculate_qparams

from tests.quantize.test_fp8_block import _llama_layout, edge_weight
from zerosafe.config import ConvertOptions
from zerosafe.plan.build import plan_layout
from zerosafe.quantize import COMPRESSED_TENSORS_VERSION, quantize_band
from zerosafe.verify.quantized import within_rounding_bound

SCHEME = preset_name_to_scheme("FP8_DYNAMIC", ["Linear"])


def written_config(scheme: Any, form: str, ignore: list[str]) -> dict[str, Any]:
    """The `quantization_config` compressed-tensors' `ModelCompressor.update_config` writes
    for `scheme` in format `form`, compressed, leaving `ignore` unquantized."""
    config = QuantizationConfig(
        config_groups={"group_0": scheme},
        format=form,
        quantization_status="compressed",
        ignore=ignore,
    )
    return {
        "version": compressed_tensors.__version__,
        "quant_method": "compressed-tensors",
        "sparsity_config": {},
        "transform_config": {},
        **config.model_dump(exclude=["quant_method"]),  # type: ignore[arg-type]
    }


def reference_compress(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """What llm-compressor's FP8_DYNAMIC writes for `weight`: its min-max observer's
    per-channel statistics through compressed-tensors' `calculate_qparams`, the module's zero
    point as llm-compressor initializes it, and the `float-quantized` compressor."""
    low = weight.amin(dim=1, keepdim=True)
    high = weight.amax(dim=1, keepdim=True)
    scale, zero_point = calculate_qparams(low, high, SCHEME.weights)
    state = {"weight": weight, "weight_scale": scale, "weight_zero_point": zero_point}
    return dict(FloatQuantizationCompressor.compress(state, SCHEME))


def test_bands_are_bit_exact_against_compressed_tensors() -> None:
    w = edge_weight()
    w[7] = 0.0  # an all-zero row: compressed-tensors' eps scale
    w[9, :5] = -0.0
    want = reference_compress(w)
    assert set(want) == {"weight", "weight_scale"}  # the symmetric zero point is dropped
    got = [quantize_band("fp8-dynamic", w[r : r + 128]) for r in range(0, 256, 128)]
    assert b"".join(b.data for b in got) == want["weight"].view(torch.uint8).numpy().tobytes()
    scales = torch.from_numpy(np.concatenate([b.scales for b in got]))
    assert scales.dtype == want["weight_scale"].dtype == torch.float32
    assert scales.shape == want["weight_scale"].shape == (256, 1)
    assert scales.view(torch.int32).equal(want["weight_scale"].view(torch.int32))
    elements = np.arange(w.numel())
    per_element = scales.numpy()[elements // 384, 0]
    data = b"".join(b.data for b in got)
    sane = np.isfinite(per_element) & (per_element > 1e-30)  # the denormal block is not
    master = w.reshape(-1).numpy()
    assert within_rounding_bound(
        bytes(np.frombuffer(data, np.uint8)[sane]), per_element[sane], master[sane]
    )


def test_plan_and_quantization_config_as_compressed_tensors_writes_them() -> None:
    plan = plan_layout(
        _llama_layout(),  # type: ignore[arg-type]
        ConvertOptions(dtype="bf16", quantize="fp8-dynamic"),
    )
    got = {t.name: (t.out_dtype, t.shape) for t in plan.tensors if "self_attn" in t.name}
    assert got == {
        "model.layers.0.self_attn.q_proj.weight": ("float8_e4m3fn", (256, 256)),
        "model.layers.0.self_attn.q_proj.weight_scale": ("float32", (256, 1)),
        "model.layers.0.self_attn.k_proj.weight": ("float8_e4m3fn", (64, 256)),  # any shape
        "model.layers.0.self_attn.k_proj.weight_scale": ("float32", (64, 1)),
        "model.layers.0.self_attn.q_proj.bias": ("bfloat16", (256,)),
    }
    ignore = ["model.embed_tokens", "model.layers.0.mlp.gate", "lm_head"]
    assert plan.quantization == written_config(SCHEME, "float-quantized", ignore)
    assert COMPRESSED_TENSORS_VERSION == compressed_tensors.__version__
