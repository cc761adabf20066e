"""Write real PyTorch DCP checkpoints with `torch.distributed.checkpoint.save`, on the CPU.

    python -m tests.formats.dcp.make_dcp_checkpoint OUT_DIR

Makes, under OUT_DIR:
- `dtensor/` (4 ranks, gloo): DTensors from `distribute_tensor` on a 1-D mesh of 4 (Shard(0)
  with 101 rows, Shard(1) with 33 columns, Replicate) and on a 2-D 2x2 mesh (Shard(0) by
  Shard(1)); fp32 and bf16; an int64 buffer and a 0-dim tensor saved as plain tensors; a tied
  pair (two names, one tensor); an optimizer state beside the model; non-tensor entries.
- `fsdp2/` (2 ranks): a small model sharded with FSDP2 `fully_shard`, two AdamW steps, saved
  as `get_state_dict(model, optim)` under `model` and `optim`; its embedding and head are tied.
- `flat/` (2 ranks): no top-level `model` key.
- `safetensors/` (2 ranks): `flat`'s state saved with `SerializationFormat.SAFETENSORS`.
- `app/` (2 ranks): PyTorch's own recipe (the DCP and async-checkpoint tutorials): an FSDP2
  model and an AdamW that took one step, saved as `{"app": AppState(model, optim)}`, a
  `Stateful` whose state dict is `{"model", "optim"}` from `get_state_dict`, so no top-level
  `model` key; `app.live.safetensors`, the live model's full state dict, beside it.
- `app_two_models/` (2 ranks): the same, plus a second model's weights under `ref.model`.
- `fsdp2_llama/` (2 ranks): a transformers Llama (tied embeddings; hidden 256, intermediate
  384: dims every `--quantize` scheme takes, and a 128-row band of gate/up straddles the two
  ranks' 192 rows) under FSDP2 `fully_shard` (each decoder layer, then the root), one AdamW
  step, saved as `get_state_dict(model, optim)` under `model` and `optim`; beside it
  `fsdp2_llama.model/` (its config.json) and `fsdp2_llama.live.safetensors` (the live model's
  full state dict).
- `status.json`: which ones were written and why any was not.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import traceback
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.checkpoint.stateful import Stateful


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _init(rank: int, world_size: int, port: int) -> None:
    warnings.filterwarnings("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    torch.manual_seed(0)


def _full(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


def _dtensor_state() -> dict[str, object]:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (4,))
    mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    emb = distribute_tensor(_full(101, 12, seed=1), mesh, [Shard(0)])
    model = {
        "emb.weight": emb,
        "head.weight": emb,  # tied: the same tensor under two names
        "proj.weight": distribute_tensor(
            _full(10, 33, dtype=torch.bfloat16, seed=2), mesh, [Shard(1)]
        ),
        "grid.weight": distribute_tensor(_full(7, 9, seed=3), mesh2, [Shard(0), Shard(1)]),
        "cube.weight": distribute_tensor(
            _full(3, 5, 6, dtype=torch.bfloat16, seed=4), mesh, [Shard(1)]
        ),
        "norm.weight": distribute_tensor(_full(12, seed=5), mesh, [Replicate()]),
        "counts": torch.arange(5, dtype=torch.int64),
        "scale": torch.tensor(0.5),
        "empty": torch.zeros(0, 4),
    }
    optim = {
        "state": {
            "emb.weight": {
                "exp_avg": distribute_tensor(_full(101, 12, seed=6), mesh, [Shard(0)]),
                "step": torch.tensor(3.0),
            }
        },
        "param_groups": [{"lr": 0.01, "params": ["emb.weight"]}],
    }
    return {"model": model, "optim": optim, "step": 7, "extra": {"note": "hello"}}


def _dtensor_worker(rank: int, world_size: int, out: str, port: int) -> None:
    _init(rank, world_size, port)
    dcp.save(_dtensor_state(), checkpoint_id=os.path.join(out, "dtensor"))
    dist.destroy_process_group()


class TiedModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(37, 8)
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 37, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.head(self.norm(x))


def _fsdp2_worker(rank: int, world_size: int, out: str, port: int) -> None:
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard

    _init(rank, world_size, port)
    model = TiedModel()
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    for _ in range(2):
        ids = torch.randint(0, 37, (4, 5), generator=torch.Generator().manual_seed(rank))
        model(ids).float().square().mean().backward()
        optim.step()
        optim.zero_grad()
    msd, osd = get_state_dict(model, optim)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(out, "fsdp2"))
    dist.destroy_process_group()


def _flat_state() -> dict[str, object]:
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (2,))
    return {
        "w": distribute_tensor(_full(9, 4, seed=7), mesh, [Shard(0)]),
        "v": distribute_tensor(_full(4, 7, dtype=torch.bfloat16, seed=8), mesh, [Shard(1)]),
        "b": _full(3, seed=9),
        "epoch": 2,
    }


def _flat_worker(rank: int, world_size: int, out: str, port: int) -> None:
    from torch.distributed.checkpoint.filesystem import FileSystemWriter, SerializationFormat

    _init(rank, world_size, port)
    state = _flat_state()
    dcp.save(state, checkpoint_id=os.path.join(out, "flat"))
    writer = FileSystemWriter(
        os.path.join(out, "safetensors"), serialization_format=SerializationFormat.SAFETENSORS
    )
    dcp.save(state, storage_writer=writer)
    dist.destroy_process_group()


class AppState(Stateful):
    """The `Stateful` wrapper of PyTorch's DCP recipe: DCP calls `state_dict` on save and
    `load_state_dict` on load, and the state dict is `get_state_dict`'s `{"model", "optim"}`."""

    def __init__(self, model: nn.Module, optim: torch.optim.Optimizer) -> None:
        self.model = model
        self.optim = optim

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optim)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(
            self.model, self.optim,
            model_state_dict=state_dict["model"], optim_state_dict=state_dict["optim"],
        )  # fmt: skip


