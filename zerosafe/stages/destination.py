"""Where an output may go and what may already be there: the checks every target (safetensors
weights and adapters, `--to universal`, `--to dcp`) makes on its output folder before it
writes anything (issue 37, items 4 and 6).

- **Apart from the checkpoint.** An output that is the checkpoint folder, lies inside it (the
  tag folder `CKPT/global_step2`) or holds it would put the output's files and completion
  marker among the checkpoint's: `inspect` then takes the folder for the output's format, and
  converting the save no longer works. Locations are compared as `Storage.canonical_url`
  spells them (links resolved, `s3a://b//k/` is `s3://b/k`).
- **One kind of output per folder.** Each kind marks its output complete with its own marker
  (`OUTPUT_KINDS`); `inspect` and `verify` see one of them, so a second kind beside the first
  would never be verified. Another kind's complete output is refused, or, with `overwrite`,
  removed as that kind's own overwrite removes it (marker first, so nothing looks complete
  meanwhile). Files no marker vouches for are each target's own business, as before.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from zerosafe.errors import CheckpointFormatError, ConfigError, OutputExistsError
from zerosafe.io.storage import Storage, join_url
from zerosafe.stages.output import MARKER_NAME as WEIGHTS_MARKER_NAME
from zerosafe.stages.output import OUTPUT_JSON_MAX_BYTES, clear_output

__all__ = [
    "DCP_MARKER_NAME",
    "DCP_METADATA_NAME",
    "LATEST_UNIVERSAL",
    "OUTPUT_KINDS",
    "UNIVERSAL_MARKER_NAME",
    "OutputKind",
    "check_output_apart",
    "check_output_kind",
    "clear_dcp_output",
    "clear_universal_output",
]

log = logging.getLogger(__name__)

UNIVERSAL_MARKER_NAME = "zerosafe-universal-complete.json"
LATEST_UNIVERSAL = "latest_universal"
DCP_MARKER_NAME = "zerosafe-dcp-complete.json"
DCP_METADATA_NAME = ".metadata"

KindName = Literal["weights", "universal", "dcp"]


def _read_marker(storage: Storage, url: str) -> dict[str, Any]:
    """A marker's (or manifest's) JSON object; {} when it is not one or is gone (then only
    fixed names are removed)."""
    try:
        raw = storage.read_small(
            url, limit_bytes=OUTPUT_JSON_MAX_BYTES, what="a zerosafe marker or manifest (JSON)"
        )
        found = json.loads(raw)
    except (ValueError, OSError, CheckpointFormatError):
        return {}
    return found if isinstance(found, dict) else {}


def clear_universal_output(storage: Storage, out_url: str) -> None:
    """Remove a complete `--to universal` output: its marker first, then `latest_universal`
    and the folder the marker names."""
    marker_url = join_url(out_url, UNIVERSAL_MARKER_NAME)
    done = _read_marker(storage, marker_url)
    storage.remove(marker_url)
    storage.remove(join_url(out_url, LATEST_UNIVERSAL))
    folder = done.get("folder")
    if isinstance(folder, str) and folder and "/" not in folder and folder != "..":
        manifest_url = join_url(out_url, folder, "zerosafe-manifest.json")
        files = _read_marker(storage, manifest_url).get("files", [])
        carried = [
            f.get("path")
            for f in files
            if isinstance(f, dict)
            and isinstance(f.get("expect"), dict)
            and f["expect"].get("kind") == "client"
        ]
        _remove_carried(storage, out_url, carried)
        storage.remove_tree(join_url(out_url, folder))


def _remove_carried(storage: Storage, out_url: str, paths: list[Any]) -> None:
    """The training client's files an output carried (`training_state.client_files`)."""
    for path in paths:
        if isinstance(path, str) and path and ".." not in path.split("/"):
            storage.remove(join_url(out_url, path))


