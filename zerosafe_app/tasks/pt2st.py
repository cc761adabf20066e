"""The stages of the `pt2st` flow: inspect a `.pt`, convert it, verify the output."""

from __future__ import annotations

from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from zerosafe.pt2st import convert_pt, inspect_pt, verify_pt
from zerosafe_app.tasks._common import is_transient
from zerosafe_app.tasks.credentials import storage_for

_RETRIES: dict[str, Any] = {
    "retries": 3,
    "retry_delay_seconds": [2, 10, 30],
    "retry_condition_fn": is_transient,
}


@task(name="inspect", task_run_name="inspect", cache_policy=NO_CACHE, **_RETRIES)
def inspect(source: str, storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Read the pickle only; refuse what cannot be converted before anything is written."""
    return inspect_pt(source, storage=storage_for(storage_options))


@task(name="convert", task_run_name="convert", cache_policy=NO_CACHE, **_RETRIES)
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


@task(name="verify", task_run_name="verify", cache_policy=NO_CACHE, **_RETRIES)
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
