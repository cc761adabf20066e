"""What killed runs left behind, found (`find_leftovers`) and removed (`clean`): the engine
of `zerosafe clean TARGET` (its flags and output: `zerosafe_app.clean_cli`).

- Abandoned work areas: a job's folder (`OUT/.zerosafe-work/<job>/`, or a `--work-dir`) that
  holds a plan or a lease, whose lease is absent or stale (`zerosafe.io.lease`), and that nothing
  has touched for `--older-than`. The work area of a complete output converted with
  `--keep-work` is kept; that of a run whose cleanup failed after publishing is not.
- Unfinished S3 multipart uploads under TARGET: a killed run never completes or aborts them,
  so their parts stay, billed, until aborted (S3 API `ListMultipartUploads`,
  `AbortMultipartUpload`). Uploads under a live run's output or work area are left alone.
- Local temporary files (`.NAME.XXXX.partial`) that a killed run left beside its outputs.
- This user's private Prefect server folders (`TMPDIR/zerosafe-prefect-*`, with the server's
  log) of `--via prefect` commands killed with SIGKILL, whatever TARGET is
  (`zerosafe.io.owned_folders`; the next private server removes them too).

Nothing is removed without `--apply`.
"""

from __future__ import annotations

import json
import logging
import os
import posixpath
import re
import time
from dataclasses import dataclass
from typing import Any

from zerosafe.io.lease import destination_lease_url, lease_is_stale
from zerosafe.io.owned_folders import PRIVATE_SERVER_PREFIX, find_owned_folders
from zerosafe.io.s3 import abort_upload, list_incomplete_uploads
from zerosafe.io.storage import Storage, is_local, join_url, local_path
from zerosafe.stages.output import MANIFEST_NAME, MARKER_NAME, WORK_DIR_NAME, read_complete_manifest

__all__ = ["Leftover", "clean", "find_leftovers", "find_server_folders", "parse_age"]

log = logging.getLogger(__name__)

_PARTIAL_RE = re.compile(r"^\..+\.[0-9a-f]{8}\.partial$")
_WORK_MARKERS = ("plan/plan.json", "lease.json")
_PENDING_DIR = "/pending/"


@dataclass(kw_only=True)
class Leftover:
    """One thing a run left behind, and what `clean` does with it."""

    kind: str
    """`work-area`, `upload`, `partial-file` or `server-folder`."""
    url: str
    size_bytes: int
    age_seconds: float | None
    action: str
    """`remove`, or why it is kept: `live run`, `kept work of a complete output`, `recent`."""
    upload: Any = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "url": self.url,
            "size_bytes": self.size_bytes,
            "age_seconds": None if self.age_seconds is None else round(self.age_seconds),
            "action": self.action,
        }