def _app_worker(rank: int, world_size: int, out: str, port: int) -> None:
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
    )
    from torch.distributed.fsdp import fully_shard

    _init(rank, world_size, port)
    model = nn.Sequential(nn.Linear(6, 10), nn.ReLU(), nn.Linear(10, 3))
    fully_shard(model)
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(4, 6)).square().mean().backward()
    optim.step()
    optim.zero_grad()
    dcp.save({"app": AppState(model, optim)}, checkpoint_id=os.path.join(out, "app"))
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    if rank == 0:
        save_file(
            {k: v.contiguous() for k, v in full.items()}, os.path.join(out, "app.live.safetensors")
        )
    ref = {"model": get_model_state_dict(model)}
    dcp.save(
        {"app": AppState(model, optim), "ref": ref},
        checkpoint_id=os.path.join(out, "app_two_models"),
    )
    dist.destroy_process_group()


def _fsdp2_llama_worker(rank: int, world_size: int, out: str, port: int) -> None:
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaConfig, LlamaForCausalLM

    _init(rank, world_size, port)
    config = LlamaConfig(
        vocab_size=101, hidden_size=256, intermediate_size=384, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        tie_word_embeddings=True,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    ids = torch.randint(0, 101, (2, 8), generator=torch.Generator().manual_seed(rank))
    model(input_ids=ids, labels=ids).loss.backward()
    optim.step()
    optim.zero_grad()
    msd, osd = get_state_dict(model, optim)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(out, "fsdp2_llama"))
    full = {k: v.full_tensor().detach().clone() for k, v in model.state_dict().items()}
    if rank == 0:
        config.save_pretrained(os.path.join(out, "fsdp2_llama.model"))
        # save_file refuses tensors sharing memory: the tied head is a separate copy here
        save_file(full, os.path.join(out, "fsdp2_llama.live.safetensors"))
    dist.destroy_process_group()


_JOBS = {
    "dtensor": (_dtensor_worker, 4),
    "fsdp2": (_fsdp2_worker, 2),
    "flat": (_flat_worker, 2),
    "app": (_app_worker, 2),
    "fsdp2_llama": (_fsdp2_llama_worker, 2),
}


def main(out: str) -> None:
    os.makedirs(out, exist_ok=True)
    status: dict[str, str] = {}
    for name, (worker, world_size) in _JOBS.items():
        for attempt in range(3):  # a free port can be taken before gloo binds it: retry
            try:
                port = _free_port()
                mp.spawn(worker, args=(world_size, out, port), nprocs=world_size, join=True)
                status[name] = "ok"
                break
            except Exception:  # report, so the tests can say what did not run
                status[name] = f"attempt {attempt + 1} of 3: " + traceback.format_exc(limit=3)
    with open(os.path.join(out, "status.json"), "w") as f:
        json.dump(status, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
