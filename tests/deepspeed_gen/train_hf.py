"""Train a tiny transformers model under real DeepSpeed ZeRO on CPU and save it as the HF
Trainer does: `engine.save_checkpoint(CKPT_DIR)`, then `save_pretrained` of the config, the
generation config and a tokenizer into CKPT_DIR, the folder above the tag.

Run by `tests/deepspeed_gen/__init__.py` (`train_checkpoint(spec, dest, script=HF_SCRIPT)`) as
    DS_ACCELERATOR=cpu torchrun --nproc_per_node WS train_hf.py SPEC.json CKPT_DIR LIVE.safetensors
SPEC keys: arch (llama|gpt2), stage, precision (bf16|fp32), steps, world_size, and optionally
dims (the Llama's sizes, `build_model`).
LIVE gets the live weights at save time (gathered) and LIVE's sibling `live-logits.safetensors`
the logits the live engine computes, in eval mode, on `input_ids` (saved beside them).

With `lora` in SPEC (a `peft.LoraConfig`'s keyword arguments), the model is wrapped by
`peft.get_peft_model` and trained by the real `transformers.Trainer` with DeepSpeed
(`TrainingArguments(deepspeed=...)`), which saves `CKPT_DIR/checkpoint-STEPS/` itself
(`global_stepN/`, `latest`, `adapter_config.json`, its own `adapter_model.safetensors`,
tokenizer, trainer state). LIVE then holds `peft.get_peft_model_state_dict` of the live model
(its parameters gathered): the adapter PEFT itself saves, with PEFT's names; LIVE's sibling
`base/` holds the base model as it was before training (`save_pretrained`), for
`PeftModel.from_pretrained(base, OUT)`.
"""

import contextlib
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed
import torch

VOCAB = 53


def build_model(arch: str, dims: dict | None = None):
    """A tiny Llama-style (untied head) or GPT-2-style (tied embeddings) model from a config.
    Odd dims, so ZeRO's flat partitions need padding and params straddle ranks; `dims`
    (SPEC's `dims`) overrides the Llama's `hidden_size`, `intermediate_size`,
    `num_attention_heads`, `num_key_value_heads` (the FP8 block tests need multiples of 128)."""
    if arch == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        shape = {"hidden_size": 24, "intermediate_size": 37, "num_attention_heads": 2,
                 "num_key_value_heads": 1, **(dims or {})}  # fmt: skip
        config = LlamaConfig(
            vocab_size=VOCAB, num_hidden_layers=2, max_position_embeddings=32,
            bos_token_id=2, eos_token_id=3, pad_token_id=1, **shape,
        )  # fmt: skip
        return LlamaForCausalLM(config)
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=VOCAB, n_embd=24, n_layer=2, n_head=2, n_positions=32,
        bos_token_id=2, eos_token_id=3, pad_token_id=1, tie_word_embeddings=True,
    )  # fmt: skip
    return GPT2LMHeadModel(config)


def build_tokenizer():
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


def main():
    spec = json.load(open(sys.argv[1]))
    ckpt_dir, live_file = sys.argv[2], sys.argv[3]
    if "lora" in spec or spec.get("trainer"):
        return main_peft_trainer(spec, ckpt_dir, live_file)
    deepspeed.init_distributed(dist_backend="gloo")
    rank = int(os.environ.get("RANK", 0))
    torch.manual_seed(spec.get("seed", 11))
    model = build_model(spec["arch"], spec.get("dims"))
    zero = {"stage": spec["stage"]}
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
    if spec["precision"] == "bf16":
        config["bf16"] = {"enabled": True}
        model.config.dtype = "bfloat16"  # as when the model is loaded in bf16 to train
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    gen = torch.Generator().manual_seed(31 + rank)
    for _ in range(spec.get("steps", 2)):
        tokens = torch.randint(4, VOCAB, (2, 8), generator=gen)
        loss = engine(input_ids=tokens, labels=tokens).loss
        engine.backward(loss)
        engine.step()
    engine.save_checkpoint(ckpt_dir)

    # The logits of the live model at save time, on fixed tokens, by every rank (ZeRO-3
    # gathers params inside forward).
    engine.eval()
    input_ids = torch.arange(4, 4 + 2 * 11).reshape(2, 11) % VOCAB
    with torch.no_grad():
        logits = engine(input_ids=input_ids).logits.detach().clone()
    all_params = list(engine.module.parameters())
    gather = (
        deepspeed.zero.GatheredParameters(all_params, modifier_rank=None)
        if spec["stage"] == 3
        else contextlib.nullcontext()
    )
    with gather:
        live = {
            n: p.detach().clone().cpu().contiguous()
            for n, p in engine.module.named_parameters(remove_duplicate=False)
        }
    if rank == 0:
        from safetensors.torch import save_file

        # A tied head is the embedding's tensor: store it once (safetensors refuses shared
        # storage), and say which.
        tied = {"lm_head.weight": "transformer.wte.weight"} if spec["arch"] == "gpt2" else {}
        for alias in tied:
            live.pop(alias, None)
        save_file(live, live_file, metadata={"aliases": json.dumps(tied)})
        save_file(
            {"logits": logits.contiguous(), "input_ids": input_ids.contiguous()},
            str(Path(live_file).with_name("live-logits.safetensors")),
        )
        # What the HF Trainer writes beside `global_stepN/` (`_save` -> save_pretrained).
        engine.module.config.save_pretrained(ckpt_dir)
        engine.module.generation_config.save_pretrained(ckpt_dir)
        build_tokenizer().save_pretrained(ckpt_dir)
    torch.distributed.barrier()


