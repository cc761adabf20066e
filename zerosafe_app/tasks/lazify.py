"""The stages of the `lazify` flow: list a tag's `.pt` files, make each one's sibling current."""

from __future__ import annotations

from typing import Any

from zerosafe.formats.deepspeed.checkpoint import find_tag_dir
from zerosafe.lazy import lazify_file, list_pt_files
from zerosafe_app.tasks.credentials import storage_for
from zerosafe_app.tasks.edge import stage_task


@stage_task("list", run_name="list")
def list_files(
    checkpoint: str, tag: str | None = None, storage_options: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Resolve the tag and list its `.pt` files (model states, optimizer states, experts)."""
    storage = storage_for(storage_options)
    tag, tag_url = find_tag_dir(storage, checkpoint, tag)
    return {"tag": tag, "tag_url": tag_url, "files": list_pt_files(storage, tag_url)}


# Not cached by Prefect: the sibling's recorded identity is the cache (see lazify_file).
@stage_task("lazify", run_name="lazify {pt_url}")
def lazify_one(
    pt_url: str,
    *,
    memory: int,
    verify: bool = True,
    storage_options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Convert one `.pt` into its sibling unless the sibling is current; verify it."""
    return lazify_file(pt_url, storage=storage_for(storage_options), memory=memory, verify=verify)
