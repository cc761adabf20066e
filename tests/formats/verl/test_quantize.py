"""`zerosafe convert ACTOR OUT --quantize SCHEME` on a real verl save (issue 41): the `quant`
actor of this session's verl fixture (verl's own `FSDPCheckpointManager`, FSDP2 on 2 gloo ranks;
see conftest.py), one conversion per scheme. Every quantized tensor and scale is bit-exact
against the scheme's reference quantizer applied to the live fp32 weights, `from_pretrained(OUT)`
loads on CPU with the weights the reference dequantization gives, and `zerosafe verify OUT
--against ACTOR` passes. The checks are `tests/quantize/real_saves.py`'s, shared with the FSDP2
DCP save's."""

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
Run = Callable[[str], Path]
ACTOR = "global_step_1/actor"


@pytest.fixture(scope="module")
def releases(verl_run: Run, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One conversion of the actor per scheme, model files from its `huggingface/`."""
    root = tmp_path_factory.mktemp("verl-quant")
    out = {}
    for scheme in SCHEMES:
        options = ConvertOptions(dtype="bf16", quantize=scheme, direct=True)
        summary = convert_checkpoint(str(verl_run("quant") / ACTOR), str(root / scheme), options)
        assert summary.status == "converted", summary
        out[scheme] = root / scheme
    return out


@pytest.mark.parametrize("scheme", SCHEMES)
def test_verl_release_is_bit_exact_loads_and_verifies(
    verl_run: Run, releases: dict[str, Path], scheme: str, capsys: pytest.CaptureFixture[str]
) -> None:
    root, out = verl_run("quant"), releases[scheme]
    live = load_file(root / "live.safetensors")
    # every linear weight of both layers: q/o [256, 256], k/v [128, 256], gate/up [384, 256]
    # (a 128-row band of which straddles the two ranks' 192 rows), down [256, 384]
    assert assert_bit_exact(scheme, out, live) == 14
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] and config["quantization_config"]
    assert_loads_as_the_reference_dequantizes(scheme, out, live)
    assert_verify_passes(out, root / ACTOR, capsys, tensors=14)
