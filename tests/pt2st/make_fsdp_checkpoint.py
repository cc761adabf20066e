"""Write an unsharded FSDP checkpoint the way OLMo-style trainers do, with real FSDP.

    python tests/pt2st/make_fsdp_checkpoint.py OUT_DIR

Two ranks on the CPU (gloo), each transformer block its own FSDP unit (FULL_SHARD), three
AdamW steps; rank 0 then writes the gathered full state dicts: `model.pt` (the model),
`optim.pt` (FSDP's full optimizer state dict: state keyed by parameter name) and `train.pt`
(step counters and the RNG states of Python, numpy and torch).
"""

from __future__ import annotations

import os
import random
import sys
import warnings

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(dim)
        self.att_proj = nn.Linear(dim, 3 * dim, bias=False)
        self.attn_out = nn.Linear(dim, dim, bias=False)
        self.ff_proj = nn.Linear(dim, 4 * dim)
        self.ff_out = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.att_proj(self.attn_norm(x)).chunk(3, dim=-1)
        x = x + self.attn_out(torch.softmax(q @ k.transpose(-1, -2), -1) @ v)
        return x + self.ff_out(torch.relu(self.ff_proj(x)))


class Model(nn.Module):
    def __init__(self, vocab: int = 64, dim: int = 16, layers: int = 3) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(
            {
                "wte": nn.Embedding(vocab, dim),
                "blocks": nn.ModuleList(Block(dim) for _ in range(layers)),
                "ln_f": nn.LayerNorm(dim),
                "ff_out": nn.Linear(dim, vocab, bias=False),
            }
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.transformer["wte"](ids)
        for block in self.transformer["blocks"]:
            x = block(x)
        return self.transformer["ff_out"](self.transformer["ln_f"](x))


def _worker(rank: int, world_size: int, out: str, port: int) -> None:
    from torch.distributed.fsdp import (
        FullOptimStateDictConfig,
        FullStateDictConfig,
        ShardingStrategy,
        StateDictType,
    )
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    warnings.filterwarnings("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    model = FSDP(
        Model(),
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        device_id=torch.device("cpu"),
        use_orig_params=True,
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    torch.manual_seed(1 + rank)
    for _ in range(3):
        ids = torch.randint(0, 64, (2, 8))
        model(ids).logsumexp(-1).mean().backward()
        opt.step()
        opt.zero_grad()
    with FSDP.state_dict_type(
        model,
        StateDictType.FULL_STATE_DICT,
        FullStateDictConfig(offload_to_cpu=False, rank0_only=True),
        FullOptimStateDictConfig(offload_to_cpu=False, rank0_only=True),
    ):
        model_sd = model.state_dict()
        optim_sd = FSDP.optim_state_dict(model, opt)
    if rank == 0:
        torch.save(model_sd, os.path.join(out, "model.pt"))
        torch.save(optim_sd, os.path.join(out, "optim.pt"))
        train = {
            "global_step": 3,
            "global_train_examples_seen_this_epoch": 6,
            "global_train_tokens_seen": 48,
            "world_size": world_size,
            "rng": {
                "python": random.getstate(),
                "numpy": np.random.get_state(),
                "torch": torch.random.get_rng_state(),
            },
        }
        torch.save(train, os.path.join(out, "train.pt"))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    out = sys.argv[1]
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(2, out, port), nprocs=2, join=True)


if __name__ == "__main__":
    main()
