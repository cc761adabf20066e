"""`--quantize-like DIR` (issue 41): the `quantization_config` the references write
(transformers' `FineGrainedFP8Config`, compressed-tensors' `QuantizationConfig` for
llm-compressor's presets) read back into the same scheme, scale format and ignore list; what
cannot be reproduced refused in one line naming the field; a folder without one refused with
exit 2; the config read from S3 (moto); and fp8-block's `ue8m0` scales bit-exact against
transformers' `Fp8Quantize(scale_fmt="ue8m0")`."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme
from transformers import FineGrainedFP8Config
from transformers.integrations.finegrained_fp8 import Fp8Quantize
from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

from tests.io.s3.conftest import aws_environment, aws_home, bucket, moto  # noqa: F401 - fixtures
from tests.io.s3.support import MotoServer, upload_folder
from tests.quantize.test_fp8_block import edge_weight
from zerosafe.config import ConvertOptions
from zerosafe.errors import ConfigError
from zerosafe.io.storage import Storage
from zerosafe.quantize import quantization_config, quantize_band
from zerosafe.quantize_like import QuantizeLike, quantize_like, read_quantize_like
from zerosafe_app.cli import main as cli_main


def transformers_config(**kw: Any) -> dict[str, Any]:
    """What `FineGrainedFP8Config` writes into a config.json."""
    return dict(json.loads(FineGrainedFP8Config(**kw).to_json_string()))


def compressed_tensors_config(preset: str, form: str, ignore: list[str]) -> dict[str, Any]:
    """What llm-compressor's `preset` writes into a config.json (compressed-tensors'
    `ModelCompressor.update_config`)."""
    config = QuantizationConfig(
        config_groups={"group_0": preset_name_to_scheme(preset, ["Linear"])}, format=form,
        quantization_status="compressed", ignore=ignore,
    )  # fmt: skip
    return {"quant_method": "compressed-tensors", **json.loads(config.model_dump_json())}


def test_the_references_configs_read_back_as_their_scheme() -> None:
    skip = ["lm_head", "model.layers.0.mlp.down_proj"]
    patterns = (r"^lm_head\.weight$", r"^model\.layers\.0\.mlp\.down_proj\.weight$")
    got = {
        "fp8": quantize_like(transformers_config(modules_to_not_convert=skip), where="c"),
        "ue8m0": quantize_like(
            transformers_config(modules_to_not_convert=skip, scale_fmt="ue8m0"), where="c"
        ),
        "dynamic": quantize_like(
            compressed_tensors_config("FP8_DYNAMIC", "float-quantized", skip), where="c"
        ),
        "nvfp4": quantize_like(
            compressed_tensors_config("NVFP4A16", "nvfp4-pack-quantized", skip), where="c"
        ),
    }
    assert got == {
        "fp8": QuantizeLike(quantize="fp8-block", ignore=patterns),
        "ue8m0": QuantizeLike(quantize="fp8-block", scale_fmt="ue8m0", ignore=patterns),
        "dynamic": QuantizeLike(quantize="fp8-dynamic", ignore=patterns),
        "nvfp4": QuantizeLike(quantize="nvfp4a16", ignore=patterns),
    }
    for scheme, fmt in (("fp8-block", "float"), ("fp8-block", "ue8m0"),
                        ("fp8-dynamic", "float"), ("nvfp4a16", "float")):  # fmt: skip
        ours = quantization_config(scheme, skip, fmt)
        assert quantize_like(ours, where="c") == QuantizeLike(
            quantize=scheme, scale_fmt=fmt, ignore=patterns
        )
    regex = quantize_like(
        compressed_tensors_config("FP8_DYNAMIC", "float-quantized", ["re:.*mlp.gate$"]),
        where="c",
    )  # compressed-tensors' `re:` entries match a module name from its start
    (pattern,) = regex.ignore
    assert re.search(pattern, "model.layers.3.mlp.gate.weight")
    assert not re.search(pattern, "model.layers.3.mlp.gate_proj.weight")


@pytest.mark.parametrize(
    ("config", "field"),
    [
        (transformers_config(weight_block_size=(64, 64)), "weight_block_size"),
        (transformers_config(activation_scheme="static"), "activation_scheme"),
        ({**transformers_config(), "fmt": "e5m2"}, "fmt"),
        ({"quant_method": "gptq", "bits": 4}, "quant_method"),
        (compressed_tensors_config("W4A16", "pack-quantized", []), "format"),
        (compressed_tensors_config("NVFP4", "nvfp4-pack-quantized", []),
         "config_groups.group_0.input_activations"),
        (compressed_tensors_config("FP8", "float-quantized", []), "config_groups.group_0.weights"),
        ({**compressed_tensors_config("FP8_DYNAMIC", "float-quantized", []),
          "kv_cache_scheme": {"num_bits": 8}}, "kv_cache_scheme"),
    ],
)  # fmt: skip
def test_what_cannot_be_reproduced_is_refused_naming_the_field(
    config: dict[str, Any], field: str
) -> None:
    with pytest.raises(ConfigError, match=rf"`quantization_config\.{re.escape(field)}` cannot"):
        quantize_like(config, where="base/config.json")


def _release(folder: Path, quantization: dict[str, Any] | None) -> Path:
    folder.mkdir(parents=True)
    config: dict[str, Any] = {"model_type": "llama", "hidden_size": 256}
    if quantization is not None:
        config["quantization_config"] = quantization
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize(
    ("base", "extra", "why"),
    [
        ("plain", [], "expected a `quantization_config` to reproduce, found none"),
        ("none", [], "reads the base release's config.json, found none"),
        ("fp8", ["--quantize", "fp8-block"], "`--quantize-like` reads the scheme that"),
        ("fp8", ["--to", "universal", "--dtype", "fp32"], "does not apply with `--to universal`"),
        ("block64", [], "`quantization_config.weight_block_size` cannot be reproduced"),
    ],
)
def test_cli_refuses_in_one_line(
    base: str, extra: list[str], why: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folders = {
        "plain": _release(tmp_path / "plain", None),
        "none": tmp_path / "missing",
        "fp8": _release(tmp_path / "fp8", transformers_config()),
        "block64": _release(tmp_path / "block64", transformers_config(weight_block_size=(64, 64))),
    }
    argv = ["convert", "--via", "local", str(tmp_path / "ckpt"), str(tmp_path / "out"),
            "--quantize-like", str(folders[base]), *extra]  # fmt: skip
    code = cli_main(argv)
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and why in err, err
    assert not (tmp_path / "out").exists()


def test_the_options_quantize_like_builds_cross_the_flow_edge(tmp_path: Path) -> None:
    from zerosafe_app.cli import _options, _parser
    from zerosafe_app.flows.config import flow_parameters, load_job_config

    base = _release(tmp_path / "base", transformers_config(scale_fmt="ue8m0",
                                                           modules_to_not_convert=["lm_head"]))  # fmt: skip
    argv = ["convert", "/ckpt", str(tmp_path / "out"), "--dtype", "bf16", "--quantize-like",
            str(base), "--quantize-ignore", "o_proj"]  # fmt: skip
    args = _parser().parse_args(argv)
    options = _options(args)
    assert (options.quantize, options.quantize_scale_fmt) == ("fp8-block", "ue8m0")
    assert options.quantize_ignore == (r"^lm_head\.weight$", "o_proj")
    params = flow_parameters("/ckpt", str(tmp_path / "out"), options, mode=args.mode)
    assert load_job_config(None, **params).options() == options
    assert options.identity()["quantize_scale_fmt"] == "ue8m0"
    assert "quantize_scale_fmt" not in ConvertOptions(quantize="fp8-block").identity()
    with pytest.raises(ConfigError, match="ue8m0 with `quantize` fp8-block"):
        ConvertOptions(quantize="nvfp4a16", quantize_scale_fmt="ue8m0")


def test_read_from_s3(
    tmp_path: Path,
    moto: MotoServer,  # noqa: F811 - fixture
    bucket: str,  # noqa: F811 - fixture
) -> None:
    base = _release(
        tmp_path / "base",
        compressed_tensors_config("NVFP4A16", "nvfp4-pack-quantized", ["lm_head"]),
    )
    url = upload_folder(moto.url, base, bucket, "releases/base-nvfp4")
    got = read_quantize_like(Storage({"endpoint_url": moto.url}), url)
    assert got == QuantizeLike(quantize="nvfp4a16", ignore=(r"^lm_head\.weight$",))


def test_ue8m0_bands_are_bit_exact_against_transformers_quantizer() -> None:
    w = edge_weight()
    op = Fp8Quantize(FineGrainedFP8HfQuantizer(FineGrainedFP8Config(scale_fmt="ue8m0")))
    want = dict(op.convert({"m.weight": w}))
    got = [quantize_band("fp8-block", w[r : r + 128], scale_fmt="ue8m0") for r in (0, 128)]
    assert b"".join(b.data for b in got) == want["m.weight"].view(torch.uint8).numpy().tobytes()
    scales = torch.cat([b.scales for b in got])
    assert want["m.weight_scale_inv"].dtype == torch.float8_e8m0fnu
    assert scales.equal(want["m.weight_scale_inv"].view(torch.uint8))
