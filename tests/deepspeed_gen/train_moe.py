"""Train a small mixture-of-experts model with real DeepSpeed on CPU (gloo) and save a checkpoint.

Run by `tests/deepspeed_gen/__init__.py` as
    DS_ACCELERATOR=cpu torchrun --nproc_per_node WS train_moe.py SPEC.json CKPT_DIR LIVE.safetensors
Two kinds of MoE layer (SPEC `autoep`):
- native DeepSpeed-MoE (`deepspeed.moe.layer.MoE`) in a tiny LM, ZeRO-1/2 (DeepSpeed refuses
  it at ZeRO-3). SPEC keys: num_experts, ep_sizes (one per MoE layer, e.g. [2, 1]),
  frozen_expert (freeze the first layer's experts' second Linear), groups (2: two named
  optimizer groups; DeepSpeed's MoE split needs names);
- AutoEP (`expert_parallel: {autoep_size}`) replacing the MoE blocks of a tiny transformers
  Mixtral, ZeRO-1/2/3 (ZeRO-3 writes the "partition-native" layout). SPEC keys: num_experts,
  ep_size.
Common keys: stage, precision (bf16|fp16|fp32), steps, data_before_expert (DeepSpeed's
`use_data_before_expert_parallelism` topology), grad_accum_dtype (fp32 with bf16 and ZeRO-1:
BF16_Optimizer), round_robin.

LIVE gets, from rank 0, the master weights at save time of every trained param under the
name, and with the shape, that a model with expert-parallel size 1 gives it: native local
expert `i` of expert-parallel rank `e` is global expert `e * num_local_experts + i` (the ids of
DeepSpeed's expert files, `_save_moe_checkpoint`); an AutoEP fused weight `experts.w1` is the
`[num_experts, ...]` tensor with each rank's local experts at the rows its placement names.
The masters are gathered exactly: ZeRO-1/2 as the fragments each rank holds
(`param._hp_mapping`), ZeRO-3 by DeepSpeed's all-gather of the partitions
(`safe_get_full_fp32_param`); frozen params and buffers are the module's own tensors.
"""

import json
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed
import torch
import torch.nn.functional as F
from deepspeed.moe.layer import MoE
from deepspeed.utils import groups, safe_get_full_fp32_param
from torch import nn

EXPERTS_INFIX = ".deepspeed_moe.experts.deepspeed_experts."


class Expert(nn.Module):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, width)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class MoEBlock(nn.Module):
    def __init__(self, width, hidden, num_experts, ep_size):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.moe = MoE(
            hidden_size=width, expert=Expert(width, hidden), num_experts=num_experts,
            ep_size=ep_size, k=1, capacity_factor=4.0, eval_capacity_factor=4.0, min_capacity=8,
        )  # fmt: skip

    def forward(self, x):
        out, l_aux, _ = self.moe(self.norm(x))
        return x + out, l_aux


class TinyMoE(nn.Module):
    def __init__(self, vocab, width, hidden, num_experts, ep_sizes):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.up = nn.Linear(width, width)
        self.blocks = nn.ModuleList(MoEBlock(width, hidden, num_experts, p) for p in ep_sizes)
        self.final_norm = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.register_buffer("step_scale", torch.linspace(0.5, 1.5, 5))

    def forward(self, tokens):
        with torch.no_grad():
            self.step_scale.mul_(1.01)
        h = self.embed(tokens)
        h = h + F.gelu(self.up(h))
        aux = 0.0
        for block in self.blocks:
            h, l_aux = block(h)
            aux = aux + l_aux
        return self.lm_head(self.final_norm(h)), aux


def ep_rank_of(rank, world, ep_size, data_before_expert):
    """DeepSpeed's expert-parallel rank of a rank (groups._create_expert_and_data_parallel)."""
    return rank // (world // ep_size) if data_before_expert else rank % ep_size


