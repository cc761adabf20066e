"""Find and read the metadata of one DeepSpeed ZeRO checkpoint tag (pickles only, no weights):
the library's entry points, whose errors name the formats zerosafe reads where a folder holds
none (`zerosafe.formats.registry.formats_listed`).

The reading itself is below: `files` (the folder and its listing), `rank_files` (one
data-parallel group of files), `model_parallel` and `pipeline` (`mp_rank_XX` files),
`reader` (which of them, and the layout the planner plans).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from zerosafe.formats.deepspeed import files, reader
from zerosafe.formats.deepspeed.rank_files import TESTED_DEEPSPEED_VERSIONS
from zerosafe.formats.deepspeed.types import (
    FrozenParam,
    LoadedFile,
    PipelineCheckpoint,
    SwapFile,
    ZeroCheckpoint,
)
from zerosafe.io.storage import FileIdentity, Storage

if TYPE_CHECKING:
    from zerosafe.config import ConvertOptions
    from zerosafe.plan.model import Plan

__all__ = [
    "TESTED_DEEPSPEED_VERSIONS",
    "FrozenParam",
    "LoadedFile",
    "SwapFile",
    "ZeroCheckpoint",
    "build_plan",
    "find_tag_dir",
    "open_zero_checkpoint",
    "quick_identities",
]


def find_tag_dir(storage: Storage, ckpt_url: str, tag: str | None) -> tuple[str, str]:
    """Resolve `CKPT_DIR [--tag T]` to `(tag, tag folder URL)` (`files.find_tag_dir`).

    Raises:
        CheckpointFormatError: If no tag can be found, with what the folder does hold.
    """
    from zerosafe.formats.registry import formats_listed

    with formats_listed():
        return files.find_tag_dir(storage, ckpt_url, tag)


def quick_identities(
    storage: Storage, ckpt_url: str, tag: str | None
) -> tuple[str, list[FileIdentity]]:
    """`(tag, identities)` of the files a conversion reads, from listings and stats only
    (`reader.tag_identities`)."""
    from zerosafe.formats.registry import formats_listed

    with formats_listed():
        return reader.tag_identities(storage, ckpt_url, tag)


def open_zero_checkpoint(
    storage: Storage, ckpt_url: str, *, tag: str | None = None, max_workers: int = 8
) -> Any:
    """Read and check the metadata of one ZeRO checkpoint tag. Reads pickles only.

    Args:
        storage: Where the checkpoint lives.
        ckpt_url: The folder holding `latest`, or a tag folder.
        tag: The tag to read; by default the one `latest` names.
        max_workers: Files read at once (the pickles of all ranks).

    Returns:
        A `ZeroCheckpoint`; for a pipeline-parallel checkpoint (`layer_XX-model_states.pt`
        files, one `mp_rank_XX` per stage) a `PipelineCheckpoint`
        (`zerosafe.formats.deepspeed.pipeline`), which holds one `ZeroCheckpoint` per stage.

    Raises:
        CheckpointFormatError: Missing, truncated or foreign files.
        UnsupportedCheckpointError: Layouts zerosafe does not convert yet.
        LayoutMismatchError: Ranks or sizes that disagree.
    """
    from zerosafe.formats.registry import formats_listed

    with formats_listed():
        return reader.open_tag(storage, ckpt_url, tag=tag, max_workers=max_workers)


def build_plan(ckpt: ZeroCheckpoint | PipelineCheckpoint, options: ConvertOptions) -> Plan:
    """The plan of converting an opened ZeRO checkpoint (`plan_layout` of its layout)."""
    from zerosafe.plan.build import plan_layout

    return plan_layout(reader.zero_layout(ckpt, options), options)
