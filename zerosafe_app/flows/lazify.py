"""The flow `lazify`: a safetensors sibling next to every `.pt` of a DeepSpeed checkpoint tag.

list -> lazify (one task per `.pt`, at most as many at once as the memory budget holds). For
deployments on S3 (`storage_options`: endpoint, region, profile...) or NFS paths, e.g. run
after each save so the next resume maps the siblings (`zerosafe.lazy_torch_load`); the
command `zerosafe lazify` runs the same engine function without Prefect. Deployments
reference `flows/lazify.py:lazify`.
"""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact

from zerosafe.lazy import file_memory_bytes
from zerosafe.units import format_bytes
from zerosafe_app.flows.pt2st import checked_memory
from zerosafe_app.tasks.lazify import lazify_one, list_files

__all__ = ["lazify"]


def _checked_options(
    storage_options: dict[str, Any] | None, memory: str, parallel: int
) -> tuple[int, int]:
    """`(files at once, budget of each)`, refusing secrets and bad budgets before any I/O."""
    return file_memory_bytes(checked_memory(storage_options, memory), parallel)


@flow(name="lazify", log_prints=False, timeout_seconds=24 * 3600)
def lazify(
    checkpoint: str,
    tag: str | None = None,
    storage_options: dict[str, Any] | None = None,
    memory: str = "1GB",
    parallel: int = 2,
    verify_output: bool = True,
) -> dict[str, Any]:
    """Write or refresh `X.pt.safetensors` for every `.pt` of a checkpoint tag.

    Args:
        checkpoint: The folder holding `latest`, or a tag folder (local, NFS, `s3://...`).
        tag: The tag; by default the one `latest` names.
        storage_options: fsspec options for URLs (`endpoint_url`, `region`, `profile`...);
            never keys or secrets (refused: parameters are stored by Prefect), but
            `credentials` may name a Prefect block that holds them (`secret/NAME`).
        memory: Memory budget of the files converted at once (`512MB`, `2GiB`).
        parallel: Files converted at once (fewer when `memory` is small).
        verify_output: Re-read each sibling written and compare every entry's checksum.
    """
    workers, per_file_bytes = _checked_options(storage_options, memory, parallel)
    log = get_run_logger()
    listing = list_files(checkpoint, tag, storage_options)
    files: list[str] = listing["files"]
    log.info("%s: %d .pt files, %d at a time", listing["tag_url"], len(files), workers)
    results: list[dict[str, Any]] = []
    for start in range(0, len(files), workers):  # waves: never more files open than the budget
        futures = [
            lazify_one.submit(
                f,
                memory=per_file_bytes,
                verify=verify_output,
                storage_options=storage_options,
            )
            for f in files[start : start + workers]
        ]
        results.extend(fut.result() for fut in futures)
    counts = {
        s: sum(r["status"] == s for r in results) for s in ("current", "written", "rewritten")
    }
    written = sum(r.get("file_bytes", 0) for r in results)
    rows = "".join(f"| `{r['sibling']}` | {r['status']} |\n" for r in results)
    create_markdown_artifact(
        f"# zerosafe lazify `{listing['tag_url']}`\n\n{counts['written']} written, "
        f"{counts['rewritten']} rewritten, {counts['current']} already current; "
        f"{format_bytes(written)}\n\n| sibling | status |\n|---|---|\n{rows}",
        key="zerosafe-lazify",
    )
    return {**listing, "files": results, **counts, "bytes_written": written}
