"""The CPU route a Megatron user has today, timed by `bench/run_megatron.py`: torch's own DCP
consolidation (`torch_dist` is DCP), `dcp_to_torch_save` of the `iter_N` folder, then
`torch.load` and `safetensors.torch.save_file` of the model's tensors (the optimizer's buffers
and the non-tensor items left out).

    MCORE_VENV/bin/python bench/_megatron_tool_convert.py SAVE OUT_DIR

Runs in the megatron-core environment: the save's byte items (`common_state`, the args) hold
megatron-core classes, which `dcp_to_torch_save` unpickles. It gives Megatron's names, layers
stacked, the vocabulary padded: not Hugging Face weights (the mapping is left to the user; the
bench maps them with plain torch to check zerosafe's output). Prints `RESULT {json}` (seconds
of each step) last. The consolidated `.pt` is written into OUT_DIR and deleted afterwards; the
output is `OUT_DIR/model.safetensors`, fsynced.
"""

from __future__ import annotations

import json
import os
import sys
import time


def main() -> int:
    save, out = sys.argv[1:3]
    import torch
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with open(os.path.join(save, "latest_checkpointed_iteration.txt")) as f:
        iteration = int(f.read().strip())
    os.makedirs(out, exist_ok=True)
    consolidated = os.path.join(out, "consolidated.pt")
    t0 = time.perf_counter()
    dcp_to_torch_save(os.path.join(save, f"iter_{iteration:07d}"), consolidated)
    t1 = time.perf_counter()
    state = torch.load(consolidated, weights_only=False)
    model = {
        k: v.contiguous()
        for k, v in state.items()
        if isinstance(v, torch.Tensor) and not k.startswith("optimizer.")
    }
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
