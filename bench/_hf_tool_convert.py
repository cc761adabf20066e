"""The frameworks' own consolidation tools, run the way a user runs them, timed by
`bench/run_hf.py`; one process, on the CPU.

    python bench/_hf_tool_convert.py torch SAVE_DIR OUT_DIR
    python bench/_hf_tool_convert.py bytecheckpoint STEP_DIR OUT_DIR

- `torch`: `torch.distributed.checkpoint._consolidate_hf_safetensors.consolidate_safetensors_files`
  on the rank files of `HuggingFaceStorageWriter(save_distributed=True)`, every tensor into
  one output file (the mapping it needs is built from the rank files' headers, as a user
  builds it): `OUT_DIR/model-00001-of-00001.safetensors` and its index.
- `bytecheckpoint`: ByteCheckpoint's merge tool, `bytecheckpoint_ckpt_to_pytorch_ckpt(STEP_DIR,
  OUT_DIR, framework="fsdp2", model_only=True, safetensors_format=True)` on
  `global_step_N/`.

Neither fsyncs its output; the harness times that after the process exits. Prints
`RESULT {json}` (`convert_s`) last.
"""

from __future__ import annotations

import glob
import json
import os
import sys
import time


def consolidate_with_torch(save: str, out: str) -> None:
    from safetensors import safe_open
    from torch.distributed.checkpoint._consolidate_hf_safetensors import (
        consolidate_safetensors_files,
    )

    names: set[str] = set()
    for path in glob.glob(os.path.join(save, "*.safetensors")):
        with safe_open(path, "np") as f:
            names.update(f.keys())
    os.makedirs(out, exist_ok=True)
    consolidate_safetensors_files(save, out, dict.fromkeys(sorted(names), 1))


def merge_with_bytecheckpoint(step: str, out: str) -> None:
    from bytecheckpoint.utilities.ckpt_format.merge_tool import (
        bytecheckpoint_ckpt_to_pytorch_ckpt,
    )

    bytecheckpoint_ckpt_to_pytorch_ckpt(
        step, out, framework="fsdp2", model_only=True, safetensors_format=True
    )


TOOLS = {"torch": consolidate_with_torch, "bytecheckpoint": merge_with_bytecheckpoint}


def main() -> int:
    tool, src, out = sys.argv[1:4]
    t0 = time.perf_counter()
    TOOLS[tool](src, out)
    print("RESULT " + json.dumps({"convert_s": time.perf_counter() - t0}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
