"""Write a safetensors sibling next to every `.pt` of a DeepSpeed checkpoint tag.

Each `.pt` is converted by `zerosafe.pt2st.convert_pt` (restricted unpickling, zip CRC checks,
a temporary name until whole) and the sibling is re-read by `verify_pt` against the checksums
recorded while writing. Files are converted in parallel, sharing one memory budget. A sibling
that is current is left alone, a stale one is written again, and the `.pt` files are never
changed. Siblings and their naming: `zerosafe.lazy.siblings`.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from zerosafe.config import DEFAULT_MEMORY_BYTES, ConvertOptions
from zerosafe.errors import CheckpointFormatError, VerificationError
from zerosafe.formats.deepspeed.checkpoint import find_tag_dir
from zerosafe.io.storage import Storage
from zerosafe.lazy.siblings import list_pt_files, sibling_state
from zerosafe.pt2st.convert import convert_pt, verify_pt

__all__ = ["file_memory_bytes", "lazify_checkpoint", "lazify_file"]

log = logging.getLogger(__name__)


def file_memory_bytes(memory: int, max_parallel_files: int) -> tuple[int, int]:
    """`(files at once, budget of each)` so that the files converted at once fit in
    `memory`.

    Raises:
        ConfigError: If `memory` is below what one conversion needs, or
            `max_parallel_files` is below 1.
    """
    options = ConvertOptions(memory=memory, max_parallel_tasks=max_parallel_files)
    workers = options.parallel_tasks
    return workers, memory // workers


def lazify_file(
    pt_url: str,
    *,
    storage: Storage | None = None,
    memory: int = DEFAULT_MEMORY_BYTES,
    verify: bool = True,
) -> dict[str, Any]:
    """Make the sibling of one `.pt` current: nothing to do, or convert and verify.

    Args:
        pt_url: The `.pt` file.
        storage: Opens the files.
        memory: Memory budget of this conversion.
        verify: Re-read the sibling and compare each entry's SHA-256 with the one written.

    Returns:
        A JSON-able summary: `status` is `current` (nothing done), `written` (there was no
        sibling) or `rewritten` (the sibling was stale), with bytes and seconds.

    Raises:
        UnsafePickleError: If the pickle names a global outside zerosafe's allowlist.
        CheckpointFormatError: If the `.pt` is not a torch zip file, or changed while read.
        VerificationError: If the sibling does not read back as written (it is removed).
    """
    storage = storage or Storage()
    before = sibling_state(storage, pt_url)
    if before.is_current:
        return {"file": pt_url, "sibling": before.sibling_url, "status": "current"}
    if before.state == "stale":
        log.info("%s: rewriting %s: %s", pt_url, before.sibling_url, before.why)
    started = time.monotonic()
    summary = convert_pt(pt_url, before.sibling_url, storage=storage, memory=memory, overwrite=True)
    try:
        if verify:
            verify_pt(before.sibling_url, storage=storage, expected_sha256=summary["sha256"])
        after = sibling_state(storage, pt_url)
        if not after.is_current:
            raise CheckpointFormatError(
                f"{pt_url}: changed while lazify read it ({after.why}); run `zerosafe lazify` "
                "again once the checkpoint is completely written"
            )
    except (VerificationError, CheckpointFormatError):
        storage.remove(before.sibling_url)  # just written by us: leave nothing that looks done
        raise
    return {
        "file": pt_url,
        "sibling": before.sibling_url,
        "status": "written" if before.state == "missing" else "rewritten",
        "stale_because": before.why or None,
        "file_bytes": summary["file_bytes"],
        "num_tensors": summary["num_tensors"],
        "seconds": round(time.monotonic() - started, 3),
        "verified": verify,
    }


def lazify_checkpoint(
    ckpt_url: str,
    *,
    tag: str | None = None,
    storage: Storage | None = None,
    memory: int = DEFAULT_MEMORY_BYTES,
    max_parallel_files: int = 2,
    verify: bool = True,
) -> dict[str, Any]:
    """Write or refresh the sibling of every `.pt` file of a checkpoint tag.

    Args:
        ckpt_url: The folder holding `latest`, or a tag folder (local, NFS or `s3://`).
        tag: The tag; by default the one `latest` names.
        storage: Opens the files (storage options, byte counter).
        memory: Memory budget of all conversions running at once.
        max_parallel_files: Files converted at once (fewer when the budget is small).
        verify: Re-read every sibling written and compare checksums.

    Returns:
        A JSON-able summary: `tag`, `files` (one `lazify_file` summary each) and counts.

    Raises:
        ConfigError: For a budget below one conversion's minimum.
        CheckpointFormatError: If no tag or no `.pt` file is found, or a file cannot be
            converted (the first failure, after every other file has been tried).
    """
    storage = storage or Storage()
    workers, per_file_bytes = file_memory_bytes(memory, max_parallel_files)
    tag, tag_url = find_tag_dir(storage, ckpt_url, tag)
    files = list_pt_files(storage, tag_url)
    started = time.monotonic()

    def one(pt_url: str) -> dict[str, Any] | BaseException:
        try:
            return lazify_file(pt_url, storage=storage, memory=per_file_bytes, verify=verify)
        except Exception as e:  # reported after the other files are done
            log.error("%s", e)
            return e

    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="lazify") as pool:
        results = list(pool.map(one, files))
    failures = [r for r in results if isinstance(r, BaseException)]
    if failures:
        raise failures[0]
    done = [r for r in results if isinstance(r, dict)]
    counts = {s: sum(r["status"] == s for r in done) for s in ("current", "written", "rewritten")}
    return {
        "tag": tag,
        "tag_url": tag_url,
        "files": done,
        **counts,
        "bytes_written": sum(r.get("file_bytes", 0) for r in done),
        "seconds": round(time.monotonic() - started, 3),
        "parallel_files": workers,
    }
