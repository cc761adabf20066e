"""The checks of a quantized release made from a real framework save (verl, FSDP2 DCP), shared
by the tests beside each format's fixtures: each scheme's tensors and scales bit-exact against
its reference quantizer applied to the live fp32 weights, `from_pretrained(OUT)` on CPU with
the weights the reference dequantization gives, and `zerosafe verify OUT --against CKPT`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from compressed_tensors.compressors.naive_quantized.base import FloatQuantizationCompressor
from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
from safetensors.torch import load_file
from transformers import FineGrainedFP8Config
from transformers.integrations.finegrained_fp8 import Fp8Dequantize
from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

from tests.quantize import test_fp8_dynamic, test_nvfp4
from tests.quantize.test_fp8_block import reference_quantize
from zerosafe_app.cli import main as cli_main

SCHEMES = ("fp8-block", "fp8-dynamic", "nvfp4a16")
LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def reference(scheme: str, name: str, master: torch.Tensor) -> dict[str, torch.Tensor]:
    """What the scheme's reference writes for the linear weight `name` (output names)."""
    module = name.removesuffix("weight")
    if scheme == "fp8-block":
        return reference_quantize(name, master)
    if scheme == "fp8-dynamic":
        want = test_fp8_dynamic.reference_compress(master)
        return {name: want["weight"], f"{name}_scale": want["weight_scale"]}
    return {module + k: v for k, v in test_nvfp4.reference_compress(master).items()}


def load_release(out: Path) -> dict[str, torch.Tensor]:
    ours: dict[str, torch.Tensor] = {}
    for file in out.glob("*.safetensors"):
        ours |= load_file(str(file))
    return ours


def assert_bit_exact(scheme: str, out: Path, live: dict[str, torch.Tensor]) -> int:
    """Every linear weight of `live` quantized as the reference does it (names, dtypes, shapes,
    bytes), everything else the plain cast to the release's `--dtype` (bf16); a tied head
    stored once. Returns how many weights were quantized."""
    ours = load_release(out)
    expected: set[str] = set()
    quantized = 0
    for name, master in live.items():
        if name == "lm_head.weight" and name not in ours:  # tied: stored once, unquantized
            assert torch.equal(master, live["model.embed_tokens.weight"])
            continue
        if not (name.endswith(".weight") and any(p in name for p in LINEAR)):
            assert ours[name].dtype == torch.bfloat16, name
            assert torch.equal(ours[name], master.bfloat16()), name
            expected.add(name)
            continue
        want = reference(scheme, name, master)
        assert len(want) > 1, f"{name} {list(master.shape)}: the reference leaves it as it is"
        quantized += 1
        for key, value in want.items():
            got = ours[key]
            assert got.dtype == value.dtype and got.shape == value.shape, key
            assert got.view(torch.uint8).equal(value.view(torch.uint8)), (scheme, key)
            expected.add(key)
    assert set(ours) == expected
    return quantized


def _dequantized(scheme: str, ours: dict[str, torch.Tensor], name: str, dtype: torch.dtype):  # type: ignore[no-untyped-def]
    """The reference dequantization of the quantized weight `name`, in the model's dtype."""
    if scheme == "fp8-block":
        op = Fp8Dequantize(FineGrainedFP8HfQuantizer(FineGrainedFP8Config(dequantize=True)))
        return op._dequantize_one(ours[name], ours[f"{name}_scale_inv"], dtype)
    if scheme == "fp8-dynamic":  # the float32 scale in the model's dtype, as transformers loads it
        state = {"weight": ours[name], "weight_scale": ours[f"{name}_scale"].to(dtype)}
        return FloatQuantizationCompressor.decompress(state, test_fp8_dynamic.SCHEME)["weight"]
    module = name.removesuffix("weight")
    state = {"weight" + k.removeprefix(module + "weight"): v for k, v in ours.items()
             if k.startswith(module + "weight")}  # fmt: skip
    return NVFP4PackedCompressor.decompress(state, test_nvfp4.SCHEME)["weight"].to(dtype)


# How far the logits may move, as a share of their range, from the same model holding the live
# weights in bf16: about twice what these saves' two tiny layers moved (verl, FSDP2 DCP):
# fp8-block 4.3%, 2.0%; fp8-dynamic (FP8 activations too) 4.3%, 9.1%; nvfp4a16 9.4%, 16.5%
LOGITS_BOUND = {"fp8-block": 0.1, "fp8-dynamic": 0.2, "nvfp4a16": 0.3}


def assert_loads_as_the_reference_dequantizes(
    scheme: str, out: Path, live: dict[str, torch.Tensor]
) -> None:
    """`AutoModelForCausalLM.from_pretrained(OUT)` on CPU; after a first forward (which
    decompresses the compressed-tensors formats) every quantized weight equals the reference
    dequantization, and the logits are within the scheme's error of the same model holding
    the live weights in bf16."""
    ours = load_release(out)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    config = transformers.AutoConfig.from_pretrained(str(out))
    del config.quantization_config
    plain = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    plain.load_state_dict({k: v.bfloat16() for k, v in live.items()})
    input_ids = torch.arange(2 * 9).reshape(2, 9) % config.vocab_size
    with torch.no_grad():
        got = model(input_ids=input_ids).logits.float()
        want_logits = plain(input_ids=input_ids).logits.float()
    assert got.isfinite().all() and want_logits.abs().max() > 0
    assert (got - want_logits).abs().max() <= LOGITS_BOUND[scheme] * want_logits.abs().max()
    state = model.state_dict()
    weights = [n for n, t in ours.items() if t.dtype == torch.float8_e4m3fn]
    if scheme == "nvfp4a16":
        weights = [n.removesuffix("_packed") for n in ours if n.endswith(".weight_packed")]
    assert weights
    for name in weights:
        assert state[name].dtype in (torch.bfloat16, torch.float32), name  # dequantized
        want = _dequantized(scheme, ours, name, state[name].dtype)
        assert state[name].dtype == want.dtype and state[name].equal(want), name


def assert_verify_passes(
    out: Path, ckpt: Path, capsys: pytest.CaptureFixture[str], tensors: int
) -> None:
    """`zerosafe verify OUT --against CKPT --json`: exit 0, every quantized tensor counted."""
    code = cli_main(["verify", str(out), "--against", str(ckpt), "--json"])
    stdout, err = capsys.readouterr()
    assert code == 0, stdout + err
    report = json.loads(stdout)
    assert report["ok"] and report["quantized"]["tensors"] == tensors, report
