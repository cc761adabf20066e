"""Write real saves of torch's `HuggingFaceStorageWriter` from an FSDP2 model, on the CPU.

    python -m tests.formats.hf_storage.make_hf_storage_checkpoint OUT_DIR

Two gloo ranks train a small model sharded with `fully_shard` for two steps, then save its
`state_dict()` (DTensors, `Shard(0)`, rows split unevenly) twice under OUT_DIR:
- `plain/`: `HuggingFaceStorageWriter(save_distributed=True)`: one
  `shard-0000R-model-00001-of-00001.safetensors` per rank, nothing else;
- `consolidated/`: the same with `enable_consolidation=True` and two output files: the rank
  files in `consolidated/sharded/`, torch's consolidated `model-0000K-of-00002.safetensors`
  and `model.safetensors.index.json` in `consolidated/`;
and rank 0 writes `live.pt`, the full fp32 state dict (the oracle), and `status.json`.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import traceback
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch import nn


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class SmallModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(37, 8)  # 37 rows: 19 + 18 over two ranks
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 37, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.head(self.norm(x))


def _worker(rank: int, world_size: int, out: str, port: int) -> None:
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard

    warnings.filterwarnings("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    torch.manual_seed(0)
    model = SmallModel()
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    for _ in range(2):
        ids = torch.randint(0, 37, (4, 5), generator=torch.Generator().manual_seed(rank))
        model(ids).square().mean().backward()
        optim.step()
        optim.zero_grad()
    state = model.state_dict()
    dcp.save(
        state,
        storage_writer=HuggingFaceStorageWriter(os.path.join(out, "plain"), save_distributed=True),
    )
    mapping = {k: 1 if k.startswith(("embed", "layers.0")) else 2 for k in state}
    dcp.save(
        state,
        storage_writer=HuggingFaceStorageWriter(
            os.path.join(out, "consolidated"),
            fqn_to_index_mapping=mapping,
            save_distributed=True,
            enable_consolidation=True,
        ),
    )
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    if rank == 0:
        torch.save({k: v.clone() for k, v in full.items()}, os.path.join(out, "live.pt"))
    dist.barrier()
    dist.destroy_process_group()


def main(out: str) -> None:
    os.makedirs(out, exist_ok=True)
    status = "not run"
    for attempt in range(3):  # a free port can be taken before gloo binds it: retry
        try:
            mp.spawn(_worker, args=(2, out, _free_port()), nprocs=2, join=True)
            status = "ok"
            break
        except Exception:  # report, so the tests can say what did not run
            status = f"attempt {attempt + 1} of 3: " + traceback.format_exc(limit=3)
    with open(os.path.join(out, "status.json"), "w") as f:
        json.dump({"fsdp2": status}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
