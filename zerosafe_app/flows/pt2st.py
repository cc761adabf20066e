"""The flow `pt2st`: inspect -> convert -> verify, for one `torch.save` file.

Converts any `.pt` state dict or training checkpoint (zip format) into one safetensors file
that `zerosafe.load_pt_like` loads back as the object `torch.load` gives. For deployments
reading and writing S3 (`storage_options`: endpoint, region, profile...) or NFS paths; the
command `zerosafe pt2st` runs the same engine functions without Prefect. Deployments
reference `flows/pt2st.py:pt2st`.
"""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact

from zerosafe.config import ConvertOptions
from zerosafe.errors import ConfigError, VerificationError
from zerosafe.io.s3 import find_secret_options
from zerosafe.pt2st import safetensors_path_for
from zerosafe.units import format_bytes, parse_size
from zerosafe_app.tasks.credentials import storage_for
from zerosafe_app.tasks.pt2st import convert, inspect, verify

__all__ = ["checked_memory", "pt2st"]


def checked_memory(storage_options: dict[str, Any] | None, memory: str) -> int:
    """The memory budget in bytes, refusing secrets among the storage options first: flow
    parameters are stored in Prefect's database and shown in its UI.

    Raises:
        ConfigError: For a key or secret in `storage_options`, or a budget that is no size.
    """
    secrets = find_secret_options(storage_options or {})
    if secrets:
        raise ConfigError(
            f"{', '.join(secrets)}: credentials may not be flow parameters; give the workers "
            "AWS credentials through their environment, profile or instance role, or name a "
            "Prefect Secret block with `credentials=secret/NAME`"
        )
    try:
        return parse_size(memory)
    except ValueError as e:
        raise ConfigError(f"`memory`: {e}") from e


@flow(name="pt2st", log_prints=False, timeout_seconds=24 * 3600)
def pt2st(
    source: str,
    destination: str | None = None,
    storage_options: dict[str, Any] | None = None,
    memory: str = "1GB",
    overwrite: bool = False,
    verify_output: bool = True,
) -> dict[str, Any]:
    """Convert one `torch.save` file into one verified safetensors file.

    Args:
        source: The `.pt` file: a local or NFS path, or a URL (`s3://bucket/x.pt`).
        destination: The `.safetensors` file (default: `source` with `.safetensors`).
        storage_options: fsspec options for URLs (`endpoint_url`, `region`, `profile`...);
            never keys or secrets (refused: parameters are stored by Prefect), but
            `credentials` may name a Prefect block that holds them (`secret/NAME`).
        memory: Memory budget of the copy (`512MB`, `2GiB`).
        overwrite: Replace a destination that holds something else.
        verify_output: Re-read the output and compare every entry's checksum.
    """
    budget = checked_memory(storage_options, memory)
    ConvertOptions(memory=budget)  # validates the budget before any I/O
    destination = destination or safetensors_path_for(source)
    log = get_run_logger()
    info = inspect(source, storage_options)
    log.info(
        "%s: %d tensors in %d entries (%d views), %s",
        source,
        info["num_tensors"],
        info["num_entries"],
        info["num_views"],
        format_bytes(info["data_bytes"]),
    )
    summary = convert(
        source,
        destination,
        memory=budget,
        overwrite=overwrite,
        storage_options=storage_options,
    )
    result = {k: v for k, v in summary.items() if k != "sha256"}
    if verify_output:
        try:
            result["verify"] = verify(destination, summary.get("sha256"), storage_options)
        except VerificationError:
            if summary["status"] == "converted":  # ours, just written: leave nothing behind
                storage_for(storage_options).remove(destination)
            raise
    if summary["status"] == "converted":
        create_markdown_artifact(
            f"# zerosafe pt2st\n\n| | |\n|---|---|\n| source | `{source}` |\n"
            f"| output | `{destination}`: {summary['num_entries']} entries, "
            f"{format_bytes(summary['file_bytes'])} |\n"
            f"| tensors | {summary['num_tensors']} ({summary['num_views']} stored as views) |\n"
            f"| time | {summary['seconds']:.1f} s |\n"
            f"| verified | {'yes' if verify_output else 'no'} |\n",
            key="zerosafe-pt2st",
        )
    return result
