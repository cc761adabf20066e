"""Write a real OLMo-core checkpoint with OLMo-core's own save code, on the CPU.

    python -m tests.formats.dcp.make_olmo_core_checkpoint OUT_DIR

A tiny OLMo-core transformer (`TransformerConfig.llama_like`, 2 blocks, d_model 64, vocab
128, OLMo-2 `reordered_norm` blocks with QK-norm) is sharded with OLMo-core's own
`Transformer.apply_fsdp` (FSDP2 `fully_shard`) over 2 gloo ranks, trained for two AdamW
steps, and saved with `olmo_core.distributed.checkpoint.save_model_and_optim_state` into
`step3/model_and_optim/`, the folder OLMo-core's `Checkpointer` uses inside `stepN/`. Beside
it, `step3/config.json` is the experiment config as OLMo-core's `ConfigSaverCallback` writes
it (`json.dumps` of `Config.as_config_dict()`: `_CLASS_` keys, no `model_type`), and
`step3/train/rank0.pt` a trainer state the way its `Checkpointer` writes one (never read).

Also written, by rank 0 after the save:
- `live.safetensors`: the live model's full state dict (`get_model_state_dict` with
  `full_state_dict=True`), the reference the conversion must equal bit for bit, and
  `live_names.json`, its names in the model's `state_dict()` order;
- `status.json`: `{"olmo_core": "ok"}`, or why it could not be written.
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

VOCAB_SIZE = 128
WORLD_SIZE = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _config():  # type: ignore[no-untyped-def]
    from olmo_core.nn.transformer import TransformerBlockType, TransformerConfig

    return TransformerConfig.llama_like(
        d_model=64, vocab_size=VOCAB_SIZE, n_layers=2, n_heads=4, hidden_size_multiple_of=16,
        block_name=TransformerBlockType.reordered_norm, qk_norm=True,
    )  # fmt: skip


def _worker(rank: int, out: str, port: int) -> None:
    from olmo_core.distributed.checkpoint import save_model_and_optim_state
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    warnings.filterwarnings("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE)
    torch.manual_seed(0)
    config = _config()
    model = config.build(init_device="cpu")
    model.init_weights(device=torch.device("cpu"), max_seq_len=16)
    model.apply_fsdp(dp_mesh=init_device_mesh("cpu", (WORLD_SIZE,)))
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    for _ in range(2):
        ids = torch.randint(0, VOCAB_SIZE, (2, 8), generator=torch.Generator().manual_seed(rank))
        model(ids).float().square().mean().backward()
        optim.step()
        optim.zero_grad()
    step_dir = os.path.join(out, "step3")
    save_model_and_optim_state(os.path.join(step_dir, "model_and_optim"), model, optim)
    live = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if rank == 0:
        experiment = {"run_name": "zerosafe-test", "model": config.as_config_dict()}
        with open(os.path.join(step_dir, "config.json"), "w") as f:
            json.dump(experiment, f)  # as OLMo-core's ConfigSaverCallback: json.dumps(config)
        os.makedirs(os.path.join(step_dir, "train"), exist_ok=True)
        torch.save({"global_step": 3}, os.path.join(step_dir, "train", "rank0.pt"))
        save_file(
            {k: v.contiguous() for k, v in live.items()}, os.path.join(out, "live.safetensors")
        )
        with open(os.path.join(out, "live_names.json"), "w") as f:
            json.dump(list(live), f)  # safetensors sorts its names: keep the model's order
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
        json.dump({"olmo_core": status}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
