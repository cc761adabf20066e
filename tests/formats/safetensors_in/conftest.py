"""Hugging Face safetensors folders written by transformers' own `save_pretrained`, once per
session: a tiny Llama sharded into several files (`max_shard_size`), and one with tied
embeddings in a single `model.safetensors` (transformers stores the tied head once)."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

VOCAB = 64


def tiny_llama(*, tied: bool) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=24, intermediate_size=40, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        tie_word_embeddings=tied, architectures=["LlamaForCausalLM"],
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # norms are ones at init: give every tensor distinct values
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    return model.eval()


def input_ids() -> torch.Tensor:
    return torch.arange(2 * 9).reshape(2, 9) % VOCAB


@pytest.fixture(scope="session")
def hf_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`sharded/` (untied, several files and an index) and `tied/` (one file), with each
    model's live fp32 weights in `<name>.live.pt`."""
    root = tmp_path_factory.mktemp("hf")
    for name, tied, shard in (("sharded", False, "8KB"), ("tied", True, "5GB")):
        model = tiny_llama(tied=tied)
        model.save_pretrained(root / name, max_shard_size=shard)
        torch.save({k: v.clone() for k, v in model.state_dict().items()}, root / f"{name}.live.pt")
    return root


@pytest.fixture(scope="session")
def hf_folder(hf_root: Path) -> Callable[[str], Path]:
    """`hf_folder(name)`: the path of a saved folder (read only: copy it to change it)."""
    return lambda name: hf_root / name


@pytest.fixture(scope="session")
def hf_live(hf_root: Path) -> Callable[[str], dict[str, torch.Tensor]]:
    """`hf_live(name)`: the model's `state_dict()` when it was saved."""
    return lambda name: dict(torch.load(hf_root / f"{name}.live.pt"))


def copy_folder(src: Path, dest: Path) -> Path:
    shutil.copytree(src, dest)
    return dest
