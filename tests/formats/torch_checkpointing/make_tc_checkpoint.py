"""Write real torch_checkpointing saves on CPU: `python -m tests.formats.torch_checkpointing.make_tc_checkpoint OUT`.

Two gloo ranks train a tiny model for one AdamW step under FSDP2 (`fully_shard` of each block,
then the root; an embedding of 67 rows, so its dim-0 shards are uneven: 34 and 33 rows; a
buffer FSDP leaves whole) and save `{"model": model.state_dict(), "optim": optim.state_dict(),
"step": 1}` with torch_checkpointing 0.1.1's own `CheckpointManager` (synchronous saver):

- `OUT/pt/step_1/`: the default layout, `{model,optim,step}_R.pt`, one `torch.save` per item
  and rank (DTensor local shards);
- `OUT/st/step_1/`: the model item in the safetensors layout (`model_R.safetensors`, each
  rank's local shards under their full names) with a resharder declared (`DefaultResharder`),
  so the library also writes `metadata.pkl`, the global layout of every item.

`metadata.pkl` is gathered by `DefaultMetadataManager._all_gather_pickled_data`, which moves
each rank's pickled metadata through CUDA tensors (torch_checkpointing 0.1.1's
metadata_manager.py: `torch.tensor(..., device="cuda")`, `.cuda()`), which a CPU run cannot
do. `_cpu_metadata_gather` is a shim replacing that one method with `all_gather_object` over
gloo: the same per-rank objects, pickled and unpickled as the library does, reach every rank.
It is transport only and changes nothing written: the saved bytes are what a GPU run writes.

The same ranks save, with the default layout, `OUT/shard1/step_1/`: the model under FSDP2 with
`Shard(1)` placements (`shard_placement_fn`), which zerosafe refuses.

Rank 0 writes the live model's full weights (`OUT/live.safetensors`, gathered with
`full_tensor()` right after the saves); `OUT/status.json` says which saves worked.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import traceback

import torch

VOCAB = 67
HIDDEN = 24


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(HIDDEN)
        self.proj = torch.nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = x + self.proj(self.norm(x))
        return out


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(2))
        self.head = torch.nn.Linear(HIDDEN, 5, bias=False)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, HIDDEN))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids) * self.scale
        for block in self.blocks:
            x = block(x)
        logits: torch.Tensor = self.head(x)
        return logits


def _cpu_metadata_gather() -> None:
    """Shim (transport only, see the module docstring): gather each rank's metadata over gloo
    instead of through CUDA tensors; the result, rank -> that rank's object, is the same."""
    from torch_checkpointing.metadata_manager import DefaultMetadataManager

    def gather(self, data, process_group=None):  # type: ignore[no-untyped-def]
        gathered: list[object] = [None] * torch.distributed.get_world_size(process_group)
        torch.distributed.all_gather_object(gathered, data, group=process_group)
        return dict(enumerate(gathered))

    DefaultMetadataManager._all_gather_pickled_data = gather  # type: ignore[method-assign]


def _save(manager_config, folder: str, model, optim) -> None:  # type: ignore[no-untyped-def]
    manager = manager_config.build()
    try:
        manager.save(folder, {"model": model.state_dict(), "optim": optim.state_dict(), "step": 1})
    finally:
        manager.close()


def worker(rank: int, world_size: int, out: str, port: int) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
        WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
    )  # fmt: skip
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world_size)
    _cpu_metadata_gather()
    from safetensors.torch import save_file
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Shard
    from torch_checkpointing import CheckpointManager, ItemSpec
    from torch_checkpointing.checkpoint_layout import LayoutInfo, SafetensorsSerialization
    from torch_checkpointing.config import SyncCheckpointSaverConfig
    from torch_checkpointing.default_resharder import DefaultResharder
    from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

    torch.manual_seed(0)
    model = Tiny()
    mesh = init_device_mesh("cpu", (world_size,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.arange(12).reshape(2, 6) * (rank + 1) % VOCAB
    model(ids).square().mean().backward()
    optim.step()
    optim.zero_grad()

    # O_DIRECT fails on some filesystems (EINVAL); the layout is the same without it
    storage = LocalFileSystemStorageConfig(use_direct_io=False)

    def sync() -> SyncCheckpointSaverConfig:
        # one per save: a saver config holds one store barrier, whose keys serve once; with a
        # config shared by two saves, the second one's rank 0 passed its barrier at once and
        # renamed tmp_step_1/ before rank 1 had written its files into it
        return SyncCheckpointSaverConfig()

    status: dict[str, str] = {}
    for name, config in (
        ("pt", CheckpointManager.Config(save=sync(), storage_config=storage)),
        (
            "st",
            CheckpointManager.Config(
                save=sync(),
                storage_config=storage,
                items={
                    "model": ItemSpec(
                        layout=LayoutInfo("model_{rank}.safetensors", SafetensorsSerialization()),
                        resharder=DefaultResharder(),
                    ),
                },
            ),
        ),
    ):
        try:
            _save(config, f"{out}/{name}/step_1", model, optim)
            status[name] = "ok"
        except Exception:  # noqa: BLE001 - the fixture reports what the library refused
            status[name] = traceback.format_exc(limit=3).strip().splitlines()[-1]
        torch.distributed.barrier()
    shard1 = Tiny()
    fully_shard(shard1, mesh=mesh, shard_placement_fn=lambda p: Shard(1) if p.ndim == 2 else None)
    try:
        _save(
            CheckpointManager.Config(save=sync(), storage_config=storage),
            f"{out}/shard1/step_1",
            shard1,
            torch.optim.AdamW(shard1.parameters()),
        )
        status["shard1"] = "ok"
    except Exception:  # noqa: BLE001 - the fixture reports what the library refused
        status["shard1"] = traceback.format_exc(limit=3).strip().splitlines()[-1]
    torch.distributed.barrier()
    full = {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
        for k, v in model.state_dict().items()
    }
    if rank == 0:
        for name in status:  # each rank's files went with the step folder's rename
            left = f"{out}/{name}/tmp_step_1"
            if status[name] == "ok" and os.path.exists(left):
                status[name] = f"rank files left behind in tmp_step_1/: {os.listdir(left)}"
        save_file({k: v.contiguous() for k, v in full.items()}, f"{out}/live.safetensors")
        with open(f"{out}/status.json", "w") as f:
            json.dump(status, f)
    torch.distributed.barrier()
    os._exit(0)  # past the final barrier: no teardown of torch's process group


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    from torch.multiprocessing.spawn import spawn

    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    torch.set_num_threads(1)
    spawn(worker, args=(2, out, _free_port()), nprocs=2, join=True)  # type: ignore[no-untyped-call]


if __name__ == "__main__":
    main()