def clear_dcp_output(storage: Storage, out_url: str) -> None:
    """Remove a complete `--to dcp` output: its marker first, then the `.metadata` of each
    folder and the `.distcp` files the marker lists."""
    marker_url = join_url(out_url, DCP_MARKER_NAME)
    done = _read_marker(storage, marker_url)
    storage.remove(marker_url)
    for folder in done.get("folders", [""]):
        if isinstance(folder, str) and "/" not in folder and ".." not in folder:
            storage.remove(join_url(out_url, folder, DCP_METADATA_NAME) if folder
                           else join_url(out_url, DCP_METADATA_NAME))  # fmt: skip
    for f in done.get("files", []):
        path = str(f["path"]) if isinstance(f, dict) and "path" in f else ""
        if ".." not in path and path.rsplit("/", 1)[-1].endswith(".distcp"):
            storage.remove(join_url(out_url, path))
    carried = done.get("client_files", [])
    _remove_carried(storage, out_url, [f.get("file") for f in carried if isinstance(f, dict)])


@dataclass(frozen=True, kw_only=True, slots=True)
class OutputKind:
    """One kind of output zerosafe writes, known by its completion marker."""

    name: KindName
    marker_name: str
    """The file written last into the output folder, vouching that the output is complete."""
    label: str
    """What the kind is, for messages: the output and the option that writes it."""
    clear: Callable[[Storage, str], None]
    """Removes a complete output of this kind from a folder, its marker first."""


OUTPUT_KINDS: tuple[OutputKind, ...] = (
    OutputKind(
        name="weights", marker_name=WEIGHTS_MARKER_NAME, clear=clear_output,
        label="safetensors weights (`zerosafe convert`, or `--adapter`)",
    ),
    OutputKind(
        name="universal", marker_name=UNIVERSAL_MARKER_NAME, clear=clear_universal_output,
        label="a DeepSpeed universal checkpoint (`--to universal`)",
    ),
    OutputKind(
        name="dcp", marker_name=DCP_MARKER_NAME, clear=clear_dcp_output,
        label="a PyTorch DCP checkpoint (`--to dcp`)",
    ),
)  # fmt: skip


def check_output_apart(storage: Storage, source: str, output: str) -> None:
    """Refuse an output folder that is the checkpoint folder, lies inside it or holds it.

    Args:
        source: The checkpoint folder (or tag folder) as given.
        output: The output folder as given.

    Raises:
        ConfigError: If the two are one folder, or one is inside the other.
    """
    src, out = storage.canonical_url(source), storage.canonical_url(output)
    if src == out:
        found = "the checkpoint folder itself"
    elif out.startswith(src.rstrip("/") + "/"):
        found = "a folder inside the checkpoint folder"
    elif src.startswith(out.rstrip("/") + "/"):
        found = "a folder holding the checkpoint"
    else:
        return
    raise ConfigError(
        f"{output}: expected an output folder apart from the checkpoint '{source}', found "
        f"{found}; the output's files and completion marker would land among the checkpoint's "
        "(or the checkpoint among the output's). Choose an output folder outside the "
        "checkpoint folder that does not hold it"
    )


def check_output_kind(storage: Storage, out_url: str, kind: KindName, *, overwrite: bool) -> None:
    """Refuse an output folder that holds another kind's complete output; with `overwrite`,
    remove that output (as its own kind's overwrite would) so only `kind` remains.

    Raises:
        OutputExistsError: If another kind's marker is there and `overwrite` is off.
    """
    own = next(k for k in OUTPUT_KINDS if k.name == kind)
    for other in OUTPUT_KINDS:
        marker_url = join_url(out_url, other.marker_name)
        # `exists`, not a listing: an output that is a file is left to the first write to refuse
        if other.name == kind or not storage.exists(marker_url):
            continue
        if not overwrite:
            raise OutputExistsError(
                f"{marker_url}: expected no other kind of output in a folder for {own.label}, "
                f"found the completion marker of {other.label}; one folder holds one kind "
                "(`inspect` and `verify` would see only one). Pass --overwrite to replace it, "
                "or choose another output folder."
            )
        log.warning("%s: removing %s (--overwrite) to write %s", out_url, other.label, own.label)
        other.clear(storage, out_url)
