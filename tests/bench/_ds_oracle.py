"""Run in a subprocess with DS_ACCELERATOR=cpu: load every file of forged checkpoints with
torch.load(weights_only=False) (DeepSpeed importable), run DeepSpeed's own converter, and compare
its output bit for bit with what the forge intended. Prints one JSON line per checkpoint.

usage: python _ds_oracle.py REPO_ROOT CKPT_DIR SPEC_JSON [CKPT_DIR SPEC_JSON ...]
(SPEC_JSON: the forge's ForgeInfo as JSON: params, frozen, buffers, aliases, dtype, seed)
"""

from __future__ import annotations

import glob
import json
import math
import os
import sys

import numpy as np
import torch

sys.path.insert(0, sys.argv[1])
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint  # noqa: E402

from bench.forge.values import expected_16bit, expected_buffer, expected_fp32  # noqa: E402


def bits(t: torch.Tensor) -> np.ndarray:
    t = t.detach().contiguous().cpu()
    view = {
        torch.float32: torch.int32,
        torch.bfloat16: torch.int16,
        torch.float16: torch.int16,
        torch.int64: torch.int64,
    }[t.dtype]
    return t.view(view).numpy().ravel()


def check(ckpt: str, spec_path: str) -> dict:
    spec = json.load(open(spec_path))
    seed = spec["seed"]
    loaded = []
    for f in sorted(glob.glob(os.path.join(ckpt, "*", "*.pt"))):
        obj = torch.load(f, map_location="cpu", weights_only=False)
        loaded.append((os.path.basename(f), sorted(obj)))
    sd = get_fp32_state_dict_from_zero_checkpoint(ckpt)
    problems = []
    expected_names = set(spec["params"]) | set(spec["buffers"]) | set(spec["aliases"])
    if set(sd) != expected_names:
        problems.append(
            f"names: extra {sorted(set(sd) - expected_names)} missing {sorted(expected_names - set(sd))}"
        )
    lowp = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[spec["dtype"]]
    for name, t in sd.items():
        if name in spec["buffers"]:
            shape, dt = spec["buffers"][name]
            want = expected_buffer(name, shape, dt, seed)
            ok = list(t.shape) == list(shape) and np.array_equal(
                bits(t), want.view(np.int32 if dt == "float32" else np.int64).ravel()
            )
        else:
            target = spec["aliases"].get(name, name)
            shape = spec["params"][target]
            n = math.prod(shape)
            if target in spec["frozen"]:  # DeepSpeed returns frozen params in the training dtype
                want_dtype = lowp
                want = (
                    expected_fp32(target, 0, n, seed).view(np.int32)
                    if lowp == torch.float32
                    else expected_16bit(target, 0, n, spec["dtype"], seed).view(np.int16)
                )
            else:
                want_dtype = torch.float32
                want = expected_fp32(target, 0, n, seed).view(np.int32)
            ok = (
                list(t.shape) == list(shape)
                and t.dtype == want_dtype
                and np.array_equal(bits(t), want)
            )
        if not ok:
            problems.append(
                f"{name}: shape {list(t.shape)} dtype {t.dtype} differs from the forge's values"
            )
    return {"ckpt": ckpt, "files_loaded": len(loaded), "tensors": len(sd), "problems": problems}


if __name__ == "__main__":
    args = sys.argv[2:]
    for ckpt, spec_path in zip(args[::2], args[1::2], strict=True):
        print("RESULT " + json.dumps(check(ckpt, spec_path)), flush=True)
