"""Write real megatron-core `torch_dist` checkpoints with megatron-core's own save code, on CPU.

    /work/mcore-venv/bin/python tests/formats/megatron/make_megatron_checkpoint.py OUT_DIR [NAME...]

Runs in its own environment (Python >= 3.12, torch 2.13.0, megatron-core 0.19.2, psutil:
`python3.12 -m venv V && V/bin/pip install torch==2.13.0 megatron-core==0.19.2 psutil
safetensors`), never in the test suite's: the tests read the committed saves only
(tests/formats/megatron/fixtures/, remade with the command above into that folder).

Saves of a tiny Llama-style `GPTModel` (2 layers, hidden 32, 4 query heads in 2 query
groups, SwiGLU FFN 48, RMSNorm, RoPE, no linear biases, vocab 53 padded as Megatron-LM pads
it, to a multiple of 128 x TP), each on 2 gloo ranks (`NAME`s: only those; default: all):
- `tp2/`: tensor parallel 2, untied embeddings;
- `tp1dp2/`: tensor parallel 1 x data parallel 2;
- `tp2tied/`: tensor parallel 2, the output layer tied to the embedding (no `output_layer`);
- `qwen2tp2/`: tensor parallel 2 with QKV biases (`--add-qkv-bias`, Qwen2-style);
- `qwen3tp2/`: tensor parallel 2 with query/key norms (`--qk-layernorm`, Qwen3-style) and
  `kv_channels` 16, not hidden / heads (Qwen3's `head_dim`);
- `moetp2ep2/`: a Mixtral-style MoE (`--num-experts 4 --moe-router-topk 2`, SequentialMLP
  experts of FFN 48, megatron-core's default softmax top-k router) at tensor parallel 2 and
  expert parallel 2 with expert tensor parallel 1 (no sequence parallel: megatron-core's torch
  norms refuse it): the attention is split over the two ranks, and each rank holds 2 of the 4
  experts whole (seeded per expert-parallel rank, so a misplaced expert shows);
  the optimizer is megatron-core's chained one (`chained_0.optimizer...` for the dense
  parameters, `chained_1...` for the experts').
Each is saved the way Megatron-LM's `save_checkpoint` saves it: the state dict of
`generate_state_dict` (`args`, `checkpoint_version`, `iteration`, `model` as the model's
`sharded_state_dict()`, `optimizer` as the `DistributedOptimizer`'s state in Megatron-LM's
default `dp_reshardable` form after one Adam step; `rng_state` is left out: it needs CUDA),
through `dist_checkpointing.save(..., SAVE/iter_0000003, 'torch_dist')`, then
`SAVE/latest_checkpointed_iteration.txt`.

Shims that change nothing written: the work runs under the `__main__` guard (the writer
starts a spawned helper that re-imports this script); `torch.cuda.synchronize` and
`current_stream` are no-ops and `current_device` is the CPU (megatron-core places the failure
flag it broadcasts after the save there); while the optimizer is built and stepped,
`_CudaToCpu` makes the tensors it asks for on `cuda` on the CPU.

Also written beside each save:
- `SAVE/live.safetensors`: every parameter gathered to its full size over the tensor-parallel
  group (experts over the expert-parallel group, under their global numbers), in Megatron's
  names with the layer number (`decoder.layers.0.self_attention...`), the reference a
  conversion must equal bit for bit;
- `SAVE/args.json`: the architecture fields of the args saved.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.overrides import TorchFunctionMode

WORLD_SIZE = 2
ITERATION = 3
VOCAB = 53
DIVISIBLE_BY = 128


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _shim_cuda() -> None:
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    torch.cuda.current_stream = lambda *a, **k: None  # type: ignore[assignment]


class _CudaToCpu(TorchFunctionMode):
    """Tensors megatron-core's optimizer asks for on `cuda` (its overflow flag, its buffers)
    are made on the CPU, and its check that parameters are CUDA tensors passes: only where they
    live changes, not what is saved."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = dict(kwargs or {})
        if str(kwargs.get("device", "")).startswith("cuda"):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # the optimizer's check that a parameter is a `torch.cuda.FloatTensor`
            return func(*args).replace("torch.", "torch.cuda.", 1)
        if func is torch.Tensor.to and args[1:] and str(args[1]).startswith("cuda"):
            return args[0]
        return func(*args, **kwargs)


