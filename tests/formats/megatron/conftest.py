"""The committed megatron-core saves (fixtures/README.md says how they were made)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

FIXTURES = Path(__file__).resolve().parent / "fixtures"
SAVES = ("tp2", "tp1dp2", "tp2tied", "qwen2tp2", "qwen3tp2", "moetp2ep2")
"""Tensor parallel 2, tensor parallel 1 x data parallel 2 (the same model, two layouts),
tensor parallel 2 with the output layer tied to the embedding, and two at tensor parallel 2:
with QKV biases (Qwen2-style) and with query/key norms and a head size of its own
(Qwen3-style); and a Mixtral-style MoE (4 experts, top 2) at tensor parallel 2 x expert parallel 2."""


def save_path(name: str) -> Path:
    """The `--save` folder of a committed save (it holds `latest_checkpointed_iteration.txt`)."""
    return FIXTURES / name


def live_weights(name: str) -> dict[str, torch.Tensor]:
    """The live model's weights, gathered to full size, in Megatron's per-layer names."""
    return load_file(str(save_path(name) / "live.safetensors"))


def saved_args(name: str) -> dict[str, object]:
    """The architecture fields of the args the save holds (as the maker wrote them)."""
    return dict(json.loads((save_path(name) / "args.json").read_text()))


@pytest.fixture(params=SAVES)
def megatron_save(request: pytest.FixtureRequest) -> str:
    """The name of each committed save in turn."""
    return str(request.param)
