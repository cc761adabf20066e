"""Write an accelerate FSDP2 `SHARDED_STATE_DICT` save in the HF Trainer's folder layout, on
CPU (gloo, 2 ranks, a tiny random Llama), and the live weights and logits to compare with.

The Trainer's `_save_checkpoint` under FSDP calls accelerate's `save_fsdp_model` and
`save_fsdp_optimizer` into `checkpoint-N/` and `save_pretrained`s the config beside them. The
Trainer itself is not run (its FSDP path needs an accelerator device), so this script calls
those two accelerate functions from an `Accelerator` with an FSDP2 plugin, as the Trainer
does, and writes the config and generation config with `save_pretrained` into the same folder.

Writes, under OUT:
- `checkpoint-4/`: `pytorch_model_fsdp_0/` (DCP, `{"model": ...}`), `optimizer_0/` (DCP,
  `{"optimizer": ...}`), `config.json`, `generation_config.json`, `trainer_state.json`;
- `live.safetensors`: the full weights gathered from the live model right after saving;
- `input-ids.safetensors`, `live-logits.safetensors`: a batch and the live model's logits.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

import torch
import torch.multiprocessing as mp


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _config():  # type: ignore[no-untyped-def]
    import transformers

    return transformers.LlamaConfig(
        vocab_size=61, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
        tie_word_embeddings=False,
    )  # fmt: skip


def _worker(rank: int, world_size: int, out: str, port: int) -> None:
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )  # fmt: skip
    import transformers
    from accelerate import Accelerator
    from accelerate.utils import (
        FullyShardedDataParallelPlugin,
        save_fsdp_model,
        save_fsdp_optimizer,
    )
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_config())
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, state_dict_type="SHARDED_STATE_DICT", reshard_after_forward=True,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
    )  # fmt: skip
    accelerator = Accelerator(cpu=True)  # MULTI_CPU: accelerate applies FSDP on devices only
    for layer in model.model.layers:  # what `prepare` does with this plugin: FSDP2 per decoder
        fully_shard(layer, reshard_after_forward=True)  # layer, then the root
    fully_shard(model, reshard_after_forward=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    for step in range(2):
        ids = torch.randint(
            0, 61, (2, 7), generator=torch.Generator().manual_seed(rank * 10 + step)
        )
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    ckpt = os.path.join(out, "checkpoint-4")
    os.makedirs(ckpt, exist_ok=True)
    save_fsdp_model(plugin, accelerator, model, ckpt)
    save_fsdp_optimizer(plugin, accelerator, optimizer, model, ckpt)
    full = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    ids = torch.randint(0, 61, (2, 9), generator=torch.Generator().manual_seed(99))
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    if rank == 0:
        unwrapped = model
        unwrapped.config.save_pretrained(ckpt)
        unwrapped.generation_config.save_pretrained(ckpt)
        Path(ckpt, "trainer_state.json").write_text(json.dumps({"global_step": 4}))
        save_file(
            {k: v.contiguous() for k, v in full.items()}, os.path.join(out, "live.safetensors")
        )
        save_file({"input_ids": ids}, os.path.join(out, "input-ids.safetensors"))
        save_file({"logits": logits.contiguous()}, os.path.join(out, "live-logits.safetensors"))
    accelerator.wait_for_everyone()
    torch.distributed.destroy_process_group()


def main(out: str) -> None:
    Path(out).mkdir(parents=True, exist_ok=True)
    mp.spawn(_worker, args=(2, out, _port()), nprocs=2, join=True)


if __name__ == "__main__":
    main(sys.argv[1])
