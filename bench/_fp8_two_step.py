"""The second step of the two-step route to an FP8 block release, as a user runs it on a CPU
machine, timed by `bench/run_quantize.py`: load the bf16 model the first step saved, quantize it
with transformers' own fine-grained FP8 quantizer, save it.

    python bench/_fp8_two_step.py BF16_DIR OUT_DIR

`from_pretrained(quantization_config=FineGrainedFP8Config())` refuses to quantize without a
GPU ("No GPU or XPU found. A GPU or XPU is needed for FP8 quantization", transformers 5.18), so
this applies the quantizer's own operation, `Fp8Quantize` (what that `from_pretrained` runs on
each weight), to every `nn.Linear` weight but `lm_head` of the loaded model
(`AutoModelForCausalLM.from_pretrained(BF16_DIR)`, the whole model in memory), and writes the
result with `save_pretrained(OUT_DIR, state_dict=...)`, `quantization_config` in its
`config.json`. Prints `RESULT {json}` (`load_s`, `quantize_s`, `save_s`, `convert_s`) last;
the harness times the process from outside and fsyncs the output after it exits.
"""

from __future__ import annotations

import json
import sys
import time


def main() -> int:
    src, out = sys.argv[1:3]
    t0 = time.perf_counter()
    import torch
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Quantize
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

    t1 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    t2 = time.perf_counter()
    config = FineGrainedFP8Config()
    op = Fp8Quantize(FineGrainedFP8HfQuantizer(config))
    skip = set(config.modules_to_not_convert or ["lm_head"])
    linear = {
        f"{name}.weight"
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and name.split(".")[-1] not in skip
    }
    state: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        state.update(op.convert({name: tensor}) if name in linear else {name: tensor})
    kept = sorted(
        n.removesuffix(".weight") for n in linear if state[n].dtype != torch.float8_e4m3fn
    )
    t3 = time.perf_counter()
    model.config.quantization_config = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(config.weight_block_size),
        "modules_to_not_convert": [*sorted(skip), *kept],
    }
    model.save_pretrained(out, state_dict=state)
    t4 = time.perf_counter()
    result = {
        "import_s": t1 - t0, "load_s": t2 - t1, "quantize_s": t3 - t2, "save_s": t4 - t3,
        "convert_s": t4 - t1,
        "quantized": sum(1 for t in state.values() if t.dtype == torch.float8_e4m3fn),
    }  # fmt: skip
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
