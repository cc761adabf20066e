"""Resume the HF Trainer, under real DeepSpeed on CPU ranks, from a `--to universal` output,
with nothing copied into it by hand.

    DS_ACCELERATOR=cpu torchrun --nproc_per_node WS trainer_resume.py SPEC.json LOAD_DIR OUT_DIR

SPEC is the saving run's spec (`tests/deepspeed_gen/train_hf.py` with `trainer`: true); the
resumed run trains to twice its steps with the same arguments, `"checkpoint":
{"load_universal": true}` added to the DeepSpeed config, and
`trainer.train(resume_from_checkpoint=LOAD_DIR)`. OUT_DIR gets `begin.safetensors` (every
parameter, gathered, when training begins: after the Trainer loaded the checkpoint) and
`resumed.json` (the global step at that moment, the final one, the log history).
"""

import contextlib
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed
import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "deepspeed_gen"))
from train_hf import _Tokens, build_model, trainer_ds_config  # noqa: E402


class _Probe(TrainerCallback):
    """At the start of training (the checkpoint is loaded by then): the step and the weights."""

    def __init__(self, stage, out_dir):
        self.stage, self.out_dir, self.begin_step = stage, out_dir, None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.begin_step = state.global_step
        params = list(model.parameters())
        gather = (
            deepspeed.zero.GatheredParameters(params, modifier_rank=None)
            if self.stage == 3
            else contextlib.nullcontext()
        )
        with gather:
            weights = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
        if int(os.environ.get("RANK", 0)) == 0:
            from safetensors.torch import save_file

            save_file(weights, str(Path(self.out_dir) / "begin.safetensors"))


def main():
    spec = json.load(open(sys.argv[1]))
    load_dir, out_dir = sys.argv[2], Path(sys.argv[3])
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(spec.get("seed", 11))
    model = build_model(spec["arch"])
    ds_config = {**trainer_ds_config(spec["stage"]), "checkpoint": {"load_universal": True}}
    steps = spec.get("steps", 2)
    args = TrainingArguments(
        output_dir=str(out_dir / "run"), per_device_train_batch_size=2, max_steps=2 * steps,
        save_strategy="no", learning_rate=2e-2, lr_scheduler_type="constant",
        deepspeed=ds_config, report_to=[], logging_steps=1, disable_tqdm=True,
        seed=spec.get("seed", 11),
    )  # fmt: skip
    probe = _Probe(spec["stage"], out_dir)
    trainer = Trainer(model=model, args=args, train_dataset=_Tokens(), callbacks=[probe])
    trainer.train(resume_from_checkpoint=load_dir)
    if int(os.environ.get("RANK", 0)) == 0:
        found = {
            "begin_step": probe.begin_step,
            "final_step": trainer.state.global_step,
            "log_history": trainer.state.log_history,
        }
        (out_dir / "resumed.json").write_text(json.dumps(found, indent=1))
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
