"""Safetensors siblings of a DeepSpeed checkpoint's `.pt` files, and whether they are current.

A sibling is `zerosafe pt2st` output written next to its `.pt` under the name
`X.pt.safetensors` (`sibling_path_for`): the full name of the `.pt` plus `.safetensors`, so
`ls` shows the pair together, a glob for `*.pt` (DeepSpeed's, zero_to_fp32's) never matches a
sibling, and it cannot collide with an unrelated `X.safetensors`.

A sibling records the identity of the `.pt` it was converted from in its `__metadata__`
(`zerosafe.pt2st.source_bytes` and `zerosafe.pt2st.source_version`: the size and the mtime
in nanoseconds, or the ETag on object stores; see `zerosafe.pt2st.convert`). It is current
only while the `.pt` still has that size and version. A copy that changes the mtime or ETag
(`cp` without `-p`, some object store copies) makes every sibling stale: the loader then
reads the `.pt` and `zerosafe lazify` writes the sibling again. Safe, never wrong.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass
from typing import Literal

from zerosafe.errors import CheckpointFormatError
from zerosafe.formats.safetensors import read_header
from zerosafe.io.storage import Storage, join_url
from zerosafe.pt2st.convert import (
    FORMAT_VERSION,
    META_SOURCE_BYTES,
    META_SOURCE_VERSION,
    META_VERSION,
)

__all__ = ["SIBLING_SUFFIX", "SiblingState", "list_pt_files", "sibling_path_for", "sibling_state"]

SIBLING_SUFFIX = ".safetensors"
"""Appended to the `.pt` file's full name: `X.pt` -> `X.pt.safetensors`."""


def sibling_path_for(pt_url: str) -> str:
    """The sibling of a `.pt` file: `.../zero_pp_rank_0_mp_rank_00_optim_states.pt` ->
    `.../zero_pp_rank_0_mp_rank_00_optim_states.pt.safetensors`."""
    return pt_url + SIBLING_SUFFIX


@dataclass(frozen=True, kw_only=True, slots=True)
class SiblingState:
    """Whether the sibling of `pt_url` holds the current content of `pt_url`."""

    pt_url: str
    sibling_url: str
    state: Literal["current", "missing", "stale"]
    why: str = ""
    """For `stale`: what differs (sizes, versions, or an unreadable header)."""

    @property
    def is_current(self) -> bool:
        return self.state == "current"


def sibling_state(storage: Storage, pt_url: str) -> SiblingState:
    """Compare the identity a sibling records with the `.pt` file's identity now.

    Reads the sibling's header and stats the `.pt`; reads no tensor data.

    Raises:
        CheckpointFormatError: If `pt_url` does not exist.
    """
    sibling_url = sibling_path_for(pt_url)
    if not storage.exists(sibling_url):
        return SiblingState(pt_url=pt_url, sibling_url=sibling_url, state="missing")
    try:
        identity = storage.identity(pt_url)
    except FileNotFoundError as e:
        raise CheckpointFormatError(f"{pt_url}: no such file") from e
    try:
        src = storage.open_source(sibling_url)
        try:
            _, metadata, _ = read_header(src)
        finally:
            src.close()
    except CheckpointFormatError as e:
        why = f"its header is unreadable ({e})"
        return SiblingState(pt_url=pt_url, sibling_url=sibling_url, state="stale", why=why)
    recorded = (metadata.get(META_SOURCE_BYTES), metadata.get(META_SOURCE_VERSION))
    now = (str(identity.size_bytes), identity.version)
    if metadata.get(META_VERSION) != FORMAT_VERSION:
        why = f"written in format '{metadata.get(META_VERSION)}', expected '{FORMAT_VERSION}'"
    elif recorded != now:
        why = (
            f"it was converted from {recorded[0]} bytes, version {recorded[1]}; the .pt now has "
            f"{now[0]} bytes, version {now[1]}"
        )
    else:
        return SiblingState(pt_url=pt_url, sibling_url=sibling_url, state="current")
    return SiblingState(pt_url=pt_url, sibling_url=sibling_url, state="stale", why=why)


def list_pt_files(storage: Storage, tag_url: str) -> list[str]:
    """Every `.pt` file of a tag folder (model states, optimizer states, expert files), sorted
    by name.

    Raises:
        CheckpointFormatError: If the folder holds no `.pt` file.
    """
    names = [n for n in storage.listdir(tag_url) if n.endswith(".pt")]
    if not names:
        raise CheckpointFormatError(
            f"{tag_url}: no .pt files in this tag folder; expected DeepSpeed's "
            "'*_model_states.pt' and '*_optim_states.pt'. Is the tag still being saved?"
        )
    return [join_url(tag_url, n) for n in sorted(names, key=posixpath.basename)]
