"""Lean resume: load a DeepSpeed checkpoint's `.pt` files from safetensors siblings, lazily.

`lazify_checkpoint` (`zerosafe lazify CKPT_DIR`) writes `X.pt.safetensors` next to every `.pt`
of a tag; `lazy_torch_load` makes `torch.load` (and so `engine.load_checkpoint`) read them
memory-mapped instead of staging each file in host memory. No Prefect, no DeepSpeed import
here: DeepSpeed classes are imported only to rebuild its bookkeeping objects when loading.
"""

from zerosafe.lazy.lazify import file_memory_bytes, lazify_checkpoint, lazify_file
from zerosafe.lazy.siblings import (
    SIBLING_SUFFIX,
    SiblingState,
    list_pt_files,
    sibling_path_for,
    sibling_state,
)
from zerosafe.lazy.torch_load import LazyLoads, lazy_torch_load

__all__ = [
    "SIBLING_SUFFIX",
    "LazyLoads",
    "SiblingState",
    "file_memory_bytes",
    "lazify_checkpoint",
    "lazify_file",
    "lazy_torch_load",
    "list_pt_files",
    "sibling_path_for",
    "sibling_state",
]
