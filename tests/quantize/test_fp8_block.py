"""`--quantize fp8-block` on plain values and synthetic layouts (issue 41): the block math
bit-exact against transformers' own `Fp8Quantize`, the plan's tensors, and the refusals."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import FineGrainedFP8Config
from transformers.integrations.finegrained_fp8 import Fp8Quantize
from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

from tests.plan.test_build import _layout, _slot, _tensor
from zerosafe.config import ConvertOptions
from zerosafe.errors import ConfigError
from zerosafe.plan.build import plan_layout
from zerosafe.quantize import quantize_band
from zerosafe_app.cli import main as cli_main


def reference_quantize(name: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """transformers' fine-grained FP8 quantizer, as `from_pretrained(quantization_config=
    FineGrainedFP8Config())` applies it to each weight."""
    op = Fp8Quantize(FineGrainedFP8HfQuantizer(FineGrainedFP8Config()))
    return dict(op.convert({name: weight}))


def edge_weight() -> torch.Tensor:
    """[256, 384] float32 with the blocks that matter: all zero, a denormal amax (the scale
    overflows), values spanning e4m3's subnormals, a NaN-free wide block, negative zeros."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(256, 384, generator=g) * 0.02
    w[:128, :128] = 0.0
    w[:128, 128:256] = -0.0
    w[128:, :128] = torch.randn(128, 128, generator=g) * 1e-39  # float32 denormals
    w[128:, 128:256] *= torch.logspace(-12, 3, 128)  # subnormal fp8 after scaling
    w[5, 300] = 3.0e38  # near float32's max
    return w


def test_bands_are_bit_exact_against_transformers_quantizer() -> None:
    w = edge_weight()
    want = reference_quantize("m.weight", w)
    got = [quantize_band("fp8-block", w[r : r + 128]) for r in range(0, 256, 128)]
    data = b"".join(band.data for band in got)
    assert data == want["m.weight"].view(torch.uint8).numpy().tobytes()
    scales = torch.from_numpy(np.concatenate([band.scales for band in got]))
    assert scales.dtype == want["m.weight_scale_inv"].dtype == torch.float32
    assert scales.view(torch.int32).equal(want["m.weight_scale_inv"].view(torch.int32))


def _llama_layout() -> object:
    shapes = {
        "model.embed_tokens.weight": (53, 256),
        "model.layers.0.input_layernorm.weight": (256,),
        "model.layers.0.self_attn.q_proj.weight": (256, 256),
        "model.layers.0.self_attn.k_proj.weight": (64, 256),
        "model.layers.0.self_attn.q_proj.bias": (256,),
        "model.layers.0.mlp.gate.weight": (128, 256),
        "model.layers.0.mlp.down_proj.weight": (256, 384),
        "lm_head.weight": (128, 256),
    }
    slots, tensors = [], {}
    for i, (name, shape) in enumerate(shapes.items()):
        numel = 1
        for s in shape:
            numel *= s
        slots.append(_slot(i, 0, numel))
        tensors[name] = _tensor(name, shape, ((i, 0, numel, 0),))
    return _layout(tensors, slots)


def test_plan_quantizes_2d_linear_weights_and_lists_the_rest() -> None:
    plan = plan_layout(
        _llama_layout(),  # type: ignore[arg-type]
        ConvertOptions(dtype="bf16", quantize="fp8-block", max_shard_size=70_000),
    )
    got = [(t.name, t.out_dtype, t.shape, t.shard) for t in plan.tensors]
    assert got == [
        ("model.embed_tokens.weight", "bfloat16", (53, 256), 0),
        ("model.layers.0.input_layernorm.weight", "bfloat16", (256,), 0),
        ("model.layers.0.self_attn.q_proj.weight", "float8_e4m3fn", (256, 256), 1),
        ("model.layers.0.self_attn.q_proj.weight_scale_inv", "float32", (2, 2), 1),
        ("model.layers.0.self_attn.k_proj.weight", "bfloat16", (64, 256), 2),
        ("model.layers.0.self_attn.q_proj.bias", "bfloat16", (256,), 2),
        ("model.layers.0.mlp.gate.weight", "bfloat16", (128, 256), 3),
        ("model.layers.0.mlp.down_proj.weight", "float8_e4m3fn", (256, 384), 4),
        ("model.layers.0.mlp.down_proj.weight_scale_inv", "float32", (2, 3), 4),
        ("lm_head.weight", "bfloat16", (128, 256), 5),
    ]  # a weight and its scales share a file; 1 byte per element plus 4 per block
    assert plan.shards[1].data_bytes == 256 * 256 + 4 * 4
    assert plan.quantization == {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
        "modules_to_not_convert": [
            "model.embed_tokens", "model.layers.0.self_attn.k_proj", "model.layers.0.mlp.gate",
            "lm_head",
        ],
    }  # fmt: skip
    assert any("does not divide into 128x128 blocks" in n and "k_proj" in n for n in plan.notes)
    assert any("2 weight(s) quantized" in n and "8.00" in n for n in plan.notes)
    ignored = plan_layout(
        _llama_layout(),  # type: ignore[arg-type]
        ConvertOptions(dtype="bf16", quantize="fp8-block", quantize_ignore=("down_proj",)),
    )
    assert [t.name for t in ignored.tensors if t.out_dtype == "float8_e4m3fn"] == [
        "model.layers.0.self_attn.q_proj.weight"
    ]
    assert "model.layers.0.mlp.down_proj" in ignored.quantization["modules_to_not_convert"]  # type: ignore[index]


def test_job_key_changes_with_quantize_and_only_then() -> None:
    layout = _llama_layout()
    plain = plan_layout(layout, ConvertOptions(dtype="bf16"))  # type: ignore[arg-type]
    assert "quantize" not in ConvertOptions(dtype="bf16").identity()  # old keys unchanged
    assert plain.quantization is None
    keys = {
        plan_layout(layout, ConvertOptions(dtype="bf16", **kw)).job_key  # type: ignore[arg-type]
        for kw in ({}, {"quantize": "fp8-block"},
                   {"quantize": "fp8-block", "quantize_ignore": ("q_proj",)})
    }  # fmt: skip
    assert len(keys) == 3


@pytest.mark.parametrize(
    ("kw", "why"),
    [
        ({"quantize": "int4"}, "`quantize` must be one of fp8-block"),
        ({"quantize": "fp8-block", "adapter": True}, "give one or the other"),
        ({"quantize": "fp8-block", "dtype": "fp16"}, "not in fp16"),
        ({"quantize_ignore": ("x",)}, "`quantize` is not given"),
        ({"quantize": "fp8-block", "quantize_ignore": ("(",)}, "not a regular expression"),
    ],
)
def test_options_refused(kw: dict[str, object], why: str) -> None:
    with pytest.raises(ConfigError, match=why):
        ConvertOptions(**kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "args",
    [
        ["--to", "universal", "--dtype", "fp32", "--quantize", "fp8-block"],
        ["--to", "dcp", "--dtype", "fp32", "--quantize", "fp8-block"],
        ["--quantize", "fp8-block", "--adapter"],
        ["--quantize", "fp8-block", "--dtype", "fp16"],
        ["--quantize", "fp8-dynamic", "--no-model-files"],
    ],
)
def test_cli_refuses_in_one_line(
    args: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = cli_main(
        ["convert", "--via", "local", str(tmp_path / "ckpt"), str(tmp_path / "out"), *args]
    )
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "`--quantize`" in err, err
    assert not (tmp_path / "out").exists()


def test_verify_checks_each_fp8_weight_has_positive_finite_scales(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    from zerosafe.io.storage import Storage
    from zerosafe.verify.tensors import verify_shard

    band = quantize_band("fp8-block", torch.randn(128, 256))
    weight = torch.frombuffer(bytearray(band.data), dtype=torch.float8_e4m3fn).reshape(128, 256)
    cases = {
        "good": {
            "m.weight": weight,
            "m.weight_scale_inv": torch.from_numpy(band.scales).reshape(1, 2),
        },
        "zero": {"m.weight": weight, "m.weight_scale_inv": torch.tensor([[1.0, 0.0]])},
        "inf": {"m.weight": weight, "m.weight_scale_inv": torch.tensor([[1.0, float("inf")]])},
        "shape": {"m.weight": weight, "m.weight_scale_inv": torch.ones(2, 1)},
        "missing": {"m.weight": weight},
    }
    reports = {}
    for case, tensors in cases.items():
        save_file(tensors, str(tmp_path / f"{case}.safetensors"))
        reports[case] = verify_shard(
            Storage(), str(tmp_path / f"{case}.safetensors"), allow_nonfinite=True
        )
    assert reports["good"].ok and reports["good"].quantized == {
        "tensors": 1, "params": 128 * 256, "bytes": 128 * 256 + 8,
    }  # fmt: skip
    for case in ("zero", "inf", "shape", "missing"):
        checks = [(f.tensor, f.check) for f in reports[case].failures]
        assert checks and all(check == "scales" for _, check in checks), (case, checks)


def test_dequantized_values_within_e4m3_rounding_bound_and_a_changed_step_is_not() -> None:
    from zerosafe.verify.quantized import within_rounding_bound

    w = torch.randn(128, 384) * torch.logspace(-8, 2, 384)  # normals and subnormals of e4m3
    w[:, :128] = 0.0
    band = quantize_band("fp8-block", w)
    elements = np.arange(w.numel())
    master = w.reshape(-1).numpy()
    scales = band.scales[0, elements % 384 // 128]
    assert within_rounding_bound(band.data, scales, master)
    for at in (5, 128 + 77, 384 * 100 + 300, 384 * 127 + 383):  # a zero block, then others
        one_step = bytearray(band.data)
        one_step[at] = (one_step[at] & 0x80) | ((one_step[at] & 0x7F) ^ 1)  # a neighbour
        assert not within_rounding_bound(bytes(one_step), scales, master), at


def test_quantize_options_cross_the_flow_edge_unchanged(tmp_path: Path) -> None:
    """The command's `--quantize` and `--quantize-ignore` reach the flow's job config as the
    same `ConvertOptions` (the one field list: command, flow parameters, engine)."""
    from zerosafe_app.cli import _options, _parser
    from zerosafe_app.flows.config import flow_parameters, load_job_config

    argv = ["convert", "/ckpt", str(tmp_path / "out"), "--dtype", "bf16", "--quantize",
            "fp8-dynamic", "--quantize-ignore", "down_proj", "--quantize-ignore", "o_proj"]  # fmt: skip
    args = _parser().parse_args(argv)
    options = _options(args)
    assert options.quantize == "fp8-dynamic"
    assert options.quantize_ignore == ("down_proj", "o_proj")
    params = flow_parameters("/ckpt", str(tmp_path / "out"), options, mode=args.mode)
    assert load_job_config(None, **params).options() == options


def test_a_band_that_does_not_fit_the_memory_budget_is_refused_at_plan_time() -> None:
    """A band of 128 rows is what a quantizing merge holds (`BAND_BYTES_PER_COLUMN` a column):
    a weight too wide for a task's share of `memory` is refused before anything is written."""
    memory = 40 * 2**20  # the smallest budget: one task of 40 MiB, 20480 columns at most
    for cols, fits in ((16384, True), (24576, False)):
        layout = _layout(
            {"m.weight": _tensor("m.weight", (128, cols), ((0, 0, 128 * cols, 0),))},
            [_slot(0, 0, 128 * cols)],
        )
        options = ConvertOptions(dtype="bf16", quantize="fp8-block", memory=memory)
        if fits:
            assert plan_layout(layout, options).tensors[0].out_dtype == "float8_e4m3fn"
            continue
        with pytest.raises(ConfigError, match=r"'m.weight' \[128, 24576\] a band of 128 rows"):
            plan_layout(layout, options)


def test_a_model_no_weight_of_which_the_scheme_takes_is_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """fp8-block on a ZeRO-3 Llama of hidden size 192 (no linear weight cuts into 128x128
    blocks): one line naming a weight and why, exit 2, nothing written; the plan refuses it
    too. fp8-dynamic (per-channel scales, any 2-D shape) takes the same checkpoint."""
    import json

    from bench import forge as F
    from bench.run_quantize import llama_config, llama_shapes

    dims = {"width": 192, "ffn": 384, "kv": 64, "layers": 1, "vocab": 100}
    ckpt = tmp_path / "ckpt"
    F.forge_checkpoint(ckpt, shapes=llama_shapes(dims), stage=3, world_size=2, tied=False,
                       buffers=())  # fmt: skip
    config = {**llama_config(dims), "num_attention_heads": 3, "num_key_value_heads": 1}
    (ckpt / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    argv = ["convert", str(ckpt), str(out), "--via", "local", "--dtype", "bf16", "--quantize"]
    assert cli_main([*argv, "fp8-block"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "would quantize none of the model's 9 2-D weight(s)" in err
    assert "'model.layers.0.self_attn.q_proj.weight' is not quantized" in err, err
    assert "[192, 192] does not divide into 128x128 blocks" in err, err
    assert not out.exists() or not any(p.name.endswith(".safetensors") for p in out.rglob("*"))
    with pytest.raises(ConfigError, match="would quantize none"):
        plan_layout(
            _layout({"m.weight": _tensor("m.weight", (64, 256), ((0, 0, 64 * 256, 0),))},
                    [_slot(0, 0, 64 * 256)]),
            ConvertOptions(dtype="bf16", quantize="fp8-block"),
        )  # fmt: skip
    assert cli_main([*argv, "fp8-dynamic", "-q"]) == 0
    assert json.loads((out / "config.json").read_text())["quantization_config"]["ignore"] == [
        "model.embed_tokens", "lm_head"
    ]  # fmt: skip


def test_e4m3fn_codes_are_torchs_clamp_and_cast_on_every_kind_of_float32() -> None:
    """The table lookup against `clamp(-448, 448).to(float8_e4m3fn)`: 4M random bit patterns
    (NaNs, infinities, subnormals of both formats), a quarter with their low 16 bits zero
    (the round-half-even ties), and a dense sweep of e4m3's range."""
    from zerosafe.quantize import e4m3fn_codes

    bits = np.random.default_rng(3).integers(0, 2**32, size=4_000_000, dtype=np.uint64)
    bits = bits.astype(np.uint32)
    bits[::4] &= np.uint32(0xFFFF0000)
    values = np.concatenate([bits.view(np.float32), np.linspace(-500, 500, 2_000_001,
                                                                dtype=np.float32)])  # fmt: skip
    want = torch.from_numpy(values.copy()).clamp(-448, 448).to(torch.float8_e4m3fn)
    assert np.array_equal(e4m3fn_codes(values), want.view(torch.uint8).numpy())


def test_non_finite_blocks_quantize_as_the_reference_does() -> None:
    """A NaN or an infinity in a block (kept only with `--allow-nonfinite`): the same bytes
    and scales as transformers' quantizer, not an error."""
    w = edge_weight()
    w[3, 7], w[200, 300] = float("nan"), float("-inf")
    want = reference_quantize("m.weight", w)
    got = [quantize_band("fp8-block", w[r : r + 128]) for r in range(0, 256, 128)]
    assert b"".join(b.data for b in got) == want["m.weight"].view(torch.uint8).numpy().tobytes()
    scales = np.concatenate([b.scales for b in got])
    assert np.array_equal(scales.view(np.int32), want["m.weight_scale_inv"].view(torch.int32))
