"""The stages of the `pt2st` flow: inspect a `.pt`, convert it, verify the output."""

from __future__ import annotations

from typing import Any

from zerosafe.pt2st import convert_pt, inspect_pt, verify_pt
from zerosafe_app.tasks.credentials import storage_for
from zerosafe_app.tasks.edge import stage_task


@stage_task("inspect", run_name="inspect")
def inspect(source: str, storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Read the pickle only; refuse what cannot be converted before anything is written."""
    return inspect_pt(source, storage=storage_for(storage_options))


@stage_task("convert", run_name="convert")
def convert(
    source: str,
    destination: str,
    *,
    memory: int,
    overwrite: bool = False,
    storage_options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Stream every storage into the safetensors file; it appears only when whole.

    Not cached: a re-run finds a complete output of the same source version by itself
    (`status: already-complete`) and rewrites nothing.
    """
    return convert_pt(
        source,
        destination,
        storage=storage_for(storage_options),
        memory=memory,
        overwrite=overwrite,
    )


@stage_task("verify", run_name="verify")
def verify(
    destination: str,
    expected_sha256: dict[str, str] | None = None,
    storage_options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Re-read the output: header (with the safetensors library when local), structure, and
    every entry's SHA-256 against the one recorded while writing."""
    return verify_pt(
        destination, storage=storage_for(storage_options), expected_sha256=expected_sha256
    )
