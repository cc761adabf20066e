"""`--quantize` on a PyTorch DCP save in FSDP2's layout (3 ranks: uneven row chunks, so a
band of 128 rows gathers pieces of several files), into several output files: every
quantized weight and scale bit-exact against each scheme's reference applied to the fp32
conversion of the same save."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from bench.forge import transformer_shapes
from bench.forge_dcp import forge_dcp_checkpoint
from tests.quantize.test_fp8_block import reference_quantize
from tests.quantize.test_fp8_dynamic import reference_compress
from zerosafe.config import ConvertOptions
from zerosafe.driver import convert_checkpoint


@pytest.fixture(scope="module")
def dcp_save(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    """A forged 3-rank DCP save and its fp32 conversion."""
    root = tmp_path_factory.mktemp("quant-dcp")
    shapes = transformer_shapes(vocab=300, width=256, layers=2, ffn=640, kv_width=128)
    forge_dcp_checkpoint(root / "step-1", shapes, world_size=3, optimizer=False)
    convert_checkpoint(str(root / "step-1"), str(root / "fp32"), ConvertOptions(direct=True))
    return root / "step-1", load_file(str(root / "fp32" / "model.safetensors"))


@pytest.mark.parametrize("scheme", ["fp8-block", "fp8-dynamic"])
def test_dcp_release_is_bit_exact(
    dcp_save: tuple[Path, dict[str, torch.Tensor]], scheme: str, tmp_path: Path
) -> None:
    source, masters = dcp_save
    options = ConvertOptions(dtype="bf16", quantize=scheme, direct=True, max_shard_size=300_000)
    summary = convert_checkpoint(str(source), str(tmp_path), options)
    assert len(summary.files) > 2
    ours: dict[str, torch.Tensor] = {}
    for file in tmp_path.glob("*.safetensors"):
        ours |= load_file(str(file))
    quantized = [n for n, t in ours.items() if t.dtype == torch.float8_e4m3fn]
    assert len(quantized) >= 12
    for name in quantized:
        if scheme == "fp8-block":
            want = reference_quantize(name, masters[name])
        else:
            compressed = reference_compress(masters[name])
            want = {name: compressed["weight"], f"{name}_scale": compressed["weight_scale"]}
        for key, value in want.items():
            assert ours[key].view(torch.uint8).equal(value.view(torch.uint8)), key
