"""What DCP users do today, timed by `bench/run_dcp.py`: torch's `dcp_to_torch_save`, then
`torch.load` and `safetensors.torch.save_file` of the model part, cast to the output dtype.

    python bench/_dcp_torch_convert.py CKPT_DIR OUT_DIR DTYPE

Prints `RESULT {json}` (seconds of each step) last. The consolidated `.pt` is written into
OUT_DIR and deleted afterwards; the output is `OUT_DIR/model.safetensors`, fsynced.
"""

from __future__ import annotations

import json
import os
import sys
import time


def main() -> int:
    ckpt, out, dtype = sys.argv[1:4]
    import torch
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    os.makedirs(out, exist_ok=True)
    consolidated = os.path.join(out, "consolidated.pt")
    t0 = time.perf_counter()
    dcp_to_torch_save(ckpt, consolidated)
    t1 = time.perf_counter()
    state = torch.load(consolidated, weights_only=False)
    model = {
        k.removeprefix("model."): v
        for k, v in state.items()
        if k.startswith("model.") and isinstance(v, torch.Tensor)
    }
    want = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    model = {k: (v.to(want) if v.is_floating_point() else v).contiguous() for k, v in model.items()}
    del state
    path = os.path.join(out, "model.safetensors")
    save_file(model, path, metadata={"format": "pt"})
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
    t2 = time.perf_counter()
    os.remove(consolidated)
    print(
        "RESULT "
        + json.dumps({"dcp_to_torch_save_s": t1 - t0, "save_s": t2 - t1, "total_s": t2 - t0})
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