def make_config(spec):
    zero = {"stage": spec["stage"]}
    if spec.get("round_robin"):
        zero["round_robin_gradients"] = True
    if spec["stage"] == 3:
        zero["stage3_param_persistence_threshold"] = 0
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**9,
        "gradient_clipping": 1.0,
        "zero_optimization": zero,
        "optimizer": {"type": "AdamW", "params": {"lr": 2e-2, "torch_adam": True}},
    }
    if spec.get("data_before_expert"):
        config["use_data_before_expert_parallelism"] = True
    if spec.get("autoep"):
        config["expert_parallel"] = {
            "enabled": True, "autoep_size": spec["ep_size"], "preset_model": "mixtral",
            "use_grouped_mm": False,
        }  # fmt: skip
    precision = spec["precision"]
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    elif precision == "fp16":
        config["fp16"] = {
            "enabled": True, "loss_scale": 0, "initial_scale_power": 12,
            "loss_scale_window": 2, "hysteresis": 1, "min_loss_scale": 1,
        }  # fmt: skip
    if spec.get("grad_accum_dtype"):
        config["data_types"] = {"grad_accum_dtype": spec["grad_accum_dtype"]}
    return config


def native_model(spec, rank, world):
    vocab, width, hidden = spec.get("dims", [89, 24, 35])
    ep_sizes = spec.get("ep_sizes", [1])
    data_before = bool(spec.get("data_before_expert"))
    ep_ranks = [ep_rank_of(rank, world, p, data_before) for p in ep_sizes]
    model = TinyMoE(vocab, width, hidden, spec.get("num_experts", 2), ep_sizes)
    # Every expert starts from its own values, seeded by its global id: DeepSpeed deep-copies
    # one expert, so all would start equal and a mix-up of experts could go unseen.
    for index, block in enumerate(model.blocks):
        for local, expert in enumerate(block.moe.deepspeed_moe.experts.deepspeed_experts):
            gid = ep_ranks[index] * block.moe.num_local_experts + local
            gen = torch.Generator().manual_seed(1000 + 100 * index + gid)
            with torch.no_grad():
                for p in expert.parameters():
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    if spec.get("frozen_expert"):
        for expert in model.blocks[0].moe.deepspeed_moe.experts.deepspeed_experts:
            expert.fc2.requires_grad_(False)
    return model, vocab