SAVES: dict[str, dict[str, object]] = {
    "tp2": {"tp": 2},
    "tp1dp2": {"tp": 1},
    "tp2tied": {"tp": 2, "tied": True},
    "qwen2tp2": {"tp": 2, "qkv_bias": True},
    "qwen3tp2": {"tp": 2, "qk_norm": True, "kv_channels": 16},
    "moetp2ep2": {"tp": 2, "experts": 4, "ep": 2},
}
"""Each save's variant of the model (`_args`' keywords)."""


def _args(
    tp: int,
    tied: bool = False,
    qkv_bias: bool = False,
    qk_norm: bool = False,
    kv_channels: int = 8,
    experts: int | None = None,
    ep: int = 1,
) -> argparse.Namespace:
    """The architecture fields of Megatron-LM's args (megatron/training/arguments.py names),
    and an enum as Megatron-LM's args hold one (`--attention-backend`'s default)."""
    from megatron.core.transformer.enums import AttnBackend

    multiple = DIVISIBLE_BY * tp
    padded = (VOCAB + multiple - 1) // multiple * multiple
    return argparse.Namespace(
        num_layers=2, hidden_size=32, ffn_hidden_size=48, num_attention_heads=4,
        group_query_attention=True, num_query_groups=2, kv_channels=kv_channels,
        seq_length=64, max_position_embeddings=64, position_embedding_type="rope",
        rotary_base=10000, rotary_percent=1.0, rotary_interleaved=False,
        use_rope_scaling=False, normalization="RMSNorm", norm_epsilon=1e-5, swiglu=True,
        untie_embeddings_and_output_weights=not tied, add_bias_linear=False, add_qkv_bias=qkv_bias,
        qk_layernorm=qk_norm, num_experts=experts,
        moe_router_topk=2, moe_ffn_hidden_size=48 if experts else None, moe_grouped_gemm=False, vocab_size=VOCAB, padded_vocab_size=padded,
        make_vocab_size_divisible_by=DIVISIBLE_BY, tensor_model_parallel_size=tp,
        expert_model_parallel_size=ep, expert_tensor_parallel_size=1 if experts else None,
        pipeline_model_parallel_size=1, params_dtype=torch.float32, bf16=False, fp16=False,
        init_method_std=0.02, attention_dropout=0.0, hidden_dropout=0.0,
        apply_layernorm_1p=False, transformer_impl="local", iteration=ITERATION,
        attention_backend=AttnBackend.auto,
    )  # fmt: skip


def _worker(rank: int, out: str, port: int, variant: dict[str, object]) -> None:
    _shim_cuda()
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig
    from safetensors.torch import save_file

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE)
    args = _args(**variant)  # type: ignore[arg-type]
    tp, tied = args.tensor_model_parallel_size, not args.untie_embeddings_and_output_weights
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size,
    )
    config = TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size, num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups, kv_channels=args.kv_channels,
        normalization=args.normalization, layernorm_epsilon=args.norm_epsilon,
        gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        add_bias_linear=False, add_qkv_bias=args.add_qkv_bias, qk_layernorm=args.qk_layernorm,
        tensor_model_parallel_size=tp, num_moe_experts=args.num_experts,
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size,
        moe_router_topk=args.moe_router_topk, moe_ffn_hidden_size=args.moe_ffn_hidden_size,
        moe_token_dispatcher_type="allgather",
        use_cpu_initialization=True, params_dtype=torch.float32,
        hidden_dropout=0.0, attention_dropout=0.0, init_method_std=args.init_method_std,
    )  # fmt: skip
    torch.manual_seed(0)
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(
            normalization="RMSNorm", qk_layernorm=args.qk_layernorm,
            num_experts=args.num_experts, moe_grouped_gemm=False,
        ),
        vocab_size=args.padded_vocab_size, max_sequence_length=args.max_position_embeddings,
        share_embeddings_and_output_weights=tied, position_embedding_type="rope",
        rotary_base=args.rotary_base,
    )  # fmt: skip
    # Every element distinct and random (norms start at one): a misplaced element shows. The
    # seed is the tensor-parallel rank's, so data-parallel replicas hold the same weights;
    # an expert-parallel rank's experts get their own.
    gen = torch.Generator().manual_seed(1 + parallel_state.get_tensor_model_parallel_rank())
    ep_gen = torch.Generator().manual_seed(100 + parallel_state.get_expert_model_parallel_rank())
    with torch.no_grad():
        for name, p in model.named_parameters():
            g = ep_gen if ".local_experts." in name else gen
            p.copy_(torch.randn(p.shape, generator=g) * 0.05 + 1.0 * (p.dim() == 1))
    with _CudaToCpu():
        optimizer = _distributed_optimizer(model, config)
    state = {
        "args": args,
        "checkpoint_version": 3.0,
        "iteration": ITERATION,
        "model": model.sharded_state_dict(),
        # Megatron-LM's default (`--dist-ckpt-optim-fully-reshardable` off): flat buffers
        "optimizer": optimizer.sharded_state_dict(
            model.sharded_state_dict(), metadata={"distrib_optim_sharding_type": "dp_reshardable"}
        ),
    }
    save = os.path.join(out, f"iter_{ITERATION:07d}")
    os.makedirs(save, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(state, save, sharded_strategy="torch_dist")
    dist.barrier()
    live = _gather_live(model, tp, args.expert_model_parallel_size)
    if rank == 0:
        with open(os.path.join(out, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(ITERATION))
        save_file(live, os.path.join(out, "live.safetensors"))
        fields = {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, bool))}
        with open(os.path.join(out, "args.json"), "w") as f:
            json.dump(fields, f, indent=1, sort_keys=True)
    dist.barrier()
    dist.destroy_process_group()


