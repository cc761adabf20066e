"""Forge synthetic DeepSpeed ZeRO checkpoints, fast and in bounded memory.

The files follow DeepSpeed 0.19.8's on-disk format (as read off the real checkpoints in
``shared/fixtures/deepspeed``): the same file names, the same pickle structure and globals
(``collections.OrderedDict``, ``torch._utils._rebuild_tensor_v2``, ``torch.Size``, the storage
classes, DeepSpeed's ``LossScaler`` / ``ZeroStageEnum`` / ``fragment_address`` ...), torch's zip
container with 64-byte aligned records, CRC-32 per record and ZIP64 records past 4 GB (the format
notes: docs/formats.md).
Neither torch nor DeepSpeed is needed (or imported) to write them: the pickles are emitted by a
small pickler that names those globals itself, and the zip is written here, streaming.

Every value is a cheap function of (param name, element index, seed), so any range of any
output can be checked without a golden copy: see `expected_fp32`, `expected_16bit`,
`expected_buffer`. Adam moments are written as sparse holes by default (they read as zeros).

    python -m bench.forge DEST --params 500M --stage 3 --world-size 8 --dtype bf16

Modules, in the order data flows:

- `shapes`: `transformer_shapes`, `parse_count`, the default buffers;
- `spec`: the settings and the layout derived from them (params, ties, optimizer groups, ZeRO-3
  sub-groups);
- `states`, `zero2`, `zero3`: what each file holds, as a tree of pickle nodes;
- `pickles`: those nodes (naming torch's and DeepSpeed's globals) and the pickler;
- `values`: every element's value, and `expected_fp32` / `expected_16bit` / `expected_buffer`;
- `pipeline`, `zipwriter`, `torch_file`: storages filled by threads in bounded memory, streamed
  into torch's zip container, one file at a time;
- `checkpoint`: `forge_checkpoint` and `ForgeInfo`; `cli`: the command line.
"""

from .checkpoint import ForgeInfo, expected_state, forge_checkpoint
from .cli import main
from .shapes import DEFAULT_BUFFERS, parse_count, transformer_shapes
from .spec import DS_VERSION
from .torch_file import write_torch_file
from .values import expected_16bit, expected_buffer, expected_fp32, to_bf16_bits
from .zipwriter import ZIP64_LIMIT

__all__ = [
    "DEFAULT_BUFFERS",
    "DS_VERSION",
    "ZIP64_LIMIT",
    "ForgeInfo",
    "expected_16bit",
    "expected_buffer",
    "expected_fp32",
    "expected_state",
    "forge_checkpoint",
    "main",
    "parse_count",
    "to_bf16_bits",
    "transformer_shapes",
    "write_torch_file",
]
