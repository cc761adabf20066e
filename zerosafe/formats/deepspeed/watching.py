"""Which tags of a checkpoint folder are ready to convert, converted, or still being written.

DeepSpeed writes a tag folder rank by rank and updates `latest` only once every rank has
saved (`engine.save_checkpoint`), so a tag newer than the one `latest` names may be half
written. A tag is ready when it is not newer than `latest` and its files pass the same checks
a conversion makes (every rank present, world sizes agreeing): anything else is "not ready
yet" and is looked at again on the next scan, never failed.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

from zerosafe.errors import ConversionError
from zerosafe.io.storage import TAG_NAME_MAX_BYTES, Storage, join_url
from zerosafe.stages.output import MARKER_NAME

__all__ = ["TagStatus", "scan_tags", "tag_step"]

log = logging.getLogger(__name__)

_STEP_RE = re.compile(r"(\d+)$")


def tag_step(tag: str) -> int | None:
    """The step number at the end of a tag name (`global_step1200` -> 1200), if any."""
    match = _STEP_RE.search(tag)
    return int(match.group(1)) if match else None


@dataclass(frozen=True, kw_only=True, slots=True)
class TagStatus:
    tag: str
    tag_url: str
    destination: str
    state: str
    """`done` (converted), `ready` (to convert), `partial` (conversion started, not complete:
    to resume), or `writing` (not ready yet)."""
    why: str = ""


def _is_tag_dir(storage: Storage, url: str, name: str) -> bool:
    if name.startswith(".") or not storage.isdir(join_url(url, name)):
        return False
    return any(n.endswith("_states.pt") for n in storage.listdir(join_url(url, name)))


def scan_tags(
    storage: Storage, root: str, destination_root: str, *, check_files: bool = True
) -> list[TagStatus]:
    """Classify every tag folder under checkpoint folder `root`, oldest step first.

    Args:
        root: A DeepSpeed checkpoint folder (holding `latest` and tag folders).
        destination_root: Each tag converts into `destination_root/<tag>`.
        check_files: Also read the pickles of tags not yet converted (rank files present,
            world sizes agreeing); without it only `latest` decides.
    """
    from zerosafe.formats.deepspeed.checkpoint import open_zero_checkpoint

    names = [n for n in storage.listdir(root) if _is_tag_dir(storage, root, n)]
    latest = None
    if "latest" in storage.listdir(root):
        raw = storage.read_small(
            join_url(root, "latest"),
            limit_bytes=TAG_NAME_MAX_BYTES,
            what="DeepSpeed's `latest` (the name of the last tag saved)",
        )
        latest = raw.decode("utf-8", "replace").strip()
    latest_step = tag_step(latest) if latest else None
    out = []
    for name in sorted(names, key=lambda n: (tag_step(n) is None, tag_step(n) or 0, n)):
        tag_url = join_url(root, name)
        dest = join_url(destination_root, name)
        if storage.exists(join_url(dest, MARKER_NAME)):
            out.append(TagStatus(tag=name, tag_url=tag_url, destination=dest, state="done"))
            continue
        step = tag_step(name)
        why = None
        if latest is None:
            why = "no 'latest' file yet"
        elif name != latest and (step is None or latest_step is None or step > latest_step):
            why = f"newer than 'latest' ({latest})"
        elif check_files:
            try:
                open_zero_checkpoint(storage, root, tag=name)
            except ConversionError as e:
                why = str(e)
        if why is not None:
            out.append(
                TagStatus(tag=name, tag_url=tag_url, destination=dest, state="writing", why=why)
            )
            continue
        started = storage.exists(join_url(dest, ".zerosafe-work"))
        out.append(
            TagStatus(
                tag=name, tag_url=tag_url, destination=dest, state="partial" if started else "ready"
            )
        )
    return out