def autoep_model(spec):
    from transformers import MixtralConfig, MixtralForCausalLM

    vocab, width, hidden = spec.get("dims", [97, 40, 45])
    config = MixtralConfig(
        vocab_size=vocab, hidden_size=width, intermediate_size=hidden, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=spec["num_experts"],
        num_experts_per_tok=2, max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip
    return MixtralForCausalLM(config), vocab


def expert_rows(engine, spec):
    """Per expert param of this rank: `(output name, experts held in local order, rows of the
    output tensor)`; AutoEP only (native experts are renamed, not placed)."""
    from deepspeed.checkpoint.autoep_affine import autoep_experts_for_rank
    from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer

    out = {}
    for path, module in engine.module.named_modules():
        if isinstance(module, AutoEPMoELayer):
            ep_rank = groups._get_expert_parallel_rank(module.ep_group_name)
            experts = autoep_experts_for_rank(module.expert_placement_descriptor, ep_rank)
            for wname, _ in module.experts.named_parameters():
                out[f"{path}.experts.{wname}"] = (list(experts), module.num_experts)
    return out


def native_name(name, engine, spec, rank, world):
    for index, block in enumerate(engine.module.blocks):
        prefix = f"blocks.{index}.moe{EXPERTS_INFIX}"
        if name.startswith(prefix):
            p = spec.get("ep_sizes", [1])[index]
            e = ep_rank_of(rank, world, p, bool(spec.get("data_before_expert")))
            local, _, rest = name[len(prefix) :].partition(".")
            return f"{prefix}{e * block.moe.num_local_experts + int(local)}.{rest}"
    return name


def live_fragments(engine, spec, rank, world):
    """This rank's part of the masters: name -> (output shape, [(flat start, fragment)])."""
    rows = expert_rows(engine, spec) if spec.get("autoep") else {}
    out = {}
    for name, p in engine.module.named_parameters():
        shape = tuple(p.ds_shape) if hasattr(p, "ds_shape") else tuple(p.shape)
        if spec["stage"] == 3:
            full = safe_get_full_fp32_param(p)  # an all-gather of the partitions: exact
            frags = [(0, full.detach().clone().reshape(-1))] if full is not None else []
        elif not p.requires_grad:
            frags = [(0, p.detach().clone().reshape(-1))]
        else:
            mapping = getattr(p, "_hp_mapping", None)
            frags = []
            if mapping is not None:
                frag = mapping.get_hp_fragment().detach().clone().reshape(-1)
                frags.append((mapping.lp_fragment_address.start, frag))
        if name in rows:
            experts, num_experts = rows[name]
            per = 1
            for s in shape[1:]:
                per *= s
            placed = []
            for start, frag in frags:
                done = 0
                while done < frag.numel():
                    local = (start + done) // per
                    within = (start + done) % per
                    count = min(frag.numel() - done, per - within)
                    placed.append((experts[local] * per + within, frag[done : done + count]))
                    done += count
            out[name] = ((num_experts, *shape[1:]), placed)
        elif spec.get("autoep"):
            out[name] = (shape, frags)
        else:
            out[native_name(name, engine, spec, rank, world)] = (shape, frags)
    return out


def assemble(parts):
    """Merge every rank's fragments; every element must be covered, and twice only with the
    same bytes (an expert-data-parallel group's ranks all hold the full ZeRO-3 gather)."""
    live = {}
    for name in sorted({n for part in parts for n in part}):
        shape = next(part[name][0] for part in parts if name in part)
        numel = 1
        for s in shape:
            numel *= s
        flat = None
        covered = torch.zeros(numel, dtype=torch.bool)
        for part in parts:
            for start, frag in part.get(name, (None, ()))[1]:
                if flat is None:
                    flat = torch.zeros(numel, dtype=frag.dtype)
                region = flat[start : start + frag.numel()]
                seen = covered[start : start + frag.numel()]
                if seen.any():
                    assert torch.equal(
                        region[seen].view(torch.uint8), frag[seen].view(torch.uint8)
                    ), name
                region.copy_(frag)
                seen.fill_(True)
        assert flat is not None and bool(covered.all()), f"{name}: not every element has a master"
        live[name] = flat.reshape(shape)
    return live


def non_persistent(model, name):
    """The non-persistent buffer names of the module holding buffer `name` (not saved)."""
    path = name.rpartition(".")[0]
    return model.get_submodule(path)._non_persistent_buffers_set if path else set()


def main():
    spec = json.load(open(sys.argv[1]))
    ckpt_dir, reference = sys.argv[2], sys.argv[3]
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    torch.manual_seed(spec.get("seed", 7))
    if spec.get("autoep"):
        model, vocab = autoep_model(spec)
        params = [p for p in model.parameters()]
    else:
        model, vocab = native_model(spec, rank, world)
        trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if spec.get("groups", 1) == 2:
            params = [
                {"name": "matrices", "params": [p for _, p in trainable if p.dim() == 2],
                 "weight_decay": 0.05},
                {"name": "vectors", "params": [p for _, p in trainable if p.dim() != 2],
                 "weight_decay": 0.0},
            ]  # fmt: skip
        else:
            params = [p for _, p in trainable]
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=params, config=make_config(spec)
    )
    if not spec.get("autoep"):
        data_before = bool(spec.get("data_before_expert"))
        for p in spec.get("ep_sizes", [1]):
            want = ep_rank_of(rank, world, p, data_before)
            assert groups._get_expert_parallel_rank(f"ep_size_{p}") == want
    gen = torch.Generator().manual_seed(31 + rank)
    for _ in range(spec.get("steps", 2)):
        tokens = torch.randint(0, vocab, (2, 8), generator=gen)
        if spec.get("autoep"):
            loss = engine(input_ids=tokens, labels=(tokens * 5 + 1) % vocab).loss
        else:
            logits, aux = engine(tokens)
            loss = F.cross_entropy(
                logits.float().reshape(-1, vocab), ((tokens * 5 + 1) % vocab).reshape(-1)
            )
            loss = loss + 0.01 * aux
        engine.backward(loss)
        engine.step()
    engine.save_checkpoint(ckpt_dir)

    mine = live_fragments(engine, spec, rank, world)
    parts = [None] * world
    torch.distributed.all_gather_object(parts, mine)
    if rank == 0:
        from safetensors.torch import save_file

        live = assemble(parts)
        live.update(
            {
                n: b.detach().clone().contiguous()
                for n, b in engine.module.named_buffers()
                if n.rpartition(".")[2] not in non_persistent(engine.module, n)
            }
        )
        save_file(live, reference, metadata={"optimizer": type(engine.optimizer).__name__})
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
