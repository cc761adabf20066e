"""Each finished unit of work's result, kept in the job's work area, so that a run killed at
any point and started again redoes only what had not finished.

The in-process driver (`zerosafe.driver.convert_checkpoint`) writes one small JSON file per
unit, `WORK/units/<stage>-<index>.json`, once the unit's output is complete: written whole
under a temporary name and renamed (`Storage.write_bytes`; a PUT on object stores). A record
holds the unit's key and its result. The key is `unit_key`, the same blob that keys the flow's
cached task results (`zerosafe_app.tasks._common.cache_key`): the stage, the job key (the plan,
which holds every option that changes output bytes), the unit, a content fingerprint of what
it reads, and the few options that change its result.

A record is used only when its key matches this run's and what it describes is still on disk
as it was: an intermediate with the recorded content hash, a shard with the recorded size and
version (mtime or ETag). Anything else, including an unreadable record, runs the unit again.
Neither size nor version sees a file damaged in place (a zero-filled page after a crash, bit
rot on NFS), so a unit whose output fails its final check is dropped (`drop`): kept, it
would fail every later run the same way; and a verify's key holds the run
(`zerosafe.pipeline.verify_fingerprint`), so no run publishes a shard on an earlier run's
verify.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping
from typing import Any, Literal

from zerosafe.io.storage import Storage, join_url

__all__ = ["UNIT_KEY_FORMAT", "Stage", "UnitRecords", "fingerprint", "unit_key"]

log = logging.getLogger(__name__)

UNIT_KEY_FORMAT = 1
"""Bump when a stage's output bytes change for the same inputs: invalidates old records and
the flow's cached results alike."""

Stage = Literal["extract", "merge", "verify", "universal", "dcp"]
"""`universal`: a unit of `--to universal` (`zerosafe.training_state.universal`); `dcp`: of
`--to dcp` (`zerosafe.training_state.dcp`)."""


def fingerprint(*values: Any) -> str:
    """A content fingerprint of JSON-able values, for a unit's key."""
    return hashlib.sha256(json.dumps(values, sort_keys=True, default=str).encode()).hexdigest()[:32]


def unit_key(
    stage: str,
    job_key: str,
    index: int | None,
    content: str | None,
    *,
    direct: bool | None,
    allow_nonfinite: bool | None,
    file_sha256: bool = False,
) -> str:
    """The key of one unit's result.

    Options that change output bytes are already in `job_key`; of the rest only those that
    change a unit's result are here: `direct` changes what a merge reads, `allow_nonfinite`
    what verify reports, `file_sha256` whether verify hashes the whole file (only in verify's
    key, and only when on, so the keys of earlier runs stay valid). So another memory budget
    or `--keep-work` on a rerun still finds every finished unit.

    Args:
        content: The fingerprint of what the unit reads (`fingerprint`): the intermediates'
            content hashes for a staged merge, the shard's identity and recorded checksums
            for a verify; empty where the plan alone decides it.
    """
    relevant: dict[str, Any] = {"direct": direct, "allow_nonfinite": allow_nonfinite}
    if stage == "verify" and file_sha256:
        relevant["file_sha256"] = True
    blob = json.dumps([UNIT_KEY_FORMAT, stage, job_key, index, content, relevant], sort_keys=True)
    return f"zerosafe-{stage}-{hashlib.sha256(blob.encode()).hexdigest()[:40]}"


class UnitRecords:
    """The unit records of one work area (see the module docstring)."""

    def __init__(self, storage: Storage, work_url: str) -> None:
        self._storage = storage
        self._folder = join_url(work_url, "units")

    def _url(self, stage: Stage, index: int) -> str:
        return join_url(self._folder, f"{stage}-{index:05d}.json")

    def load(self, stage: Stage, index: int, key: str) -> Mapping[str, Any] | None:
        """The record of unit (`stage`, `index`) if one was written under `key`, else None:
        `{"result": ..., **what the unit's writer added}`."""
        url = self._url(stage, index)
        try:
            if not self._storage.exists(url):
                return None
            record = json.loads(self._storage.read_bytes(url))
        except (OSError, ValueError) as e:
            log.info("%s: unreadable unit record (%s); running the unit again", url, e)
            return None
        if not isinstance(record, dict) or record.get("key") != key or "result" not in record:
            return None
        return record

    def save(
        self, stage: Stage, index: int, key: str, result: Mapping[str, Any], **extra: Any
    ) -> None:
        """Record that unit (`stage`, `index`) finished with `result` (its `to_json()`)."""
        body = {"key": key, "result": dict(result), **extra}
        self._storage.write_bytes(self._url(stage, index), json.dumps(body).encode())

    def drop(self, stage: Stage, index: int) -> None:
        """Forget unit (`stage`, `index`): the next run runs it again."""
        self._storage.remove(self._url(stage, index))

    def clear(self) -> None:
        """Forget every unit (`--overwrite`): the next run starts clean."""
        self._storage.remove_tree(self._folder)
