"""Run DeepSpeed's own converter on a checkpoint (run with DS_ACCELERATOR=cpu).

usage: python bench/_ds_convert.py CKPT_DIR OUT_DIR --dtype bf16 --max-shard-size 5GB

Calls `deepspeed.utils.zero_to_fp32.convert_zero_checkpoint_to_state_dict` with safetensors
output, then prints one line `RESULT {json}` with the import and conversion times (the harness
measures the process from outside). Exits 1, after printing the error in the same line, if the
converter raises.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("ckpt")
    ap.add_argument("out")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    ap.add_argument("--max-shard-size", default="5GB")
    args = ap.parse_args()
    t0 = time.perf_counter()
    import torch
    from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_state_dict

    t1 = time.perf_counter()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    result: dict[str, object] = {"import_s": round(t1 - t0, 3)}
    try:
        convert_zero_checkpoint_to_state_dict(
            args.ckpt,
            args.out,
            dtype=dtype,
            max_shard_size=args.max_shard_size,
            safe_serialization=True,
        )
        result["ok"] = True
    except Exception as e:  # reported, not hidden: the harness records it
        result["ok"] = False
        result["error"] = f"{type(e).__name__}: {e}"
        result["traceback"] = traceback.format_exc()[-3000:]
    result["convert_s"] = round(time.perf_counter() - t1, 3)
    print("RESULT " + json.dumps(result), flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
