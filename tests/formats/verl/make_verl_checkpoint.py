"""Write a real verl FSDP checkpoint on CPU: `python -m tests.formats.verl.make_verl_checkpoint OUT`.

Two gloo ranks train a tiny random Llama (tied embeddings, a vocabulary of 67 so the
embedding's dim-0 shards are uneven: 34 and 33 rows) for two AdamW steps under FSDP2
(`fully_shard` of each decoder layer, then the root), and save it with verl 0.9.1's own
`FSDPCheckpointManager.save_checkpoint` into `OUT/global_step_2/actor/`: the rank files
`model_world_size_2_rank_{0,1}.pt` (DTensor local shards), `optim_...`/`extra_state_...`,
`fsdp_config.json` and `huggingface/` (config, tokenizer).

The same ranks also save, with the same manager, `OUT/replicate/` (every parameter a
`Replicate()` DTensor), `OUT/shard1/` (FSDP2 with `Shard(1)` placements, which zerosafe refuses)
`OUT/lora/` (a peft LoRA actor), `OUT/fsdp1/` (verl's FSDP1 actor: DTensors too) and
`OUT/sharded_tensor/` (FSDP1 without a device mesh: ShardedTensors, which zerosafe refuses)
and `OUT/quant/` (a Llama whose linear dims take every `--quantize` scheme: hidden 256,
intermediate 384, so a 128-row block band of gate/up straddles the two ranks' 192 rows),
each at `global_step_1/actor/` with its live weights.

Beside the main one, rank 0 writes the live model's full weights (`OUT/live.safetensors`, gathered with
`full_tensor()` right after the save) and its logits on fixed input ids
(`OUT/live-logits.safetensors`). Then, in a single process, verl's own `model_merger`
(`FSDPModelMerger.merge_and_save`) merges the checkpoint into `OUT/merged/` as its users run it
(and the LoRA actor into `OUT/lora/merged/`); `OUT/status.json` says which of these worked.

verl's package `__init__` (and that of `verl.utils.checkpoint`) import its Ray controller, which
this CPU test environment does not install (ray is a large runtime the checkpoint code never
uses); `_import_verl` makes those two packages importable without running their `__init__`, so
the manager's and the merger's modules themselves load and run unchanged.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import sys
import types
from pathlib import Path

import torch

VOCAB = 67
STEPS = 2
TAG = f"global_step_{STEPS}"


def _import_verl() -> None:
    for name in ("verl", "verl.utils.checkpoint"):
        if name in sys.modules:
            continue
        spec = importlib.util.find_spec(name)
        assert spec is not None and spec.submodule_search_locations is not None, name
        module = types.ModuleType(name)
        module.__path__ = list(spec.submodule_search_locations)
        module.__file__ = spec.origin
        sys.modules[name] = module


def build_tokenizer():  # type: ignore[no-untyped-def]
    """A WordLevel tokenizer made offline, wrapped as transformers' fast tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["[UNK]", "[PAD]", "[BOS]", "[EOS]"] + [f"w{i}" for i in range(VOCAB - 4)]
    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", bos_token="[BOS]",
        eos_token="[EOS]",
    )  # fmt: skip


def build_model(hidden: int = 24, intermediate: int = 40):  # type: ignore[no-untyped-def]
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=True, bos_token_id=2, eos_token_id=3, pad_token_id=1,
        architectures=["LlamaForCausalLM"],
    )  # fmt: skip
    return LlamaForCausalLM(config)


def input_ids() -> torch.Tensor:
    return torch.arange(2 * 9).reshape(2, 9) % VOCAB


def _save(model, out: str, step: int, contents: list[str], **kw) -> None:  # type: ignore[no-untyped-def]
    """verl's own save, as its FSDP workers call it."""
    from omegaconf import OmegaConf
    from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager

    manager = FSDPCheckpointManager(
        model=model, processing_class=build_tokenizer(),
        checkpoint_config=OmegaConf.create({"save_contents": contents}), **kw,
    )  # fmt: skip
    manager.save_checkpoint(f"{out}/global_step_{step}/actor", global_step=step)


def _save_live(model, path: str, rank: int) -> None:  # type: ignore[no-untyped-def]
    from safetensors.torch import save_file
    from torch.distributed.tensor import DTensor

    full = {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
        for k, v in model.state_dict().items()
    }
    if rank == 0:
        # save_file refuses tensors sharing memory: the tied head is a separate copy here
        save_file({k: v.contiguous() for k, v in full.items()}, path)


def fsdp2(rank: int, mesh, out: str) -> None:  # type: ignore[no-untyped-def]
    """The main checkpoint: verl's FSDP2 actor, trained two steps, saved with its optimizer."""
    from safetensors.torch import save_file
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(7)
    model = build_model()
    # verl's FSDP2 actor: a 1-D mesh named "fsdp" (`create_device_mesh`), each decoder layer
    # sharded, then the root
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(STEPS):
        batch = torch.randint(0, VOCAB, (2, 8), generator=g)
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    _save(model, out, STEPS, ["model", "optimizer", "extra"], optimizer=optimizer,
          lr_scheduler=scheduler)  # fmt: skip
    _save_live(model, f"{out}/live.safetensors", rank)
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=input_ids()).logits
    if rank == 0:
        save_file({"logits": logits.contiguous()}, f"{out}/live-logits.safetensors")


