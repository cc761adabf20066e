"""`--quantize nvfp4a16` on plain values and a synthetic layout (issue 41): compressed-tensors'
`nvfp4-pack-quantized` format as llm-compressor's `NVFP4A16` writes it, the global scale, group
scales and packed FP4 codes bit-exact against the `compressed-tensors` library's own
`generate_gparam`, `calculate_qparams` and NVFP4 compressor, the `quantization_config` its
`ModelCompressor` writes, and the refusal of a weight whose in-features do not divide by 16."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
from compressed_tensors.quantization import preset_name_to_scheme
from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam

from tests.plan.test_build import _layout, _slot, _tensor
from tests.quantize.test_fp8_block import _llama_layout, edge_weight
from tests.quantize.test_fp8_dynamic import written_config
from zerosafe.config import ConvertOptions
from zerosafe.errors import ConfigError
from zerosafe.plan.build import plan_layout
from zerosafe.quantize import global_scale, quantize_band

SCHEME = preset_name_to_scheme("NVFP4A16", ["Linear"])


def reference_compress(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """What llm-compressor's NVFP4A16 writes for `weight`: the global scale from the whole
    tensor's min and max (`generate_gparam`), each group of 16's scale from its min and max
    through `calculate_qparams`, and compressed-tensors' NVFP4 compressor."""
    global_ = generate_gparam(weight.amin(), weight.amax())
    groups = weight.reshape(weight.shape[0], -1, 16)
    scale, zero_point = calculate_qparams(
        groups.amin(dim=2), groups.amax(dim=2), SCHEME.weights, global_scale=global_
    )
    state = {
        "weight": weight, "weight_scale": scale, "weight_global_scale": global_,
        "weight_zero_point": zero_point,
    }  # fmt: skip
    return dict(NVFP4PackedCompressor.compress(state, SCHEME))


def tie_weight() -> torch.Tensor:
    """[256, 384] float32 whose largest value is 6, so a group holding it is scaled by
    exactly 1: every E2M1 midpoint (the ties), negative zero, all-zero and tiny groups."""
    g = torch.Generator().manual_seed(7)
    w = (torch.randn(256, 384, generator=g) * 0.5).clamp(-5.9, 5.9)
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    w[3, 16:32] = torch.tensor([6.0, *ties, *[-t for t in ties], -0.0])
    w[4, :16] = 0.0
    w[4, 16:32] = -0.0
    w[6, 32:48] = 1e-30  # its scale rounds to zero in e4m3: the eps scale
    w[7, 48:64] = -1e-4  # codes that round to zero but keep their sign
    return w


@pytest.mark.parametrize("make", [tie_weight, edge_weight])
def test_bands_are_bit_exact_against_compressed_tensors(make: object) -> None:
    w = make()  # type: ignore[operator]
    want = reference_compress(w)
    assert set(want) == {"weight_packed", "weight_scale", "weight_global_scale"}
    whole = global_scale(w.abs().amax())
    assert whole.dtype == torch.float32 and whole.shape == (1,)
    assert whole.view(torch.int32).equal(want["weight_global_scale"].view(torch.int32))
    got = [quantize_band("nvfp4a16", w[r : r + 128], whole) for r in range(0, 256, 128)]
    packed = want["weight_packed"]
    assert packed.dtype == torch.uint8 and packed.shape == (256, 192)
    assert b"".join(b.data for b in got) == packed.numpy().tobytes()
    scales = torch.cat([b.scales for b in got])
    assert want["weight_scale"].dtype == torch.float8_e4m3fn
    assert scales.shape == want["weight_scale"].shape == (256, 24)
    assert scales.equal(want["weight_scale"].view(torch.uint8))


