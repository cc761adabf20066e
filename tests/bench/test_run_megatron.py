"""bench/run_megatron.py's output check (issue 40): zerosafe's output against the tool's
(Megatron's stacked names, as torch's DCP consolidation of a `torch_dist` save writes them),
mapped to HF names with plain torch. The tool's output is made here from the committed `tp2`
save's live weights, stacked as megatron-core saves them; no timing is asserted."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench.run_megatron import FUSED_NORMS, same_as_mapped  # noqa: E402
from tests.formats.megatron.conftest import live_weights, save_path, saved_args  # noqa: E402
from zerosafe_app.cli import main  # noqa: E402


def _stacked(live: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`live` (per-layer names) in the save's own form: one tensor per parameter, layers
    stacked, the norms named on the fused layers."""
    on_fused = {v: k for k, v in FUSED_NORMS.items()}
    layers: dict[str, list[torch.Tensor]] = {}
    out = {}
    for name, tensor in live.items():
        m = re.fullmatch(r"decoder\.layers\.(\d+)\.(.+)", name)
        if m is None:
            out[name] = tensor
        else:
            layers.setdefault(on_fused.get(m[2], m[2]), []).append(tensor)
    return out | {f"decoder.layers.{k}": torch.stack(v) for k, v in layers.items()}


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`zerosafe convert` of the `tp2` save with default options (fp32, HF names)."""
    out = tmp_path_factory.mktemp("megatron") / "out"
    assert main(["convert", str(save_path("tp2")), str(out), "--via", "local", "-q"]) == 0
    return out


def _tool_output(folder: Path, tensors: dict[str, torch.Tensor]) -> str:
    folder.mkdir()
    save_file(tensors, str(folder / "model.safetensors"))
    return str(folder)


def test_equal_to_the_mapped_tool_output_and_a_flipped_bit_shows(
    converted: Path, tmp_path: Path
) -> None:
    args = saved_args("tp2")
    stacked = _stacked(live_weights("tp2"))
    ok, detail = same_as_mapped(str(converted), _tool_output(tmp_path / "tool", stacked), args)
    assert ok, detail
    flipped = {k: v.clone() for k, v in stacked.items()}
    # one bit of a key head's row in layer 1: only a right QKV split puts it in k_proj
    qkv = flipped["decoder.layers.self_attention.linear_qkv.weight"]
    qkv[1, int(str(args["kv_channels"])) * 2, 0:1].view(torch.int32)[0] ^= 1
    ok, detail = same_as_mapped(str(converted), _tool_output(tmp_path / "bit", flipped), args)
    assert (ok, detail) == (False, "model.layers.1.self_attn.k_proj.weight: bytes differ")
    fewer = {k: v for k, v in stacked.items() if k != "output_layer.weight"}
    ok, detail = same_as_mapped(str(converted), _tool_output(tmp_path / "fewer", fewer), args)
    assert not ok and "lm_head.weight" in detail
