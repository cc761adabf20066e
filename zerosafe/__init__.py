"""zerosafe: sharded training checkpoints (DeepSpeed ZeRO, DeepSpeed universal, PyTorch DCP
(FSDP2, torchtitan, accelerate, OLMo-core, ByteCheckpoint), Megatron-LM torch_dist, verl FSDP,
torch_checkpointing, HuggingFaceStorageWriter rank files, a safetensors model folder) to
verified safetensors, streaming, without DeepSpeed or torch.distributed.

The engine is a plain library (no Prefect): read a checkpoint's metadata lazily
(`open_zero_checkpoint`; a `PipelineCheckpoint` for pipeline parallelism), plan the conversion (`build_plan`), run the stages
(`extract_part`, `merge_shard`, `verify_shard`, `publish`), or all of them in order
(`convert_checkpoint`). Any `torch.save` file converts to one safetensors file with
`convert_pt` and loads back, lazily, with `load_pt_like` (or `load_pt` for resuming).
`lazify_checkpoint` writes such a file next to every `.pt` of a DeepSpeed checkpoint, and
`with lazy_torch_load(): engine.load_checkpoint(...)` resumes from them memory-mapped.
`convert_to_universal` writes a DeepSpeed universal checkpoint (masters and Adam moments) that
DeepSpeed resumes at any world size.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from zerosafe._version import __version__

# The names below are imported when first used (PEP 562), so `import zerosafe` (and the
# `zerosafe` command's start-up) does not import every module of the engine.
_LAZY = {
    "ConvertOptions": "zerosafe.config",
    "convert_checkpoint": "zerosafe.driver",
    "CheckpointFormatError": "zerosafe.errors",
    "ConfigError": "zerosafe.errors",
    "ConversionError": "zerosafe.errors",
    "IntegrityError": "zerosafe.errors",
    "LayoutMismatchError": "zerosafe.errors",
    "OutputExistsError": "zerosafe.errors",
    "StorageError": "zerosafe.errors",
    "UnsafePickleError": "zerosafe.errors",
    "UnsupportedCheckpointError": "zerosafe.errors",
    "ZeroCheckpoint": "zerosafe.formats.deepspeed.checkpoint",
    "open_zero_checkpoint": "zerosafe.formats.deepspeed.checkpoint",
    "PipelineCheckpoint": "zerosafe.formats.deepspeed.pipeline",
    "build_plan": "zerosafe.formats.deepspeed.checkpoint",
    "TensorRecord": "zerosafe.formats.torch_zip",
    "TorchZipFile": "zerosafe.formats.torch_zip",
    "Storage": "zerosafe.io.storage",
    "lazify_checkpoint": "zerosafe.lazy",
    "lazy_torch_load": "zerosafe.lazy",
    "plan_checkpoint": "zerosafe.plan.build",
    "plan_layout": "zerosafe.plan.build",
    "Plan": "zerosafe.plan.model",
    "load_plan": "zerosafe.plan.model",
    "save_plan": "zerosafe.plan.model",
    "convert_pt": "zerosafe.pt2st",
    "load_pt": "zerosafe.pt2st",
    "load_pt_like": "zerosafe.pt2st",
    "convert_to_universal": "zerosafe.training_state",
}

if TYPE_CHECKING:
    from zerosafe.config import ConvertOptions
    from zerosafe.driver import convert_checkpoint
    from zerosafe.errors import (
        CheckpointFormatError,
        ConfigError,
        ConversionError,
        IntegrityError,
        LayoutMismatchError,
        OutputExistsError,
        StorageError,
        UnsafePickleError,
        UnsupportedCheckpointError,
    )
    from zerosafe.formats.deepspeed.checkpoint import (
        ZeroCheckpoint,
        build_plan,
        open_zero_checkpoint,
    )
    from zerosafe.formats.deepspeed.pipeline import PipelineCheckpoint
    from zerosafe.formats.torch_zip import TensorRecord, TorchZipFile
    from zerosafe.io.storage import Storage
    from zerosafe.lazy import lazify_checkpoint, lazy_torch_load
    from zerosafe.plan.build import plan_checkpoint, plan_layout
    from zerosafe.plan.model import Plan, load_plan, save_plan
    from zerosafe.pt2st import convert_pt, load_pt, load_pt_like
    from zerosafe.training_state import convert_to_universal


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'zerosafe' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


__all__ = [
    "CheckpointFormatError",
    "ConfigError",
    "ConversionError",
    "ConvertOptions",
    "IntegrityError",
    "LayoutMismatchError",
    "OutputExistsError",
    "PipelineCheckpoint",
    "Plan",
    "Storage",
    "StorageError",
    "TensorRecord",
    "TorchZipFile",
    "UnsafePickleError",
    "UnsupportedCheckpointError",
    "ZeroCheckpoint",
    "__version__",
    "build_plan",
    "convert_checkpoint",
    "convert_pt",
    "convert_to_universal",
    "lazify_checkpoint",
    "lazy_torch_load",
    "load_plan",
    "load_pt",
    "load_pt_like",
    "open_zero_checkpoint",
    "plan_checkpoint",
    "plan_layout",
    "save_plan",
]
