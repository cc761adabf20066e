"""Write a real ByteCheckpoint checkpoint with ByteCheckpoint's own save code, on the CPU.

    python -m tests.formats.dcp.make_bytecheckpoint_checkpoint OUT_DIR

ByteCheckpoint (PyPI `bytecheckpoint` 0.0.2, verl's checkpoint backend) saves a tiny model
sharded with FSDP2 `fully_shard` over 2 gloo ranks (`TiedModel` of `make_dcp_checkpoint`: a
37-row embedding, so the chunks are uneven, tied to the head), after two AdamW steps, with
`bytecheckpoint.save(OUT_DIR/ckpt, {"model", "optimizer", "extra_state"}, framework="fsdp2",
global_steps=3)`: it writes `ckpt/global_step_3/{model,optimizer}/` (`.metadata`, pickling
ByteCheckpoint's own `Metadata`, and `__R_0.distcp` files of raw tensor bytes),
`ckpt/global_step_3/extra_state/extra_state_rank_R.pt` and
`ckpt/latest_checkpointed_iteration.txt`. (Its FSDP1 path needs an accelerator: FSDP1 in torch
2.13 refuses the CPU.)

Also written, by rank 0 after the save:
- `live.safetensors`: the live model's full state dict (`get_model_state_dict` with
  `full_state_dict=True`), the reference the conversion must equal bit for bit;
- `status.json`: `{"bytecheckpoint": "ok"}`, or why it could not be written.
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
import torch.multiprocessing as mp

from tests.formats.dcp.make_dcp_checkpoint import TiedModel

WORLD_SIZE = 2
STEP = 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(rank: int, out: str, port: int) -> None:
    import bytecheckpoint
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard

    warnings.filterwarnings("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE)
    torch.manual_seed(0)
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
    state = {"model": model, "optimizer": optim, "extra_state": {"step": STEP, "rank": rank}}
    bytecheckpoint.save(os.path.join(out, "ckpt"), state, framework="fsdp2", global_steps=STEP)
    live = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if rank == 0:
        save_file(
            {k: v.contiguous() for k, v in live.items() if k != "head.weight"},
            os.path.join(out, "live.safetensors"),
        )  # the head is the embedding (tied): safetensors refuses shared storage
    dist.barrier()
    dist.destroy_process_group()


def main(out: str) -> None:
    os.makedirs(out, exist_ok=True)
    status = "not written"
    for attempt in range(3):  # a free port can be taken before gloo binds it: retry
        try:
            mp.spawn(_worker, args=(out, _free_port()), nprocs=WORLD_SIZE, join=True)
            status = "ok"
            break
        except Exception:  # report, so the tests can say what did not run
            status = f"attempt {attempt + 1} of 3: " + traceback.format_exc(limit=3)
    with open(os.path.join(out, "status.json"), "w") as f:
        json.dump({"bytecheckpoint": status}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
