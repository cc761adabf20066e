"""`zerosafe convert CKPT OUT --quantize SCHEME` on a real FSDP2 save (issue 41): this session's
`fsdp2_llama` DCP checkpoint (a transformers Llama under `fully_shard`, written by
`torch.distributed.checkpoint.save` on 2 gloo ranks; see make_dcp_checkpoint.py), one
conversion per scheme. Every quantized tensor and scale is bit-exact against the scheme's
reference quantizer applied to the live fp32 weights, `from_pretrained(OUT)` loads on CPU with
the weights the reference dequantization gives, and `zerosafe verify OUT --against CKPT`
passes. The checks are `tests/quantize/real_saves.py`'s, shared with the verl save's."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.quantize.real_saves import (
    SCHEMES,
    assert_bit_exact,
    assert_loads_as_the_reference_dequantizes,
    assert_verify_passes,
)
from zerosafe.config import ConvertOptions
from zerosafe.driver import convert_checkpoint

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def releases(
    dcp_checkpoint: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    """One conversion of the save per scheme, its config.json from `fsdp2_llama.model/`."""
    ckpt = dcp_checkpoint("fsdp2_llama")
    root = tmp_path_factory.mktemp("dcp-quant")
    out = {}
    for scheme in SCHEMES:
        options = ConvertOptions(
            dtype="bf16", quantize=scheme, direct=True,
            model_files=str(ckpt.parent / "fsdp2_llama.model"),
        )  # fmt: skip
        summary = convert_checkpoint(str(ckpt), str(root / scheme), options)
        assert summary.status == "converted", summary
        out[scheme] = root / scheme
    return out


@pytest.mark.parametrize("scheme", SCHEMES)
def test_fsdp2_release_is_bit_exact_loads_and_verifies(
    dcp_checkpoint: Callable[[str], Path],
    releases: dict[str, Path],
    scheme: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    ckpt, out = dcp_checkpoint("fsdp2_llama"), releases[scheme]
    live = load_file(ckpt.parent / "fsdp2_llama.live.safetensors")
    # every linear weight of both layers: q/o [256, 256], k/v [128, 256], gate/up [384, 256]
    # (a 128-row band of which straddles the two ranks' 192 rows), down [256, 384]
    assert assert_bit_exact(scheme, out, live) == 14
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] and config["quantization_config"]
    assert_loads_as_the_reference_dequantizes(scheme, out, live)
    assert_verify_passes(out, ckpt, capsys, tensors=14)