def parse_age(text: str) -> float:
    """`90s`, `15m`, `2h`, `1d` or plain seconds -> seconds."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", text)
    if not m:
        raise ValueError(f"'{text}' is not an age; use e.g. 90s, 15m, 2h or 1d")
    return float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]


def _walk(storage: Storage, url: str) -> dict[str, tuple[int, float | None]]:
    """Every file under `url`: URL -> (size, mtime)."""
    out: dict[str, tuple[int, float | None]] = {}
    if is_local(url):
        root = local_path(url)
        for folder, _, names in os.walk(root):
            for name in names:
                path = os.path.join(folder, name)
                try:
                    st = os.stat(path)
                except FileNotFoundError:
                    continue
                rel = os.path.relpath(path, root).replace(os.sep, "/")
                out[join_url(url, rel)] = (st.st_size, st.st_mtime)
        return out
    fs, path = storage.filesystem(url)
    protocol = url.split("://", 1)[0]
    try:
        found = fs.find(path, detail=True)
    except FileNotFoundError:
        return out
    for key, info in found.items():
        if info.get("type") == "directory":
            continue
        stamp = info.get("LastModified") or info.get("mtime")
        mtime = float(stamp.timestamp()) if hasattr(stamp, "timestamp") else stamp
        out[f"{protocol}://{key}"] = (int(info.get("size") or 0), mtime)
    return out


def _lease_is_live(storage: Storage, work_url: str, now: float) -> bool:
    """Whether a live run holds this work area, or the output folder it belongs to."""
    parent = posixpath.dirname(work_url.rstrip("/"))
    if posixpath.basename(parent) == WORK_DIR_NAME:
        held = destination_lease_url(posixpath.dirname(parent))
        if _lease_file_is_live(storage, held, now):
            return True
    return _lease_file_is_live(storage, join_url(work_url, "lease.json"), now)


def _lease_file_is_live(storage: Storage, url: str, now: float) -> bool:
    if not storage.exists(url):
        return False
    try:
        lease = json.loads(storage.read_bytes(url))
    except ValueError:
        return False  # a torn lease file: nobody holds it
    return isinstance(lease, dict) and not lease_is_stale(lease, now)


def _kept_by_complete_output(storage: Storage, work_url: str) -> bool:
    parent = posixpath.dirname(work_url.rstrip("/"))
    if posixpath.basename(parent) != WORK_DIR_NAME:
        return False
    out_url = posixpath.dirname(parent)
    names = storage.listdir(out_url)
    if MARKER_NAME not in names or MANIFEST_NAME not in names:
        return False
    manifest = read_complete_manifest(storage, out_url)
    job = posixpath.basename(work_url.rstrip("/"))
    # A run whose cleanup failed after publishing leaves its work area too; manifests record
    # whether `--keep-work` asked to keep it (before they did, every one counts as kept).
    return (
        manifest is not None
        and str(manifest.get("job_key", "")).startswith(job)
        and bool(manifest.get("keep_work", True))
    )


def find_leftovers(
    storage: Storage, target: str, *, older_than_seconds: float, now: float | None = None
) -> list[Leftover]:
    """What killed runs left under `target` (an output folder, a work area or a parent)."""
    now = time.time() if now is None else now
    target = target.rstrip("/") or "/"
    files = _walk(storage, target)
    work_areas: dict[str, list[tuple[int, float | None]]] = {}
    for url in files:
        for marker in _WORK_MARKERS:
            if url.endswith("/" + marker):
                work_areas.setdefault(url[: -len(marker) - 1], [])
        head, sep, _ = url.partition(_PENDING_DIR)
        if sep and posixpath.basename(posixpath.dirname(head)) == WORK_DIR_NAME:
            work_areas.setdefault(head, [])  # pending shards of a custom --work-dir's job
    # A work area nested in another (results of a custom work dir) belongs to the outer one.
    roots = sorted(work_areas)
    roots = [r for r in roots if not any(r.startswith(o + "/") for o in roots if o != r)]
    work_areas = {r: [] for r in roots}
    for url, stat in files.items():
        for root in roots:
            if url.startswith(root + "/"):
                work_areas[root].append(stat)
                break
    found: list[Leftover] = []
    live: list[str] = []
    for root, stats in sorted(work_areas.items()):
        mtimes = [m for _, m in stats if m is not None]
        age = now - max(mtimes) if mtimes else None
        size = sum(s for s, _ in stats)
        if _lease_is_live(storage, root, now):
            action = "live run"
            live.append(root)
            parent = posixpath.dirname(root)
            if posixpath.basename(parent) == WORK_DIR_NAME:
                live.append(posixpath.dirname(parent))  # its output folder
        elif _kept_by_complete_output(storage, root):
            action = "kept work of a complete output"
        elif age is not None and age < older_than_seconds:
            action = "recent"
        else:
            action = "remove"
        found.append(Leftover(kind="work-area", url=root, size_bytes=size, age_seconds=age,
                              action=action))  # fmt: skip

    def in_live(url: str) -> bool:
        return any(url == r or url.startswith(r + "/") for r in live)

    for url, (size, mtime) in sorted(files.items()):
        if not _PARTIAL_RE.match(posixpath.basename(url)):
            continue
        if any(url.startswith(r + "/") for r in roots):
            continue  # goes with its work area
        age = None if mtime is None else now - mtime
        action = (
            "live run"
            if in_live(url)
            else "recent"
            if age is not None and age < older_than_seconds
            else "remove"
        )
        found.append(Leftover(kind="partial-file", url=url, size_bytes=size, age_seconds=age,
                              action=action))  # fmt: skip

    if target.startswith(("s3://", "s3a://")):
        fs, _ = storage.filesystem(target)
        for upload in list_incomplete_uploads(fs, target):
            age = now - upload.initiated
            action = (
                "live run"
                if in_live(upload.url)
                else "recent"
                if age < older_than_seconds
                else "remove"
            )
            found.append(Leftover(kind="upload", url=upload.url, size_bytes=upload.size_bytes,
                                  age_seconds=age, action=action, upload=upload))  # fmt: skip
    return found


def find_server_folders(*, older_than_seconds: float) -> list[Leftover]:
    """This user's private Prefect server folders (in `TMPDIR`) whose command is gone: they
    belong to no TARGET, so `clean` lists them beside what it finds under any."""
    return [
        Leftover(
            kind="server-folder",
            url=folder.path,
            size_bytes=folder.size_bytes,
            age_seconds=folder.age_seconds,
            action="recent" if folder.age_seconds < older_than_seconds else "remove",
        )
        for folder in find_owned_folders(PRIVATE_SERVER_PREFIX)
        if not folder.owner_alive
    ]


def clean(
    storage: Storage,
    target: str,
    *,
    older_than_seconds: float,
    apply: bool,
    server_folders: bool = False,
) -> list[Leftover]:
    """Find leftovers under `target`; with `apply`, remove those whose action is `remove`.

    Args:
        server_folders: Also this user's server folders of killed commands
            (`find_server_folders`), which lie outside any `target`; `zerosafe clean` asks
            for them, a caller cleaning one target only does not.
    """
    found = find_leftovers(storage, target, older_than_seconds=older_than_seconds)
    if server_folders:
        found += find_server_folders(older_than_seconds=older_than_seconds)
    if not apply:
        return found
    for item in found:
        if item.action != "remove":
            continue
        if item.kind == "upload":
            fs, _ = storage.filesystem(item.url)
            abort_upload(fs, item.upload)
        elif item.kind in ("work-area", "server-folder"):
            storage.remove_tree(item.url)
        else:
            storage.remove(item.url)
        item.action = "removed"
        log.info("removed %s %s", item.kind, item.url)
    return found
