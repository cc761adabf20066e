"""Train a small `PipelineModule` with real DeepSpeed (pipeline parallel + ZeRO-1) on CPU ranks.

Run by `tests/deepspeed_gen/__init__.py` (`train_checkpoint(spec, dest, script=PIPE_SCRIPT)`) as
    DS_ACCELERATOR=cpu torchrun --nproc_per_node WS train_pipe.py SPEC.json CKPT_DIR LIVE.safetensors
SPEC keys: world_size, pipe (stages; world_size // pipe is the data-parallel size), stage
(0 or 1: the pipeline engine refuses ZeRO-2/3), precision (bf16|fp32), grad_accum_dtype (fp32
with bf16: DeepSpeed's BF16_Optimizer), tied (the embedding and the LM head are one
`TiedLayerSpec`, kept on the first and the last stage; the head is a `forward_fn` on the
embedding, which DeepSpeed saves no layer file for), tied_head ("module": the tied module is
its own head too, with a buffer, so both its layer indices write a layer file), frozen (the
`up` of the first block of every stage never trains), layers (blocks), dims [vocab, width,
hidden], steps.

LIVE gets, at save time, every stage's fp32 master weights (`safe_get_full_fp32_param`,
gathered over the stage's data-parallel ranks) and buffers, under the names of the stages'
`PipelineModule.state_dict()` (`tied_modules.embed.weight`, `2.up.weight`): what a conversion
of the checkpoint must give. A param held by several stages (a tied one) is written once,
after checking every stage's master is the same bytes (metadata `tied_stages`).
"""

import json
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed
import torch
import torch.nn.functional as F
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from deepspeed.utils import safe_get_full_fp32_param
from torch import nn


class Block(nn.Module):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.down = nn.Linear(hidden, width)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 5))
        self.register_buffer("calls", torch.zeros(2, dtype=torch.int64))

    def forward(self, x):
        with torch.no_grad():
            self.calls.add_(3)
        return x + self.down(F.gelu(self.norm(self.up(x)))) * self.scale.mean()


class EmbedOrHead(nn.Module):
    """One weight for the embedding (token ids in) and the LM head (hidden states in)."""

    def __init__(self, vocab: int, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(vocab, width))
        self.register_buffer("temperature", torch.tensor([1.0, 0.5]))

    def forward(self, x):
        if x.is_floating_point():
            return (x @ self.weight.t()) / self.temperature[0]
        return F.embedding(x, self.weight)


def lm_head(embed: nn.Embedding, h):
    """The tied LM head: the embedding matrix, transposed."""
    return h @ embed.weight.t()


def scale_down(h):
    """A layer without parameters (a function): it takes a layer index and writes no file."""
    return h * 0.5


def layer_specs(spec):
    vocab, width, hidden = spec.get("dims", [97, 40, 67])
    tied = spec.get("tied", False)
    dual = spec.get("tied_head") == "module"
    layers = []
    if tied and dual:
        layers.append(TiedLayerSpec("embed", EmbedOrHead, vocab, width))
    elif tied:
        layers.append(TiedLayerSpec("embed", nn.Embedding, vocab, width))
    else:
        layers.append(LayerSpec(nn.Embedding, vocab, width))
    layers.append(scale_down)
    layers += [LayerSpec(Block, width, hidden) for _ in range(spec.get("layers", 3))]
    layers.append(LayerSpec(nn.LayerNorm, width))
    if tied and dual:
        layers.append(TiedLayerSpec("embed", EmbedOrHead, vocab, width))
    elif tied:
        layers.append(TiedLayerSpec("embed", nn.Embedding, vocab, width, forward_fn=lm_head))
    else:
        layers.append(LayerSpec(nn.Linear, width, vocab, bias=False))
    return layers, vocab


def loss_fn(logits, labels):
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))


def make_config(spec, dp):
    micro, accum = 2, 2
    config = {
        "train_batch_size": micro * accum * dp,
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accum,
        "steps_per_print": 10**9,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": spec.get("stage", 1)},
        "optimizer": {"type": "AdamW", "params": {"lr": 2e-2, "torch_adam": True}},
    }
    if spec["precision"] == "bf16":
        config["bf16"] = {"enabled": True}
    if spec.get("grad_accum_dtype"):
        config["data_types"] = {"grad_accum_dtype": spec["grad_accum_dtype"]}
    return config


def main():
    spec = json.load(open(sys.argv[1]))
    ckpt_dir, live_file = sys.argv[2], sys.argv[3]
    deepspeed.init_distributed(dist_backend="gloo")
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    pipe = spec.get("pipe", 2)
    torch.manual_seed(spec.get("seed", 7))
    layers, vocab = layer_specs(spec)
    model = PipelineModule(
        layers=layers, num_stages=pipe, loss_fn=loss_fn, partition_method="uniform",
        seed_layers=True, base_seed=11,
    )  # fmt: skip
    first_block = next((m for m in model.modules() if isinstance(m, Block)), None)
    if spec.get("frozen") and first_block is not None:  # the first block this stage builds
        for p in first_block.up.parameters():
            p.requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=params, config=make_config(spec, world // pipe)
    )
    dp_rank = engine.grid.get_data_parallel_rank()
    gen = torch.Generator().manual_seed(31 + dp_rank)

    def batches():
        while True:
            tokens = torch.randint(0, vocab, (2, 6), generator=gen)
            yield tokens, (tokens * 5 + 1) % vocab

    data = batches()
    for _ in range(spec.get("steps", 2)):
        engine.train_batch(data_iter=data)
    engine.save_checkpoint(ckpt_dir)

    # Every stage's fp32 masters (collective over the stage's data-parallel group) and buffers.
    stage = engine.grid.get_stage_id()
    live = {}
    for name, p in engine.module.named_parameters():
        full = safe_get_full_fp32_param(p) if p.requires_grad else None
        live[name] = (full if full is not None else p).detach().clone().float().contiguous()
        if not p.requires_grad:
            live[name] = p.detach().clone().contiguous()
    for name, b in engine.module.named_buffers():
        live[name] = b.detach().clone().contiguous()
    from safetensors.torch import load_file, save_file

    part = f"{live_file}.stage{stage}"
    if dp_rank == 0:
        save_file(live, part, metadata={"optimizer": type(engine.optimizer).__name__})
    torch.distributed.barrier()
    if rank == 0:
        merged, stages_of = {}, {}
        for s in range(pipe):
            for name, t in load_file(f"{live_file}.stage{s}").items():
                if name in merged:
                    same = torch.equal(merged[name].view(torch.uint8), t.view(torch.uint8))
                    assert same, f"{name}: stage {s} holds other bytes than an earlier stage"
                else:
                    merged[name] = t
                stages_of.setdefault(name, []).append(s)
        tied_stages = {n: s for n, s in stages_of.items() if len(s) > 1}
        save_file(
            merged, live_file,
            metadata={"optimizer": type(engine.optimizer).__name__,
                      "tied_stages": json.dumps(tied_stages)},
        )  # fmt: skip
        for s in range(pipe):
            os.unlink(f"{live_file}.stage{s}")
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
