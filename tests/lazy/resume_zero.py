"""Save a DeepSpeed ZeRO checkpoint, or resume from one and train on; one rank's part.

Run under torchrun with gloo ranks on CPU (DS_ACCELERATOR=cpu) by `tests/lazy/test_resume.py`,
and on GPUs by `bench/gpu_resume.sh` (DS_ACCELERATOR=cuda, RESUME_BACKEND=nccl):

    resume_zero.py save SPEC.json CKPT_DIR
    resume_zero.py resume SPEC.json CKPT_DIR pt|lazy RESULT_DIR

`save` trains `steps_before` steps and saves. `resume` builds the same engine, loads the
checkpoint (`pt`: plain `engine.load_checkpoint`; `lazy`: inside `zerosafe.lazy_torch_load`)
while a thread samples this rank's RSS, then trains `steps_after` steps on fixed batches and
writes RESULT_DIR/rank{R}.json (losses as exact hex floats, peak RSS and anonymous RSS above
the baseline during the load, load seconds, which files came from siblings) and, from rank 0,
RESULT_DIR/weights.safetensors (every weight, gathered, after the last step).
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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bench._rss import RSSSampler  # noqa: E402


class Wide(nn.Module):
    """Big embedding and head (most of the optimizer bytes), one small hidden layer."""

    def __init__(self, vocab: int, width: int, hidden: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.up = nn.Linear(width, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.down = nn.Linear(hidden, width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        h = h + self.down(F.gelu(self.norm(self.up(h))))
        return self.head(h)


def build(spec: dict) -> tuple:
    torch.manual_seed(spec.get("seed", 11))
    vocab, width, hidden = spec["dims"]
    model = Wide(vocab, width, hidden)
    zero: dict = {"stage": spec["stage"]}
    if spec["stage"] == 3:
        zero["stage3_param_persistence_threshold"] = 0
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**9,
        "gradient_clipping": 1.0,
        "zero_optimization": zero,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
    }
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    return engine, vocab


def train(engine, vocab: int, steps: int, seed: int) -> list[str]:
    rank = torch.distributed.get_rank()
    gen = torch.Generator().manual_seed(seed * 100 + rank)
    losses = []
    for _ in range(steps):
        tokens = torch.randint(0, vocab, (2, 5), generator=gen).to(engine.device)
        logits = engine(tokens)
        loss = F.cross_entropy(logits.reshape(-1, vocab), ((tokens * 7 + 3) % vocab).reshape(-1))
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.item()).hex())
    return losses


def gathered_weights(engine, stage: int) -> dict:
    params = list(engine.module.parameters())
    gather = (
        deepspeed.zero.GatheredParameters(params, modifier_rank=None)
        if stage == 3
        else contextlib.nullcontext()
    )
    with gather:
        return {
            n: p.detach().cpu().clone().contiguous() for n, p in engine.module.named_parameters()
        }


def resume(spec: dict, ckpt: str, via: str, out: str) -> None:
    import zerosafe

    engine, vocab = build(spec)
    block = zerosafe.lazy_torch_load() if via == "lazy" else contextlib.nullcontext()
    with RSSSampler() as rss, block as loads:
        engine.load_checkpoint(ckpt)
    losses = train(engine, vocab, spec["steps_after"], seed=2)
    rank = torch.distributed.get_rank()
    result = {
        "rank": rank,
        "via": via,
        "losses": losses,
        "load_seconds": rss.seconds,
        "load_peak_rss_bytes": rss.peak_rss - rss.base_rss,
        "load_peak_anon_bytes": rss.peak_anon - rss.base_anon,
        "baseline_rss_bytes": rss.base_rss,
        "loaded": sorted(os.path.basename(p) for p in loads.loaded) if loads else [],
        "fell_back": sorted(os.path.basename(p) for p, _ in loads.fell_back) if loads else [],
    }
    weights = gathered_weights(engine, spec["stage"])
    if rank == 0:
        from safetensors.torch import save_file

        save_file(weights, os.path.join(out, "weights.safetensors"))
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f, indent=1)
    torch.distributed.barrier()


def main() -> None:
    mode, spec_file, ckpt = sys.argv[1:4]
    spec = json.load(open(spec_file))
    deepspeed.init_distributed(dist_backend=os.environ.get("RESUME_BACKEND", "gloo"))
    if mode == "save":
        engine, vocab = build(spec)
        train(engine, vocab, spec["steps_before"], seed=1)
        engine.save_checkpoint(ckpt)
    else:
        resume(spec, ckpt, sys.argv[4], sys.argv[5])


if __name__ == "__main__":
    main()
