"""The output folder: what counts as complete, what may be replaced, and how it is published.

An output folder holds `model.safetensors` or `model-0000K-of-0000N.safetensors` plus
`model.safetensors.index.json` (transformers' sharded layout), `zerosafe-manifest.json`
(source identity, options, per-tensor checksums) and `zerosafe-complete.json`, the completion
marker, written last. Without the marker an output is not complete, whatever else is there.
Work files (plan, intermediates) live in `.zerosafe-work/<job>/` unless placed elsewhere.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

from zerosafe._version import __version__
from zerosafe.config import ConvertOptions
from zerosafe.errors import OutputExistsError, VerificationError
from zerosafe.plan import Plan
from zerosafe.storage import Storage, join_url

__all__ = [
    "INDEX_NAME",
    "MANIFEST_NAME",
    "MARKER_NAME",
    "WORK_DIR_NAME",
    "OutputState",
    "clear_output",
    "default_work_url",
    "inspect_output",
    "prepare_output",
    "publish",
    "read_complete_manifest",
]

log = logging.getLogger(__name__)

INDEX_NAME = "model.safetensors.index.json"
MANIFEST_NAME = "zerosafe-manifest.json"
MARKER_NAME = "zerosafe-complete.json"
WORK_DIR_NAME = ".zerosafe-work"
MANIFEST_FORMAT = 1


def default_work_url(out_url: str, job_key: str) -> str:
    """Where a job keeps its plan and intermediates unless told otherwise."""
    return join_url(out_url, WORK_DIR_NAME, job_key[:16])


def _is_model_file(name: str) -> bool:
    return name == INDEX_NAME or (name.startswith("model") and name.endswith(".safetensors"))


@dataclass(frozen=True, slots=True)
class OutputState:
    kind: str
    """`empty`, `done` (complete, same job), `other` (complete, another job), `partial`
    (unfinished run of this job), `foreign` (model files without a marker, not this job's)."""
    detail: str = ""
    manifest: dict[str, Any] | None = None


def read_complete_manifest(storage: Storage, out_url: str) -> dict[str, Any] | None:
    """The manifest of a complete output (marker present and vouching for it), else None."""
    marker_url = join_url(out_url, MARKER_NAME)
    if not storage.exists(marker_url):
        return None
    marker = json.loads(storage.read_bytes(marker_url))
    raw = storage.read_bytes(join_url(out_url, MANIFEST_NAME))
    if hashlib.sha256(raw).hexdigest() != marker.get("manifest_sha256"):
        log.warning(
            "%s: the completion marker does not match the manifest; treating as incomplete", out_url
        )
        return None
    manifest: dict[str, Any] = json.loads(raw)
    return manifest


def quick_done(
    storage: Storage, ckpt_url: str, tag: str | None, out_url: str, options: ConvertOptions
) -> str | None:
    """The job key if `out_url` already holds this exact conversion, checked from file stats
    alone (no checkpoint byte is read); None otherwise or when unsure."""
    from zerosafe.plan import job_key_of
    from zerosafe.zero_checkpoint import quick_identities

    if options.overwrite or not storage.exists(join_url(out_url, MARKER_NAME)):
        return None
    try:
        manifest = read_complete_manifest(storage, out_url)
        resolved_tag, identities = quick_identities(storage, ckpt_url, tag)
    except Exception:  # anything odd: take the full path, which reports it properly
        return None
    key = job_key_of(resolved_tag, identities, options)
    return key if manifest is not None and manifest.get("job_key") == key else None


def inspect_output(storage: Storage, out_url: str, job_key: str) -> OutputState:
    """Classify what `out_url` holds relative to the job `job_key`."""
    names = storage.listdir(out_url)
    if MARKER_NAME in names:
        manifest = read_complete_manifest(storage, out_url)
        if manifest is not None:
            if manifest.get("job_key") == job_key:
                return OutputState("done", manifest=manifest)
            src = manifest.get("source", {})
            return OutputState(
                "other",
                f"a complete conversion of {src.get('checkpoint')} (tag {src.get('tag')}) with options "
                f"{manifest.get('options')}",
                manifest,
            )
    work = default_work_url(out_url, job_key)
    if storage.exists(join_url(work, "plan", "plan.json")):
        return OutputState("partial")
    model_files = [n for n in names if _is_model_file(n) or n in (MANIFEST_NAME, MARKER_NAME)]
    if model_files:
        return OutputState(
            "foreign", f"model files not written by this job: {', '.join(model_files[:5])}"
        )
    return OutputState("empty")


def clear_output(storage: Storage, out_url: str) -> None:
    """Remove a previous conversion: the marker first, so nothing looks complete meanwhile."""
    storage.remove(join_url(out_url, MARKER_NAME))
    for name in storage.listdir(out_url):
        if _is_model_file(name) or name == MANIFEST_NAME:
            storage.remove(join_url(out_url, name))
    storage.remove_tree(join_url(out_url, WORK_DIR_NAME))


def prepare_output(storage: Storage, out_url: str, job_key: str, *, overwrite: bool) -> OutputState:
    """Decide whether to convert into `out_url`; clears it when `overwrite` says to.

    Returns:
        The state found: `done` means there is nothing to do.

    Raises:
        OutputExistsError: If the folder holds another conversion and `overwrite` is off.
    """
    state = inspect_output(storage, out_url, job_key)
    if state.kind in ("other", "foreign"):
        if not overwrite:
            raise OutputExistsError(
                f"{out_url}: already holds {state.detail}. Pass --overwrite to replace it, or "
                "choose another output folder."
            )
        clear_output(storage, out_url)
        return OutputState("empty")
    if state.kind == "done" and overwrite:
        clear_output(storage, out_url)
        return OutputState("empty")
    return state


def _checks(verifies: list[dict[str, Any]]) -> dict[str, Any]:
    """What verification covered, for the manifest."""
    checks: dict[str, Any] = {"verified_tensors": sum(v.get("num_tensors", 0) for v in verifies)}
    for v in verifies:
        if v.get("check") == "lowp":
            checks["lowp_cross_check"] = {
                k: v[k] for k in ("lowp_checked", "lowp_mismatched", "lowp_skipped")
            }
    return checks


def publish(
    plan: Plan,
    storage: Storage,
    out_url: str,
    *,
    options: ConvertOptions,
    merges: list[dict[str, Any]],
    verifies: list[dict[str, Any]],
    integrity: dict[str, Any],
    stats: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Write the index and the manifest, then the completion marker, last.

    Raises:
        VerificationError: If any shard failed verification; then nothing is written.
    """
    failures = [f for v in verifies for f in v.get("failures", [])]
    if failures:
        lines = [f"{f['file']}: {f['tensor']}: {f['check']}: {f['detail']}" for f in failures[:20]]
        raise VerificationError(
            f"{out_url}: {len(failures)} check(s) failed; the output was not marked complete:\n  "
            + "\n  ".join(lines),
            failures,
        )
    by_shard = sorted(merges, key=lambda m: m["shard"])
    if [m["shard"] for m in by_shard] != list(range(len(plan.shards))):
        raise AssertionError("publish needs one merge result per shard")
    weight_map = {name: m["file"] for m in by_shard for name in m["tensors"]}
    total_size = sum(m["data_bytes"] for m in by_shard)
    if len(plan.shards) > 1:
        index: dict[str, Any] = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
        if plan.aliases:
            index["metadata"]["aliases"] = plan.aliases
        storage.write_bytes(
            join_url(out_url, INDEX_NAME), (json.dumps(index, indent=2) + "\n").encode()
        )
    roles = {t.name: t.role for t in plan.tensors}
    manifest = {
        "manifest_format": MANIFEST_FORMAT,
        "zerosafe_version": __version__,
        "job_key": plan.plan_id,
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "source": plan.source,
        "options": {**options.identity(), "direct": options.direct},
        "files": [
            {"file": m["file"], "size_bytes": m["file_bytes"], "data_bytes": m["data_bytes"]}
            for m in by_shard
        ],
        "total_size": total_size,
        "tensors": {
            name: {**info, "file": m["file"], "role": roles.get(name, "param")}
            for m in by_shard
            for name, info in m["tensors"].items()
        },
        "aliases": plan.aliases,
        "integrity": integrity,
        "checks": _checks(verifies),
        "notes": plan.notes,
        "warnings": plan.warnings,
        "stats": stats or {},
    }
    raw = (json.dumps(manifest, indent=1) + "\n").encode()
    storage.write_bytes(join_url(out_url, MANIFEST_NAME), raw)
    marker = {
        "job_key": plan.plan_id,
        "manifest_sha256": hashlib.sha256(raw).hexdigest(),
        "completed_at": manifest["created_at"],
        "zerosafe_version": __version__,
    }
    storage.write_bytes(
        join_url(out_url, MARKER_NAME), (json.dumps(marker, indent=1) + "\n").encode()
    )
    return manifest
