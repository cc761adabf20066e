"""Write a ~0.5B megatron-core `torch_dist` save with megatron-core's own code, on 2 CPU ranks.

    /work/mcore-venv/bin/python bench/forge_megatron.py /work/bench-data/megatron-500m

Runs in the megatron-core environment (Python >= 3.12, torch 2.13.0, megatron-core 0.19.2,
psutil, safetensors: `tests/formats/megatron/make_megatron_checkpoint.py` says how to make
it), never in zerosafe's. megatron-core itself initialises a Llama-style `GPTModel` (24
layers, hidden 1024, 16 query heads in 4 query groups, SwiGLU FFN 4864, RMSNorm, RoPE, no
linear biases, untied embeddings, vocab 32000: 0.49B params, fp32), tensor parallel 2 on 2
gloo ranks, with its own initialisation (no training), and saves it as Megatron-LM's
`save_checkpoint` does, with the committed fixtures' maker's recipe and shims (imported from
it, not copied): `args`, `checkpoint_version`, `iteration`, the model's
`sharded_state_dict()` and, unless `--no-optimizer` (Megatron-LM's `--no-save-optim`), the
`DistributedOptimizer`'s state (`dp_reshardable`, after one Adam step at learning rate 0, so
the moments exist), through `dist_checkpointing.save(..., OUT/iter_0000001, 'torch_dist')`,
then `OUT/latest_checkpointed_iteration.txt`.

`OUT.forge.json` records what was written (`num_params`, `total_bytes`, `seconds`, the args).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from tests.formats.megatron.make_megatron_checkpoint import (  # noqa: E402
    _args,
    _CudaToCpu,
    _distributed_optimizer,
    _free_port,
    _shim_cuda,
)

WORLD_SIZE = 2
TP = 2
ITERATION = 1
ARCH = {
    "num_layers": 24,
    "hidden_size": 1024,
    "ffn_hidden_size": 4864,
    "num_attention_heads": 16,
    "num_query_groups": 4,
    "kv_channels": 64,
    "seq_length": 4096,
    "max_position_embeddings": 4096,
    "rotary_base": 500000,
    "vocab_size": 32000,
}
"""The model: Llama-style, 0.49B params (Qwen2.5-0.5B's depth and FFN, a 32000 vocabulary)."""


def _namespace() -> argparse.Namespace:
    """The maker's args with this model's sizes, the vocabulary padded as Megatron-LM pads it
    (to a multiple of `make_vocab_size_divisible_by` x TP)."""
    args = _args(TP, False)
    vars(args).update(ARCH, iteration=ITERATION)
    multiple = args.make_vocab_size_divisible_by * TP
    args.padded_vocab_size = (args.vocab_size + multiple - 1) // multiple * multiple
    return args


def _worker(rank: int, out: str, port: int, optimizer: bool) -> None:
    _shim_cuda()
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=TP)
    args = _namespace()
    config = TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size, num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups, kv_channels=args.kv_channels,
        normalization=args.normalization, layernorm_epsilon=args.norm_epsilon,
        gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        add_bias_linear=False, add_qkv_bias=False, tensor_model_parallel_size=TP,
        use_cpu_initialization=True, params_dtype=torch.float32,
        hidden_dropout=0.0, attention_dropout=0.0, init_method_std=args.init_method_std,
    )  # fmt: skip
    torch.manual_seed(0)
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=args.padded_vocab_size, max_sequence_length=args.max_position_embeddings,
        share_embeddings_and_output_weights=False, position_embedding_type="rope",
        rotary_base=args.rotary_base,
    )  # fmt: skip
    state = {
        "args": args,
        "checkpoint_version": 3.0,
        "iteration": ITERATION,
        "model": model.sharded_state_dict(),
    }
    if optimizer:
        with _CudaToCpu():
            opt = _distributed_optimizer(model, config)
        state["optimizer"] = opt.sharded_state_dict(  # type: ignore[attr-defined]
            model.sharded_state_dict(), metadata={"distrib_optim_sharding_type": "dp_reshardable"}
        )
    save = os.path.join(out, f"iter_{ITERATION:07d}")
    os.makedirs(save, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(state, save, sharded_strategy="torch_dist")
    dist.barrier()
    if rank == 0:
        with open(os.path.join(out, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(ITERATION))
    local = sum(p.numel() for p in model.parameters())
    counts = [torch.tensor([local]) for _ in range(WORLD_SIZE)]
    dist.all_gather(counts, torch.tensor([local]))
    if rank == 0:
        with open(os.path.join(out, "num_params.json"), "w") as f:
            json.dump({"num_params": int(sum(c.item() for c in counts))}, f)
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="the --save folder to write (must not exist)")
    ap.add_argument("--no-optimizer", action="store_true",
                    help="leave the optimizer state out (Megatron-LM's --no-save-optim)")  # fmt: skip
    cfg = ap.parse_args(argv)
    if os.path.exists(cfg.out):
        ap.error(f"{cfg.out} exists: remove it first")
    os.makedirs(cfg.out)
    t0 = time.perf_counter()
    mp.spawn(_worker, args=(cfg.out, _free_port(), not cfg.no_optimizer), nprocs=WORLD_SIZE)
    seconds = time.perf_counter() - t0
    files = [os.path.join(r, f) for r, _, fs in os.walk(cfg.out) for f in fs]
    with open(os.path.join(cfg.out, "num_params.json")) as f:
        num_params = json.load(f)["num_params"]
    os.remove(os.path.join(cfg.out, "num_params.json"))
    args = {k: v for k, v in vars(_namespace()).items() if isinstance(v, (int, float, str, bool))}
    info = {
        "path": cfg.out,
        "num_params": num_params,
        "total_bytes": sum(os.path.getsize(p) for p in files if "num_params" not in p),
        "optimizer": not cfg.no_optimizer,
        "seconds": seconds,
        "tensor_parallel": TP,
        "world_size": WORLD_SIZE,
        "args": args,
        "megatron_core": _version("megatron-core"),
        "torch": torch.__version__,
    }
    with open(cfg.out.rstrip("/") + ".forge.json", "w") as f:
        json.dump(info, f, indent=1)
    print(f"wrote {cfg.out}: {num_params:,} params, {info['total_bytes'] / 1e9:.2f} GB "
          f"in {seconds:.1f} s")  # fmt: skip
    return 0


def _version(dist_name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist_name)
    except PackageNotFoundError:
        return None


if __name__ == "__main__":
    raise SystemExit(main())