def test_plan_and_quantization_config_as_compressed_tensors_writes_them() -> None:
    plan = plan_layout(
        _llama_layout(),  # type: ignore[arg-type]
        ConvertOptions(dtype="bf16", quantize="nvfp4a16", max_shard_size=70_000),
    )
    got = [(t.name, t.out_dtype, t.shape, t.role) for t in plan.tensors if "layers" in t.name]
    q = "model.layers.0.self_attn.q_proj"
    assert got[:5] == [
        ("model.layers.0.input_layernorm.weight", "bfloat16", (256,), "param"),
        (f"{q}.weight_packed", "uint8", (256, 128), "packed"),
        (f"{q}.weight_scale", "float8_e4m3fn", (256, 16), "scale"),
        (f"{q}.weight_global_scale", "float32", (1,), "scale"),
        ("model.layers.0.self_attn.k_proj.weight_packed", "uint8", (64, 128), "packed"),
    ]
    shard = {t.name: t.shard for t in plan.tensors}
    assert shard[f"{q}.weight_packed"] == shard[f"{q}.weight_global_scale"]
    assert any("3 weight(s) quantized to nvfp4a16 (4.501 bits" in n for n in plan.notes)
    ignore = ["model.embed_tokens", "model.layers.0.mlp.gate", "lm_head"]
    assert plan.quantization == written_config(SCHEME, "nvfp4-pack-quantized", ignore)


def test_in_features_not_divisible_by_16_is_refused_naming_the_weight() -> None:
    """compressed-tensors refuses such a weight (`tensor column shape must be divisible by
    the given group_size`): so does the plan, before anything is written, with the
    `quantize_ignore` pattern that leaves it unquantized."""
    shapes = {"m.a.weight": (32, 64), "m.b.weight": (32, 40)}
    slots = [_slot(i, 0, 32 * s[1]) for i, s in enumerate(shapes.values())]
    tensors = {n: _tensor(n, s, ((i, 0, 32 * s[1], 0),)) for i, (n, s) in enumerate(shapes.items())}
    layout = _layout(tensors, slots)
    with pytest.raises(ConfigError, match=r"'m.b.weight' \[32, 40\] in groups of 16 .* found 40"):
        plan_layout(layout, ConvertOptions(dtype="bf16", quantize="nvfp4a16"))
    state = {"weight": torch.ones(32, 40), "weight_scale": torch.ones(32, 3),
             "weight_global_scale": torch.ones(1)}  # fmt: skip
    with pytest.raises(ValueError, match="divisble by the given group_size"):
        NVFP4PackedCompressor.compress(state, SCHEME)
    options = ConvertOptions(dtype="bf16", quantize="nvfp4a16", quantize_ignore=(r"m\.b\.weight",))
    plan = plan_layout(layout, options)
    assert [t.name for t in plan.tensors if t.quantized] == ["m.a.weight_packed"]
    assert plan.quantization is not None and plan.quantization["ignore"] == ["m.b"]


