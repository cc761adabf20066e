"""Resume a `train_zero.py` run from universal checkpoints with real DeepSpeed on CPU (gloo).

Run by `tests/deepspeed_gen/__init__.py` (`resume_universal`) as
    DS_ACCELERATOR=cpu torchrun --nproc_per_node WS resume_universal.py JOBS.json
JOBS.json is a list of `{"spec": ..., "load_dir": ..., "out_dir": ...}`. For each job, in turn
and in the same processes (starting the processes costs far more than a job): build the
spec's model and DeepSpeed engine afresh with `"checkpoint": {"load_universal": true}`,
`engine.load_checkpoint(load_dir)` (a folder holding `latest_universal`), record every rank's
fp32 partitions and Adam moments as loaded, train `resume_steps` more steps on fixed data, and
record the losses (as float.hex) and the partitions again. Rank r writes
out_dir/rank<r>.safetensors with the losses in its metadata.
"""

import json
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import deepspeed
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from train_zero import TinyLM, make_config


def _partitions(engine, stage):
    opt = engine.optimizer
    if stage == 3:
        flat = opt.fp32_partitioned_groups_flat
    elif hasattr(opt, "single_partition_of_fp32_groups"):
        flat = opt.single_partition_of_fp32_groups
    else:  # BF16_Optimizer
        flat = opt.fp32_groups_flat_partition
    out = {}
    for g, t in enumerate(flat):
        out[f"fp32.{g}"] = t.detach().clone().float().contiguous()
        state = opt.optimizer.state.get(t, {})
        for key in ("exp_avg", "exp_avg_sq"):
            if key in state:
                out[f"{key}.{g}"] = state[key].detach().clone().float().contiguous()
        if "step" in state:
            out[f"step.{g}"] = torch.tensor([float(state["step"])], dtype=torch.float64)
    return out


def run_one(spec, load_dir, out_dir, rank):
    vocab, width, hidden = spec.get("dims", [97, 40, 67])
    torch.manual_seed(spec.get("seed", 7))
    model = TinyLM(
        vocab, width, hidden, spec.get("layers", 2), spec.get("tied", False),
        spec.get("frozen", False), False,
    )  # fmt: skip
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if spec.get("groups", 1) == 2:
        params = [
            {"params": [p for _, p in trainable if p.dim() == 2], "weight_decay": 0.05},
            {"params": [p for _, p in trainable if p.dim() != 2], "weight_decay": 0.0},
        ]
    else:
        params = [p for _, p in trainable]
    config = make_config(spec)
    config["checkpoint"] = {"load_universal": True}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=params, config=config)
    engine.load_checkpoint(load_dir)
    record = {f"loaded.{k}": v for k, v in _partitions(engine, spec["stage"]).items()}
    gen = torch.Generator().manual_seed(1000 + rank)
    losses = []
    for _ in range(spec.get("resume_steps", 2)):
        tokens = torch.randint(0, vocab, (2, 6), generator=gen)
        logits = engine(tokens)
        loss = F.cross_entropy(
            logits.float().reshape(-1, vocab), ((tokens * 5 + 1) % vocab).reshape(-1)
        )
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.item()).hex())
    record.update({f"after.{k}": v for k, v in _partitions(engine, spec["stage"]).items()})
    os.makedirs(out_dir, exist_ok=True)
    save_file(record, os.path.join(out_dir, f"rank{rank}.safetensors"),
              metadata={"losses": json.dumps(losses)})  # fmt: skip
    engine.destroy()
    torch.distributed.barrier()


def main():
    jobs = json.load(open(sys.argv[1]))
    deepspeed.init_distributed(dist_backend="gloo")
    rank = int(os.environ.get("RANK", 0))
    for job in jobs:
        run_one(job["spec"], job["load_dir"], job["out_dir"], rank)


if __name__ == "__main__":
    main()
