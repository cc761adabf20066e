"""Train a small model with real DeepSpeed ZeRO on CPU (gloo) and save a checkpoint.

Run by `tests/deepspeed_gen/__init__.py` as
    DS_ACCELERATOR=cpu torchrun --nproc_per_node WS train_zero.py SPEC.json CKPT_DIR REFERENCE.safetensors
SPEC keys: stage, precision (bf16|fp16|fp32), tied, frozen, groups (1|2), steps, sub_group_size,
round_robin, grad_accum_dtype, legacy_files (the legacy non-zip torch format), dims
[vocab, width, hidden], layers, plus the layouts of issue 14: master (bf16|fp16: low-precision
master weights, `bf16_master_weights_and_grads` / `fp16_master_weights_and_grads`),
bf16_optimizer_states, offload (cpu|nvme: `offload_optimizer`), cpu_adam (DeepSpeedCPUAdam
instead of torch's AdamW), optimizer (muon), zero_size (two zero-element params).
REFERENCE gets the live training weights (gathered) and buffers at the end, for checks where
DeepSpeed's own converter has no answer (frozen params under ZeRO-1, BF16_Optimizer).
"""

import contextlib
import json
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed
import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.down = nn.Linear(hidden, width)

    def forward(self, x):
        return x + self.down(F.gelu(self.norm(self.up(x))))


class TinyLM(nn.Module):
    def __init__(self, vocab, width, hidden, layers, tied, frozen, zero_size=False):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.zero_size = zero_size
        if zero_size:  # zero-element params (a layer configured to size 0)
            self.empty = nn.Module()
            self.empty.vec = nn.Parameter(torch.zeros(0))
            self.empty.mat = nn.Parameter(torch.zeros(0, width))
        self.blocks = nn.ModuleList(Block(width, hidden) for _ in range(layers))
        self.frozen = frozen
        if frozen:  # a frozen side path, used in forward, never updated (LoRA-style base weights)
            self.side = nn.Linear(width, 13)
            self.side_out = nn.Linear(13, width, bias=False)
            for p in (*self.side.parameters(), *self.side_out.parameters()):
                p.requires_grad_(False)
        self.final_norm = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        if tied:
            self.lm_head.weight = self.embed.weight
        self.register_buffer("step_scale", torch.linspace(0.5, 1.5, 9))
        self.register_buffer("step_count", torch.zeros(3, dtype=torch.int64))

    def forward(self, tokens):
        with torch.no_grad():
            self.step_count.add_(7)
            self.step_scale.mul_(1.01)
        h = self.embed(tokens)
        if self.zero_size == "used":  # ZeRO-3 cannot gather them (AssertionError: NOT_AVAILABLE)
            h = h + self.empty.vec.sum() + self.empty.mat.sum()
        for block in self.blocks:
            h = block(h)
        if self.frozen:
            h = h + self.side_out(torch.tanh(self.side(h)))
        return self.lm_head(self.final_norm(h))


def make_config(spec):
    """The DeepSpeed config of a spec (see the module docstring)."""
    zero = {"stage": spec["stage"]}
    if spec["stage"] == 3:
        zero["stage3_param_persistence_threshold"] = spec.get("persistence_threshold", 0)
        if "sub_group_size" in spec:
            zero["sub_group_size"] = spec["sub_group_size"]
    if spec.get("round_robin"):
        zero["round_robin_gradients"] = True
    if spec.get("optimizer") == "muon" and spec["stage"] == 3:
        # stage3.py: "Muon and reduce scatter cannot be used together"
        zero["reduce_scatter"] = False
    if spec.get("offload"):
        zero["offload_optimizer"] = {"device": spec["offload"], "pin_memory": False}
        if spec["offload"] == "nvme":
            zero["offload_optimizer"]["nvme_path"] = os.path.join(os.getcwd(), "nvme")
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**9,
        "gradient_clipping": 1.0,
        "zero_optimization": zero,
        "optimizer": {"type": "AdamW", "params": {"lr": 2e-2, "torch_adam": True}},
    }
    if spec.get("cpu_adam"):
        config["optimizer"]["params"].pop("torch_adam")
    if spec.get("optimizer") == "muon":
        config["optimizer"] = {"type": "Muon", "params": {"lr": 2e-2, "momentum": 0.9}}
    if spec.get("offload") and not spec.get("cpu_adam"):
        config["zero_force_ds_cpu_optimizer"] = False
    precision = spec["precision"]
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
        if spec.get("master") == "bf16":
            config["bf16"]["bf16_master_weights_and_grads"] = True
            config["bf16"]["bf16_optimizer_states"] = bool(spec.get("bf16_optimizer_states"))
    elif precision == "fp16":
        config["fp16"] = {
            "enabled": True,
            "loss_scale": 0,
            "initial_scale_power": 12,
            "loss_scale_window": 2,
            "hysteresis": 1,
            "min_loss_scale": 1,
        }
        if spec.get("master") == "fp16":
            config["fp16"]["fp16_master_weights_and_grads"] = True
    if spec.get("grad_accum_dtype"):
        config["data_types"] = {"grad_accum_dtype": spec["grad_accum_dtype"]}
    if spec.get("legacy_files"):  # torch.save(..., _use_new_zipfile_serialization=False)
        config["checkpoint"] = {"checkpoint_serialization": False}
    return config


def main():
    spec = json.load(open(sys.argv[1]))
    ckpt_dir, reference = sys.argv[2], sys.argv[3]
    deepspeed.init_distributed(dist_backend="gloo")
    rank = int(os.environ.get("RANK", 0))
    vocab, width, hidden = spec.get("dims", [97, 40, 67])
    torch.manual_seed(spec.get("seed", 7))
    model = TinyLM(
        vocab,
        width,
        hidden,
        spec.get("layers", 2),
        spec.get("tied", False),
        spec.get("frozen", False),
        spec.get("zero_size") and ("used" if spec["stage"] < 3 else "unused"),
    )
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if spec.get("groups", 1) == 2:
        matrices = [p for n, p in trainable if p.dim() == 2]
        vectors = [p for n, p in trainable if p.dim() != 2]
        params = [
            {"params": matrices, "weight_decay": 0.05},
            {"params": vectors, "weight_decay": 0.0},
        ]
    else:
        params = [p for _, p in trainable]
    config = make_config(spec)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=params, config=config)
    gen = torch.Generator().manual_seed(31 + rank)
    for _ in range(spec.get("steps", 2)):
        tokens = torch.randint(0, vocab, (2, 6), generator=gen)
        logits = engine(tokens)
        loss = F.cross_entropy(
            logits.float().reshape(-1, vocab), ((tokens * 5 + 1) % vocab).reshape(-1)
        )
        engine.backward(loss)
        engine.step()
    engine.save_checkpoint(ckpt_dir)

    all_params = list(engine.module.parameters())
    gather = (
        deepspeed.zero.GatheredParameters(all_params, modifier_rank=None)
        if spec["stage"] == 3
        else contextlib.nullcontext()
    )
    with gather:
        live = {
            n: p.detach().clone().cpu().contiguous() for n, p in engine.module.named_parameters()
        }
    live.update(
        {n: b.detach().clone().cpu().contiguous() for n, b in engine.module.named_buffers()}
    )
    if rank == 0:
        from safetensors.torch import save_file

        save_file(live, reference, metadata={"optimizer": type(engine.optimizer).__name__})
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
