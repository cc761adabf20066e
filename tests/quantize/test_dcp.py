"""`--quantize` on a PyTorch DCP save in FSDP2's layout (3 ranks: uneven row chunks, so a
band of 128 rows gathers pieces of several files), into several output files: every
quantized weight and scale bit-exact against each scheme's reference applied to the fp32
conversion of the same save (NVFP4's global scale from a first pass over the same pieces),
and verified against the save; and refused in one line where no config.json would carry the
`quantization_config`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from bench.forge import transformer_shapes
from bench.forge_dcp import forge_dcp_checkpoint
from tests.quantize.test_fp8_block import reference_quantize
from tests.quantize.test_fp8_dynamic import reference_compress
from tests.quantize.test_nvfp4 import reference_compress as reference_nvfp4
from zerosafe.config import ConvertOptions
from zerosafe.driver import convert_checkpoint
from zerosafe.errors import ConfigError
from zerosafe.verify.output import verify_output


@pytest.fixture(scope="module")
def dcp_save(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    """A forged 3-rank DCP save (its model files in `model/`, apart) and its fp32 conversion."""
    root = tmp_path_factory.mktemp("quant-dcp")
    (root / "model").mkdir()
    (root / "model" / "config.json").write_text('{"model_type": "llama"}')
    shapes = transformer_shapes(vocab=300, width=256, layers=2, ffn=640, kv_width=128)
    forge_dcp_checkpoint(root / "step-1", shapes, world_size=3, optimizer=False)
    convert_checkpoint(str(root / "step-1"), str(root / "fp32"), ConvertOptions(direct=True))
    return root / "step-1", load_file(str(root / "fp32" / "model.safetensors"))


@pytest.mark.parametrize("scheme", ["fp8-block", "fp8-dynamic", "nvfp4a16"])
def test_dcp_release_is_bit_exact(
    dcp_save: tuple[Path, dict[str, torch.Tensor]], scheme: str, tmp_path: Path
) -> None:
    source, masters = dcp_save
    options = ConvertOptions(
        dtype="bf16", quantize=scheme, direct=True, max_shard_size=300_000,
        model_files=str(source.parent / "model"),
    )  # fmt: skip
    summary = convert_checkpoint(str(source), str(tmp_path), options)
    assert len(summary.files) > 2
    ours: dict[str, torch.Tensor] = {}
    for file in tmp_path.glob("*.safetensors"):
        ours |= load_file(str(file))
    quantized = [n for n, t in ours.items() if t.dtype == torch.float8_e4m3fn]
    if scheme == "nvfp4a16":  # the global scale from a first pass over the gathered bands
        quantized = [n.removesuffix("_packed") for n in ours if n.endswith(".weight_packed")]
    assert len(quantized) >= 12
    for name in quantized:
        if scheme == "nvfp4a16":
            module = name.removesuffix("weight")
            want = {module + k: v for k, v in reference_nvfp4(masters[name]).items()}
        elif scheme == "fp8-block":
            want = reference_quantize(name, masters[name])
        else:
            compressed = reference_compress(masters[name])
            want = {name: compressed["weight"], f"{name}_scale": compressed["weight_scale"]}
        for key, value in want.items():
            assert ours[key].view(torch.uint8).equal(value.view(torch.uint8)), key
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "llama" and config["quantization_config"]
    report = verify_output(str(tmp_path), against=str(source))
    assert report["ok"], report["failures"]
    if scheme == "nvfp4a16":  # a changed FP4 code is out of E2M1's rounding bound
        from safetensors import safe_open

        name = quantized[0] + "_packed"
        (file,) = [f for f in tmp_path.glob("*.safetensors") if name in safe_open(f, "pt").keys()]
        data = bytearray(file.read_bytes())
        header = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])
        at = 8 + int.from_bytes(data[:8], "little") + header[name]["data_offsets"][0]
        data[at] ^= 0x04  # the low nibble's code, two to four E2M1 steps away
        file.write_bytes(bytes(data))
        report = verify_output(str(tmp_path), against=str(source))
        assert (name.removesuffix("_packed"), "values") in {
            (f["tensor"], f["check"]) for f in report["failures"]
        }, report["failures"]


def test_no_config_json_to_carry_the_quantization_config_is_refused(
    dcp_save: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    source, _ = dcp_save  # no config.json beside the save
    options = ConvertOptions(dtype="bf16", quantize="fp8-block", direct=True)
    with pytest.raises(ConfigError, match="found none to copy"):
        convert_checkpoint(str(source), str(tmp_path / "out"), options)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
    with pytest.raises(ConfigError, match="`copy_model_files` nothing is copied"):
        ConvertOptions(quantize="fp8-block", copy_model_files=False)


def test_nvfp4_on_in_features_not_divisible_by_16_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A model whose MLP down projection takes 200 in-features (not a multiple of 16, which
    compressed-tensors refuses too): exit 2 before anything is written, naming the weight and
    the `--quantize-ignore` pattern that leaves it unquantized; with that pattern it converts."""
    from zerosafe_app.cli import main as cli_main

    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text('{"model_type": "llama"}')
    shapes = transformer_shapes(vocab=64, width=64, layers=1, ffn=200, kv_width=32)
    forge_dcp_checkpoint(tmp_path / "step-1", shapes, world_size=2, optimizer=False)
    argv = ["convert", "--via", "local", str(tmp_path / "step-1"), str(tmp_path / "out"),
            "--dtype", "bf16", "--quantize", "nvfp4a16", "--model-files",
            str(tmp_path / "model")]  # fmt: skip
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "down_proj.weight' [64, 200] in groups of 16" in err, err
    assert "quantize_ignore` '" in err and not any((tmp_path / "out").iterdir())
    pattern = err.rsplit("quantize_ignore` '", 1)[1].split("'")[0]
    assert cli_main([*argv, "--quantize-ignore", pattern]) == 0
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "layers.0.mlp.down_proj" in config["quantization_config"]["ignore"]
