"""DeepSpeed checkpoint engines whose files carry DeepSpeed's names but not a readable save,
recognised after a file fails to load (or loads as a placeholder), so the refusal says what
the file is and what would convert it. Nothing is read on the path of a good file.

- **DataStates** (`datastates_checkpoint_engine.py`, the `datastates` package from
  github.com/DataStates/datastates-llm, not on PyPI): each `*.pt` holds, instead of a
  `torch.save` zip, an 8-byte little-endian integer and a JSON header of the tensors (`dtype`,
  `shape`, offsets, and a `datastates_metadata` entry for the pickled rest): the Python
  engines write the header's length then the header at byte 8 (or 4096, their alignment),
  the C++ engine the header's offset then the header at that offset, after the data.
- **Nebula** (`nebula_checkpoint_engine.py`, DeepSpeed 0.8 to 0.17): `save` writes
  `torch.save("", path)` as a placeholder and hands the state to `torch_nebula`, which keeps
  it in its own persistent storage; the tag folder holds only these placeholders.
- **Unfinished** saves: the decoupled engine (`decoupled_checkpoint_engine.py`) and other
  asynchronous writers write the files in the background and `latest` only at commit, so a
  tag that `latest` does not name yet may hold files cut short.
"""

from __future__ import annotations

import posixpath

from zerosafe.errors import CheckpointFormatError
from zerosafe.io.storage import TAG_NAME_MAX_BYTES, ByteSource, Storage, join_url

__all__ = [
    "commit_state",
    "explain_unreadable",
    "not_committed_error",
    "is_datastates_head",
    "nebula_placeholder_error",
]

_ZIP_MAGIC = b"PK\x03\x04"
_ZIP_END = b"PK\x05\x06"
_ZIP_END_SPAN = 65535 + 22
_HEAD_BYTES = 4096 + 64
_DATASTATES_ALIGNMENT = 4096
"""Where the Python engines put the JSON header: right after the 8-byte length, or at the
next multiple of their `ALIGNMENT` (4096)."""


def _starts_json(raw: bytes) -> bool:
    return raw.startswith(b'{"')


def is_datastates_head(head: bytes, size_bytes: int, at_offset: bytes | None = None) -> bool:
    """Whether a file's first bytes are a DataStates engine's: an 8-byte little-endian
    length or offset, then a JSON object at byte 8 or 4096 (zeros between), or at that offset
    (`at_offset`: the bytes there, read by the caller)."""
    if len(head) < 10 or head.startswith(_ZIP_MAGIC):
        return False
    value = int.from_bytes(head[:8], "little")
    if value <= 0 or value >= size_bytes:
        return False
    if _starts_json(head[8:]):
        return True
    if len(head) >= _DATASTATES_ALIGNMENT + 2 and not any(head[8:_DATASTATES_ALIGNMENT]):
        return _starts_json(head[_DATASTATES_ALIGNMENT:])
    return at_offset is not None and _starts_json(at_offset)


def _datastates_keys(head: bytes) -> bool:
    """Whether the JSON header in `head` (where it is whole) names `datastates_metadata`."""
    return b'"datastates_metadata"' in head


def _has_zip_end(source: ByteSource) -> bool:
    """Whether the zip's end-of-central-directory record is there (in its last 64 KiB + 22
    bytes, the most a zip comment allows): a file still being written has none yet."""
    size = source.size_bytes
    return _ZIP_END in source.read_range(max(0, size - _ZIP_END_SPAN), size)


def commit_state(storage: Storage, tag_url: str) -> tuple[str, str | None]:
    """`(folder, tag latest names)` for the tag at `tag_url` not committed: the folder above
    it and the tag its `latest` names (None: no `latest`); `("", None)` where `latest` names
    this very tag, or cannot be read."""
    ckpt_url = posixpath.dirname(tag_url.rstrip("/"))
    tag = tag_url.rstrip("/").rsplit("/", 1)[-1]
    latest = join_url(ckpt_url, "latest") if ckpt_url else ""
    if not latest or not storage.exists(latest):
        return ckpt_url or ".", None
    try:
        raw = storage.read_small(latest, limit_bytes=TAG_NAME_MAX_BYTES, what="`latest`")
        named = raw.decode("utf-8", "replace").strip()
    except Exception:  # noqa: BLE001 - only context for the message
        return "", None
    return ("", None) if named == tag else (ckpt_url, named)