def _input_ids():
    return torch.arange(4, 4 + 2 * 11).reshape(2, 11) % VOCAB


class _Tokens(torch.utils.data.Dataset):
    """Fixed random token rows (the same on every rank; the sampler splits them)."""

    def __len__(self):
        return 64

    def __getitem__(self, i):
        tokens = torch.randint(4, VOCAB, (8,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": tokens, "labels": tokens}


def trainer_ds_config(stage):
    """The DeepSpeed config the HF Trainer runs with here ("auto" values filled by it)."""
    zero = {"stage": stage}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": zero,
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "torch_adam": True}},
    }


def main_peft_trainer(spec, ckpt_dir, live_file):
    """A model trained and saved by the HF Trainer itself under DeepSpeed ZeRO: a PEFT LoRA
    model with `lora` in SPEC, else the whole model (`trainer`: true; logged every step, at a
    constant learning rate, so a resumed run's steps and losses can be compared)."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from transformers import Trainer, TrainingArguments

    torch.manual_seed(spec.get("seed", 11))
    model = build_model(spec["arch"])
    rank = int(os.environ.get("RANK", 0))
    if "lora" not in spec:
        return _main_trainer(spec, model, ckpt_dir, live_file)
    if rank == 0:  # the base model the user fine-tunes, as it was before training
        model.save_pretrained(str(Path(live_file).with_name("base")))
    peft_model = get_peft_model(model, LoraConfig(**spec["lora"]))
    zero = {"stage": spec["stage"]}
    if spec["stage"] == 3:
        zero["stage3_param_persistence_threshold"] = 0
    ds_config = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": zero,
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "torch_adam": True}},
    }
    steps = spec.get("steps", 4)
    args = TrainingArguments(
        output_dir=ckpt_dir, per_device_train_batch_size=2, max_steps=steps, save_steps=steps,
        save_strategy="steps", learning_rate=2e-2, deepspeed=ds_config, report_to=[],
        logging_steps=10**6, disable_tqdm=True, seed=spec.get("seed", 11),
    )  # fmt: skip
    trainer = Trainer(
        model=peft_model, args=args, train_dataset=_Tokens(), processing_class=build_tokenizer()
    )
    trainer.train()

    engine = trainer.model_wrapped  # the DeepSpeed engine around the PeftModel
    engine.eval()
    input_ids = _input_ids()
    with torch.no_grad():
        logits = engine(input_ids=input_ids).logits.detach().clone()
    params = list(peft_model.parameters())
    gather = (
        deepspeed.zero.GatheredParameters(params, modifier_rank=None)
        if spec["stage"] == 3
        else contextlib.nullcontext()
    )
    with gather:
        state = {k: v.detach().clone().contiguous() for k, v in peft_model.state_dict().items()}
        adapter = get_peft_model_state_dict(peft_model, state_dict=state)
    if rank == 0:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in adapter.items()}, live_file)
        save_file(
            {"logits": logits.contiguous(), "input_ids": input_ids.contiguous()},
            str(Path(live_file).with_name("live-logits.safetensors")),
        )
    torch.distributed.barrier()


def _main_trainer(spec, model, ckpt_dir, live_file):
    from transformers import Trainer, TrainingArguments

    steps = spec.get("steps", 2)
    args = TrainingArguments(
        output_dir=ckpt_dir, per_device_train_batch_size=2, max_steps=steps, save_steps=steps,
        save_strategy="steps", learning_rate=2e-2, lr_scheduler_type="constant",
        deepspeed=trainer_ds_config(spec["stage"]), report_to=[], logging_steps=1,
        disable_tqdm=True, seed=spec.get("seed", 11),
    )  # fmt: skip
    trainer = Trainer(model=model, args=args, train_dataset=_Tokens())
    trainer.train()
    params = list(model.parameters())
    gather = (
        deepspeed.zero.GatheredParameters(params, modifier_rank=None)
        if spec["stage"] == 3
        else contextlib.nullcontext()
    )
    with gather:
        state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    if int(os.environ.get("RANK", 0)) == 0:
        from safetensors.torch import save_file

        save_file(state, live_file)
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