def _distributed_optimizer(model: torch.nn.Module, config: object) -> object:
    """megatron-core's `DistributedOptimizer` over the model wrapped in its DDP, after one
    Adam step on random gradients (so the moments exist): what `--use-distributed-optimizer`
    builds."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    ddp = DistributedDataParallel(
        config, DistributedDataParallelConfig(use_distributed_optimizer=True), module=model
    )
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=0.0, use_distributed_optimizer=True), [ddp]
    )
    gen = torch.Generator().manual_seed(7)
    for p in model.parameters():
        p.main_grad.copy_(torch.randn(p.shape, generator=gen))
    optimizer.step()
    return optimizer


def _gather_live(model: torch.nn.Module, tp: int, ep: int) -> dict[str, torch.Tensor]:
    """Every parameter, gathered over tensor parallel along its partition dimension; with
    expert parallel, every rank's experts under their global numbers."""
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    live = {}
    for name, p in model.named_parameters():
        full = p.detach().contiguous()
        if ".local_experts." in name and ep > 1:
            head, _, rest = name.partition(".local_experts.")
            local, _, leaf = rest.partition(".")
            per_rank = sum(1 for n, _ in model.named_parameters() if n.endswith(f".{leaf}")
                           and n.startswith(head + ".local_experts."))  # fmt: skip
            parts = [torch.empty_like(full) for _ in range(ep)]
            dist.all_gather(parts, full, group=parallel_state.get_expert_model_parallel_group())
            for r, part in enumerate(parts):
                live[f"{head}.local_experts.{r * per_rank + int(local)}.{leaf}"] = part.clone()
            continue
        if getattr(p, "tensor_model_parallel", False) and tp > 1:
            parts = [torch.empty_like(full) for _ in range(tp)]
            dist.all_gather(parts, full, group=group)
            if name.endswith("linear_fc1.weight"):
                # SwiGLU: each rank holds [its gate rows; its up rows]; the full weight is
                # [gate; up] (megatron-core's `apply_swiglu_sharded_factory` saves it so)
                halves = [part.chunk(2, dim=0) for part in parts]
                parts = [h[0] for h in halves] + [h[1] for h in halves]
            full = torch.cat(parts, dim=p.partition_dim)
        live[name] = full.clone()
    return live


def main() -> None:
    out = sys.argv[1]
    for name in sys.argv[2:] or SAVES:
        target = os.path.join(out, name)
        os.makedirs(target, exist_ok=True)
        mp.spawn(_worker, args=(target, _free_port(), SAVES[name]), nprocs=WORLD_SIZE, join=True)
        print("wrote", target)


if __name__ == "__main__":
    main()