def test_dequantized_values_within_e2m1_rounding_bound_and_a_changed_code_is_not() -> None:
    import numpy as np

    from zerosafe.verify.quantized import fp4_values, within_fp4_bound

    w = tie_weight()[:128]
    whole = global_scale(w.abs().amax())
    band = quantize_band("nvfp4a16", w, whole)
    scales = band.scales.view(torch.float8_e4m3fn).to(torch.float32) / whole
    elements = np.arange(w.numel())
    per_element = scales.numpy()[elements // 384, elements % 384 // 16]
    master = w.reshape(-1).numpy()
    assert within_fp4_bound(fp4_values(band.data), per_element, master)
    for at in (0, 3 * 192 + 8, 100 * 192 + 77):  # a byte's low nibble: one code up or down
        changed = bytearray(band.data)
        code = changed[at] & 0x07
        changed[at] = (changed[at] & 0xF8) | (code + 1 if code < 4 else code - 2)
        assert not within_fp4_bound(fp4_values(bytes(changed)), per_element, master), at


def test_verify_checks_each_nvfp4_weight_has_its_scales(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    from zerosafe.io.storage import Storage
    from zerosafe.verify.tensors import verify_shard

    w = torch.randn(128, 256)
    whole = global_scale(w.abs().amax())
    band = quantize_band("nvfp4a16", w, whole)
    packed = torch.frombuffer(bytearray(band.data), dtype=torch.uint8).reshape(128, 128)
    scale = band.scales.view(torch.float8_e4m3fn)
    zero = scale.clone()
    zero[5, 3] = 0.0
    good = {"m.weight_packed": packed, "m.weight_scale": scale, "m.weight_global_scale": whole}
    cases = {
        "good": good,
        "zero": {**good, "m.weight_scale": zero},
        "nan": {**good, "m.weight_global_scale": torch.tensor([float("nan")])},
        "shape": {**good, "m.weight_scale": scale[:, :8].contiguous()},
        "fp32": {**good, "m.weight_scale": scale.to(torch.float32)},
        "missing": {"m.weight_packed": packed, "m.weight_scale": scale},
    }
    reports = {}
    for case, tensors in cases.items():
        save_file(tensors, str(tmp_path / f"{case}.safetensors"))
        reports[case] = verify_shard(
            Storage(), str(tmp_path / f"{case}.safetensors"), allow_nonfinite=True
        )
    assert reports["good"].ok and reports["good"].quantized == {
        "tensors": 1, "params": 128 * 256, "bytes": 128 * 128 + 128 * 16 + 4,
    }  # fmt: skip
    for case in ("zero", "nan", "shape", "fp32", "missing"):
        checks = [(f.tensor, f.check) for f in reports[case].failures]
        assert checks and all(check == "scales" for _, check in checks), (case, checks)


def test_verify_refuses_weights_the_quantization_config_does_not_describe(tmp_path: Path) -> None:
    """The failure users report: an "NVFP4" release that holds FP8 (8.x bits a parameter)
    loads without an error. verify reads `config.json`'s `quantization_config` and checks the
    bits per parameter its format implies, its group size and its ignore list."""
    import json

    from zerosafe.io.storage import Storage
    from zerosafe.quantize import quantization_config
    from zerosafe.verify.quantized import check_scheme

    fp8 = {"m.weight": ("model.safetensors", {"dtype": "float8_e4m3fn", "shape": [64, 256]}),
           "m.weight_scale": ("model.safetensors", {"dtype": "float32", "shape": [64, 1]})}  # fmt: skip
    nvfp4 = {
        "m.weight_packed": ("model.safetensors", {"dtype": "uint8", "shape": [64, 128]}),
        "m.weight_scale": ("model.safetensors", {"dtype": "float8_e4m3fn", "shape": [64, 16]}),
        "m.weight_global_scale": ("model.safetensors", {"dtype": "float32", "shape": [1]}),
    }
    bits = {"fp8": {"tensors": 1, "params": 16384, "bits_per_parameter": 8.125},
            "nvfp4": {"tensors": 1, "params": 16384, "bits_per_parameter": 4.502}}  # fmt: skip

    def check(scheme: str | None, stored: object, quantized: dict[str, object]) -> list[str]:
        config = {"model_type": "llama"}
        if scheme is not None:
            config["quantization_config"] = quantization_config(scheme, ["lm_head"])  # type: ignore[assignment]
        (tmp_path / "config.json").write_text(json.dumps(config))
        found = check_scheme(Storage(), str(tmp_path), stored, quantized)  # type: ignore[arg-type]
        return [detail for _, _, detail in found]

    assert check("nvfp4a16", nvfp4, bits["nvfp4"]) == []
    assert check("fp8-dynamic", fp8, bits["fp8"]) == []
    assert check(None, {}, {}) == []
    (wrong,) = check("nvfp4a16", fp8, bits["fp8"])
    assert "says nvfp4-pack-quantized, expected 4.5 to 4.6 bits" in wrong and "8.125" in wrong
    (wrong,) = check("fp8-block", nvfp4, bits["nvfp4"])
    assert "says fp8, expected 8.0" in wrong
    (wrong,) = check(None, nvfp4, bits["nvfp4"])
    assert "no `quantization_config`" in wrong
    (wrong,) = check("nvfp4a16", {}, {})
    assert "found 0" in wrong  # a release that claims NVFP4 and holds no quantized weight
    (tmp_path / "config.json").write_text(
        json.dumps({"quantization_config": quantization_config("nvfp4a16", ["m"])})
    )
    (ignored,) = check_scheme(Storage(), str(tmp_path), nvfp4, bits["nvfp4"])  # type: ignore[arg-type]
    assert ignored[1] == "m.weight_packed" and "lists 'm' as not converted" in ignored[2]