def replicate(rank: int, mesh, out: str) -> None:  # type: ignore[no-untyped-def]
    """Every parameter a `Replicate()` DTensor (`distribute_module`'s default), saved by
    verl's manager: the other placement the reader takes."""
    from torch.distributed.tensor import distribute_module

    torch.manual_seed(8)
    model = distribute_module(build_model(), mesh)
    _save(model, out, 1, ["model"])
    _save_live(model, f"{out}/live.safetensors", rank)


def shard1(rank: int, mesh, out: str) -> None:  # type: ignore[no-untyped-def]
    """FSDP2 with `shard_placement_fn` sharding matrices on dim 1: a placement refused."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    torch.manual_seed(9)
    model = build_model()
    fully_shard(model, mesh=mesh, shard_placement_fn=lambda p: Shard(1) if p.ndim == 2 else None)
    _save(model, out, 1, ["model"])


def lora(rank: int, mesh, out: str) -> None:  # type: ignore[no-untyped-def]
    """A LoRA actor (peft on q/v projections, as verl's `lora_rank`), FSDP2, one step."""
    from peft import LoraConfig, get_peft_model
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(11)
    model = get_peft_model(
        build_model(),
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"),
    )
    for layer in model.base_model.model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    batch = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(rank))
    model(input_ids=batch, labels=batch).loss.backward()
    optimizer.step()
    _save(model, out, 1, ["model"])
    _save_live(model, f"{out}/live.safetensors", rank)


def fsdp1(rank: int, mesh, out: str, *, with_mesh: bool = True) -> None:  # type: ignore[no-untyped-def]
    """verl's FSDP1 actor (`FullyShardedDataParallel` with its device mesh, each decoder layer
    wrapped, flat params; `device_id` the CPU here): the manager saves a `SHARDED_STATE_DICT`,
    of DTensors (torch's FSDP1 makes them when given a device mesh, as verl does). Without
    the mesh (`with_mesh=False`), of `ShardedTensor`s."""
    import functools

    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    torch.manual_seed(10)
    policy = functools.partial(
        transformer_auto_wrap_policy, transformer_layer_cls={LlamaDecoderLayer}
    )
    model = FSDP(
        build_model(), auto_wrap_policy=policy, device_mesh=mesh if with_mesh else None,
        use_orig_params=False,
        device_id=torch.device("cpu"),
    )  # fmt: skip
    _save(model, out, 1, ["model"])
    with FSDP.summon_full_params(model, writeback=False):
        full = {k: v.detach().clone() for k, v in model.module.state_dict().items()}
    if rank == 0:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in full.items()}, f"{out}/live.safetensors")


def sharded_tensor(rank: int, mesh, out: str) -> None:  # type: ignore[no-untyped-def]
    fsdp1(rank, mesh, out, with_mesh=False)


def quant(rank: int, mesh, out: str) -> None:  # type: ignore[no-untyped-def]
    """verl's FSDP2 actor as `fsdp2`, one AdamW step, at dims every `--quantize` scheme takes
    (128x128 blocks, groups of 16): q/o [256, 256], k/v [128, 256], gate/up [384, 256]."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(12)
    model = build_model(hidden=256, intermediate=384)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(rank))
    model(input_ids=batch, labels=batch).loss.backward()
    optimizer.step()
    _save(model, out, 1, ["model"])
    _save_live(model, f"{out}/live.safetensors", rank)


VARIANTS = {
    "fsdp2": fsdp2,
    "replicate": replicate,
    "shard1": shard1,
    "lora": lora,
    "fsdp1": fsdp1,
    "sharded_tensor": sharded_tensor,
    "quant": quant,
}


def worker(rank: int, world_size: int, out: str, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world_size)
    _import_verl()
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("fsdp",))
    status = {}
    only = os.environ.get("VERL_VARIANTS")  # a comma-separated subset, when debugging one
    for name, make in VARIANTS.items():
        if only and name not in only.split(","):
            continue
        folder = out if name == "fsdp2" else f"{out}/{name}"
        try:
            make(rank, mesh, folder)
            status[name] = "ok"
        except Exception as e:  # reported by the tests that need this checkpoint
            status[name] = f"{type(e).__name__}: {e}"
        torch.distributed.barrier()
    if rank == 0:
        Path(out, "status-ranks.json").write_text(json.dumps(status))
    torch.distributed.destroy_process_group()


def merge(out: str, tag: str = TAG) -> None:
    """verl's own merger, as `python -m verl.model_merger merge --backend fsdp` runs it, into
    `OUT/merged` (a LoRA actor: the base model there, the adapter in `merged/lora_adapter`)."""
    _import_verl()
    from verl.model_merger.base_model_merger import ModelMergerConfig
    from verl.model_merger.fsdp_model_merger import FSDPModelMerger

    local = f"{out}/{tag}/actor"
    config = ModelMergerConfig(
        operation="merge", backend="fsdp", local_dir=local, target_dir=f"{out}/merged",
        hf_model_config_path=f"{local}/huggingface",
    )  # fmt: skip
    os.makedirs(config.target_dir, exist_ok=True)
    FSDPModelMerger(config).merge_and_save()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    import torch.multiprocessing as mp

    out = sys.argv[1]
    mp.spawn(worker, args=(2, out, _free_port()), nprocs=2, join=True)
    status = json.loads(Path(out, "status-ranks.json").read_text())
    for name, folder, tag in (
        ("merger", out, TAG),
        ("lora-merger", f"{out}/lora", "global_step_1"),
    ):
        try:
            merge(folder, tag)
            status[name] = "ok"
        except Exception as e:  # reported by the test that needs the merger's output
            status[name] = f"{type(e).__name__}: {e}"
    Path(out, "status.json").write_text(json.dumps(status))


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