def not_committed_error(storage: Storage, tag_url: str, found: str) -> CheckpointFormatError | None:
    """The refusal for `found` (a file cut short, empty or missing) in a tag that `latest`
    does not name, or None where it names it (then the file is damaged, not unfinished).

    No `latest` at all: the tag is a save an asynchronous writer (DeepSpeed's decoupled
    engine writes the files in the background and `latest` at commit) has not finished, or
    an incomplete copy. `latest` naming another tag: either this tag is the save in progress,
    or an older one that is damaged; the message says both.
    """
    folder, named = commit_state(storage, tag_url)
    if not folder:
        return None
    why = (
        "DeepSpeed writes `latest` when a save is committed, and its decoupled engine writes "
        "the files in the background"
    )
    if named is None:
        return CheckpointFormatError(
            f"{found}, and {folder} has no `latest` yet: the save of this tag is not finished "
            f"({why}), or the copy is incomplete; wait for `latest` to name the tag, or copy "
            "the whole tag folder again"
        )
    return CheckpointFormatError(
        f"{found}, and `latest` names '{named}', not this tag: if this tag is a save in "
        f"progress, it is not finished ({why}): wait for `latest` to name it; otherwise the "
        f"tag is damaged: copy it again, or convert '{named}'"
    )


def explain_unreadable(storage: Storage, source: ByteSource, error: Exception) -> Exception:
    """The error to raise for a DeepSpeed file that did not open as a `torch.save` file:
    one naming the engine that wrote it where its first bytes say so, or the unfinished save
    it belongs to, else `error`."""
    url = source.url
    size = source.size_bytes
    tag_url = posixpath.dirname(url)
    head = source.read_range(0, min(_HEAD_BYTES, size)) if size else b""
    if not head:
        unfinished = not_committed_error(storage, tag_url, f"{url}: an empty file (0 bytes)")
        return unfinished or error
    offset = int.from_bytes(head[:8], "little") if len(head) >= 8 else 0
    at_offset = source.read_range(offset, min(offset + 2, size)) if 8 <= offset < size else None
    if is_datastates_head(head, size, at_offset):
        where = "at byte 8" if _starts_json(head[8:]) else "after it"
        also = ", naming `datastates_metadata`" if _datastates_keys(head) else ""
        return CheckpointFormatError(
            f"{url}: written by DeepSpeed's DataStates checkpoint engine (an 8-byte "
            f"little-endian length, then a JSON tensor header {where}{also}), not by "
            "torch.save; zerosafe reads torch.save files only. Load the checkpoint with "
            "DataStates (`datastates` checkpoint engine) and save it again with DeepSpeed's "
            'default torch engine (`checkpoint: {"engine": "torch"}` or no engine set), '
            "then convert that"
        )
    if head.startswith(_ZIP_MAGIC) and not _has_zip_end(source):
        found = f"{url}: a torch.save zip without its end record yet ({size} bytes)"
        return not_committed_error(storage, tag_url, found) or error
    return error


def nebula_placeholder_error(url: str, obj: object) -> CheckpointFormatError | None:
    """The refusal for a Nebula placeholder (`torch.save("", path)`), or None for any other
    object."""
    if obj != "":
        return None
    return CheckpointFormatError(
        f"{url}: an empty placeholder (torch.save of an empty string), as DeepSpeed's Nebula "
        "checkpoint engine writes beside the state it hands to torch_nebula; the weights are "
        "in Nebula's persistent storage (`nebula.persistent_storage_path` in the DeepSpeed "
        "config), not here. Load the checkpoint with Nebula enabled (`enable_nebula_load`) "
        "and save it again with DeepSpeed's torch engine (no `nebula` section), then convert "
        "that"
    )
