"""The output folder: what counts as complete, what may be replaced, and how it is published.

An output folder holds `model.safetensors` or `model-0000K-of-0000N.safetensors` plus
`model.safetensors.index.json` (transformers' sharded layout), the model files copied from
the checkpoint folder (`config.json`, tokenizer files: `zerosafe.stages.model_files`; a
`config.json` the reader made from the checkpoint where they hold none),
`zerosafe-manifest.json` (source identity, options, per-tensor checksums, each copied file's
SHA-256, and with `file_sha256` each weight file's SHA-256) and `zerosafe-complete.json`, the completion marker, written last. Without the marker an output is not complete, whatever else is there.
Work files (plan, intermediates) live in `.zerosafe-work/<job>/` unless placed elsewhere.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from zerosafe._version import __version__
from zerosafe.config import ConvertOptions
from zerosafe.errors import OutputExistsError, VerificationError
from zerosafe.formats.crc import IntegrityReport
from zerosafe.io.storage import JSON_MAX_BYTES, FileIdentity, Storage, is_local, join_url
from zerosafe.plan.adapter import ADAPTER_WEIGHTS_NAME
from zerosafe.plan.model import Plan
from zerosafe.records import RecordError
from zerosafe.stages.manifest import (
    MANIFEST_FORMAT,
    Checks,
    IndexEntry,
    LowpCheck,
    LowpCounts,
    Manifest,
    Marker,
    ModelFileEntry,
    PublishedFile,
    ShardEntry,
)
from zerosafe.stages.model_files import (
    check_model_files_outside,
    copy_model_files,
    find_model_files,
    model_files_folder,
    write_generated_config,
)
from zerosafe.stages.results import MergeResult, RunStats, VerifyResult

__all__ = [
    "INDEX_NAME",
    "MANIFEST_NAME",
    "MARKER_NAME",
    "WORK_DIR_NAME",
    "RECORDED",
    "OutputState",
    "changed_files",
    "clear_output",
    "discard_failed_work",
    "finish_work",
    "pending_url",
    "reusable_shard",
    "reusable_shards",
    "shard_location",
    "default_work_url",
    "inspect_output",
    "lacks_file_sha256",
    "prepare_output",
    "publish",
    "read_complete_manifest",
    "OUTPUT_JSON_MAX_BYTES",
]

log = logging.getLogger(__name__)

INDEX_NAME = "model.safetensors.index.json"
MANIFEST_NAME = "zerosafe-manifest.json"
MARKER_NAME = "zerosafe-complete.json"
WORK_DIR_NAME = ".zerosafe-work"
OUTPUT_JSON_MAX_BYTES = 2**30
"""Cap of the manifest and the index when read back (`Storage.read_small`): both hold an entry
per tensor (the manifest's, with its checksum, about 300 bytes), so a million tensors fit in a
third of it; a file beyond it is not one zerosafe wrote."""


def default_work_url(out_url: str, job_key: str) -> str:
    """Where a job keeps its plan and intermediates unless told otherwise."""
    return join_url(out_url, WORK_DIR_NAME, job_key[:16])


PREVIOUS_MANIFEST_NAME = "previous-manifest.json"


def pending_url(out_url: str, job_key: str) -> str:
    """Where a job writes its output shards until publish moves them to their final names.

    Always inside the output folder (whatever `--work-dir` says), so the move is a rename on
    the same filesystem. Shards at the final names therefore only ever come from a verified
    publish: a failed or killed run leaves nothing there that looks like output.
    """
    return join_url(out_url, WORK_DIR_NAME, job_key[:16], "pending")


def shard_location(storage: Storage, out_url: str, job_key: str, file_name: str) -> str:
    """The shard a job's verify and publish use: the pending copy if there is one, else the
    published one (an intact shard kept by a repair, or one moved by an interrupted publish)."""
    pending = join_url(pending_url(out_url, job_key), file_name)
    return pending if storage.exists(pending) else join_url(out_url, file_name)


def _file_changed(storage: Storage, out_url: str, entry: PublishedFile) -> str | None:
    """Why a file the manifest names is not as published (None if it is)."""
    url = join_url(out_url, entry.file)
    if not storage.exists(url):
        return "missing"
    ident = storage.identity(url)
    if ident.size_bytes != entry.size_bytes:
        return f"{ident.size_bytes} bytes, published {entry.size_bytes}"
    if entry.version is not None and ident.version != entry.version:
        return "modified after publishing"
    return None


class _Recorded:
    """The model-files folder a manifest records, for callers that do not know the run's."""


RECORDED = _Recorded()


def changed_files(
    storage: Storage,
    out_url: str,
    manifest: Manifest,
    *,
    model_files_from: str | None | _Recorded = RECORDED,
) -> dict[str, str]:
    """Files of a complete output that are missing or changed since publish: name -> why.

    Checked from file stats alone (size, and mtime or ETag where the manifest has it), plus
    a listing of the folder model files are copied from (`model_files_from`: this run's,
    None when it copies none; by default the one the manifest records).
    """
    out: dict[str, str] = {}
    published: list[PublishedFile] = [*manifest.files]
    for entry in published + ([manifest.index] if manifest.index is not None else []):
        why = _file_changed(storage, out_url, entry)
        if why is not None:
            out[entry.file] = why
    out.update(_changed_model_files(storage, out_url, manifest, model_files_from))
    return out


def _changed_model_files(
    storage: Storage, out_url: str, manifest: Manifest, wanted: str | None | _Recorded
) -> dict[str, str]:
    """Copied model files that are missing or changed in the output or in the folder they
    were copied from, or new there (an output converted before they were copied included),
    or all of them when this run copies from another folder: name -> why. A source file
    removed since is not a change: its copy stays."""
    recorded = manifest.model_files_from
    folder = recorded if isinstance(wanted, _Recorded) else wanted
    entries = manifest.model_files
    adapter = bool(manifest.options.get("adapter"))
    new = find_model_files(storage, folder, adapter=adapter) if folder is not None else []
    if folder != recorded:
        stale = {e.file: f"copied from {recorded}; not wanted now" for e in entries}
        return {**stale, **{n: f"to copy from {folder}" for n in new}}
    out: dict[str, str] = {}
    for entry in entries:
        why = _file_changed(storage, out_url, entry)
        src = entry.source
        if why is None and src is not None and storage.exists(src):
            ident = storage.identity(src)
            if (ident.size_bytes, ident.version) != (entry.source_size_bytes, entry.source_version):
                why = f"{src} changed since it was copied"
        if why is not None:
            out[entry.file] = why
    copied = {e.file for e in entries}
    out.update({n: f"in {folder}, not copied yet" for n in new if n not in copied})
    return out


def _previous_manifest(storage: Storage, out_url: str, job_key: str) -> Manifest | None:
    """In a repair: the manifest the output was published with (None outside a repair)."""
    url = join_url(pending_url(out_url, job_key), PREVIOUS_MANIFEST_NAME)
    if not storage.exists(url):
        return None
    try:  # a RecordError is a ValueError
        return Manifest.from_json(
            json.loads(
                storage.read_small(
                    url, limit_bytes=OUTPUT_JSON_MAX_BYTES, what="a zerosafe manifest"
                )
            )
        )
    except ValueError:
        return None


def _reused(
    storage: Storage, out_url: str, manifest: Manifest, shard: int, file_name: str
) -> MergeResult | None:
    """The merge result of published shard `file_name` rebuilt from `manifest`, if the file
    is still as published; else None."""
    try:
        entry = next(f for f in manifest.files if f.file == file_name)
        tensors = {
            name: {k: v for k, v in info.items() if k not in ("file", "role")}
            for name, info in manifest.tensors.items()
            if info["file"] == file_name
        }
    except (KeyError, TypeError, StopIteration):
        return None
    if _file_changed(storage, out_url, entry) is not None:
        return None
    return MergeResult(
        shard=shard,
        file=file_name,
        file_bytes=entry.size_bytes,
        data_bytes=entry.data_bytes,
        bytes_read=0,
        tensors=tensors,
        ledger={},
        seconds=0.0,
        reused=True,
    )


def reusable_shard(
    storage: Storage, out_url: str, job_key: str, shard: int, file_name: str
) -> MergeResult | None:
    """In a repair: the merge result of a published shard that is still intact, rebuilt from
    the manifest it was published with (nothing is read from the checkpoint). None when the
    shard must be merged again."""
    manifest = _previous_manifest(storage, out_url, job_key)
    return None if manifest is None else _reused(storage, out_url, manifest, shard, file_name)


def reusable_shards(storage: Storage, out_url: str, plan: Plan) -> set[int]:
    """In a repair: the shards that are published and still intact, so neither their merge
    nor the extracts only they need have to run. Empty outside a repair."""
    manifest = _previous_manifest(storage, out_url, plan.job_key)
    if manifest is None:
        return set()
    return {
        s.index
        for s in plan.shards
        if _reused(storage, out_url, manifest, s.index, s.file_name) is not None
    }


def discard_failed_work(storage: Storage, out_url: str, job_key: str, work_url: str) -> None:
    """After a failed check: drop what the run read and wrote (intermediates, cached task
    results and unit records, pending shards), so the next run reads the source again instead of reusing what
    was read from a file that was corrupt then and may be fixed now. The plan and, in a
    repair, the manifest the intact shards were published with stay: the next run is a resume
    of the same job, not a stranger's leftovers."""
    storage.remove_tree(join_url(work_url, "results"))  # the flow's cached task results
    storage.remove_tree(join_url(work_url, "units"))  # the in-process driver's unit records
    storage.remove_tree(join_url(work_url, "intermediate"))
    pending = pending_url(out_url, job_key)
    for name in storage.listdir(pending):
        if name != PREVIOUS_MANIFEST_NAME:
            storage.remove(join_url(pending, name))


def _remove_if_empty(storage: Storage, url: str) -> None:
    if is_local(url) and storage.isdir(url) and not storage.listdir(url):
        storage.remove_tree(url)


def finish_work(storage: Storage, out_url: str, job_key: str, work_url: str, *, keep: bool) -> None:
    """After a publish: remove the job's work files (unless `keep`) and empty folders."""
    storage.remove_tree(pending_url(out_url, job_key))
    if not keep:
        storage.remove_tree(work_url)
    _remove_if_empty(storage, join_url(out_url, WORK_DIR_NAME, job_key[:16]))
    _remove_if_empty(storage, join_url(out_url, WORK_DIR_NAME))


def _is_model_file(name: str) -> bool:
    return name in (INDEX_NAME, ADAPTER_WEIGHTS_NAME) or (
        name.startswith("model") and name.endswith(".safetensors")
    )


@dataclass(frozen=True, slots=True)
class OutputState:
    kind: str
    """`empty`, `done` (complete, same job), `repair` (complete, same job, but published files
    are missing or changed), `other` (complete, another job), `partial` (unfinished run of
    this job), `foreign` (model files without a marker, not this job's), `unusable` (a
    completion marker without a usable manifest)."""
    detail: str = ""
    manifest: Manifest | None = None


_REDO = "pass --overwrite to convert into the folder again, or remove it"


def read_complete_manifest(storage: Storage, out_url: str) -> Manifest | None:
    """The manifest of a complete output (marker present and vouching for it), else None."""
    marker_url = join_url(out_url, MARKER_NAME)
    if not storage.exists(marker_url):
        return None
    raw = storage.read_small(
        marker_url, limit_bytes=JSON_MAX_BYTES, what="a zerosafe completion marker", fix=_REDO
    )
    try:
        marker = Marker.from_json(json.loads(raw))
    except ValueError as e:
        raise OutputExistsError(
            f"{marker_url}: expected a zerosafe completion marker (JSON), found unreadable "
            f"content ({e}). The output cannot be trusted: pass --overwrite to convert into it "
            "again, or remove the folder."
        ) from e
    manifest_url = join_url(out_url, MANIFEST_NAME)
    if not storage.exists(manifest_url):
        raise OutputExistsError(
            f"{manifest_url}: missing, but {MARKER_NAME} says the output is complete; without "
            "the manifest its checksums cannot be checked. Pass --overwrite to convert into it "
            "again, or remove the folder."
        )
    raw = storage.read_small(
        manifest_url, limit_bytes=OUTPUT_JSON_MAX_BYTES, what="a zerosafe manifest", fix=_REDO
    )
    if hashlib.sha256(raw).hexdigest() != marker.manifest_sha256:
        log.warning(
            "%s: the completion marker does not match the manifest; treating as incomplete", out_url
        )
        return None
    try:
        manifest = json.loads(raw)
    except ValueError as e:  # vouched for by the marker's hash, yet not JSON: not ours
        raise OutputExistsError(
            f"{manifest_url}: not valid JSON ({e}). Pass --overwrite to convert into it again."
        ) from e
    try:
        return Manifest.from_json(manifest)
    except RecordError as e:  # vouched for, yet not a manifest this version reads
        raise OutputExistsError(
            f"{manifest_url}: not a zerosafe manifest ({e}). Pass --overwrite to convert into "
            "it again."
        ) from e


def quick_done(
    storage: Storage, ckpt_url: str, tag: str | None, out_url: str, options: ConvertOptions
) -> str | None:
    """The job key if `out_url` already holds this exact conversion, checked from file stats
    alone (no checkpoint byte is read); None otherwise or when unsure.

    Raises:
        ConfigError: If `options.model_files` is `out_url` or inside it: the first check of
            every conversion, so it is refused before anything is read or planned.
    """
    from zerosafe.formats.registry import quick_identities
    from zerosafe.plan.model import job_key_of

    if options.model_files is not None:
        check_model_files_outside(options.model_files, out_url)
    if options.overwrite or not storage.exists(join_url(out_url, MARKER_NAME)):
        return None
    try:
        manifest = read_complete_manifest(storage, out_url)
        resolved_tag, identities = quick_identities(storage, ckpt_url, tag)
    except Exception:  # anything odd: take the full path, which reports it properly
        return None
    key = job_key_of(resolved_tag, identities, options)
    if manifest is None or manifest.job_key != key:
        return None
    wanted = model_files_folder(manifest.source, options)
    changed = changed_files(storage, out_url, manifest, model_files_from=wanted)
    if changed:  # not a no-op: the full path repairs these shards
        log.warning("%s: published files changed: %s", out_url, changed)
        return None
    if options.file_sha256 and lacks_file_sha256(manifest):  # the full path re-verifies
        return None
    return key


def lacks_file_sha256(manifest: Manifest) -> bool:
    """Whether a manifest lacks the whole-file SHA-256 of some weight file (converted without
    `file_sha256`, or by a version before it)."""
    return any(f.sha256 is None for f in manifest.files)


_NO_FILE_SHA256 = (
    "no whole-file SHA-256 recorded; verifying the published files again to record it "
    "(nothing is converted again)"
)


def inspect_output(
    storage: Storage,
    out_url: str,
    job_key: str,
    *,
    model_files_from: str | None | _Recorded = RECORDED,
    file_sha256: bool = False,
) -> OutputState:
    """Classify what `out_url` holds relative to the job `job_key`, which copies model files
    from `model_files_from` (`model_files_folder`; by default as the output records) and,
    with `file_sha256`, records each weight file's SHA-256: a complete output of this job
    without them is a repair that keeps every shard and only verifies it again."""
    names = storage.listdir(out_url)
    if MARKER_NAME in names:
        try:
            manifest = read_complete_manifest(storage, out_url)
        except OutputExistsError as e:
            return OutputState("unusable", str(e))
        if manifest is not None:
            if manifest.job_key == job_key:
                changed = changed_files(
                    storage, out_url, manifest, model_files_from=model_files_from
                )
                if changed:
                    detail = ", ".join(f"{f} ({why})" for f, why in sorted(changed.items()))
                    return OutputState("repair", detail, manifest)
                if file_sha256 and lacks_file_sha256(manifest):
                    return OutputState("repair", _NO_FILE_SHA256, manifest)
                return OutputState("done", manifest=manifest)
            src = manifest.source
            return OutputState(
                "other",
                f"a complete conversion of {src.checkpoint if src else None} "
                f"(tag {src.tag if src else None}) with options {manifest.options}",
                manifest,
            )
    work = default_work_url(out_url, job_key)
    if storage.exists(join_url(work, "plan", "plan.json")):
        return OutputState("partial")
    model_files = [n for n in names if _is_model_file(n) or n in (MANIFEST_NAME, MARKER_NAME)]
    for other in storage.listdir(join_url(out_url, WORK_DIR_NAME)):
        if other == job_key[:16]:
            continue
        pending = storage.listdir(join_url(out_url, WORK_DIR_NAME, other, "pending"))
        model_files += [
            f"{WORK_DIR_NAME}/{other}/pending/{n}" for n in pending if _is_model_file(n)
        ]
    if model_files:
        return OutputState(
            "foreign", f"model files not written by this job: {', '.join(model_files[:5])}"
        )
    return OutputState("empty")


def _copied_model_files(storage: Storage, out_url: str) -> list[str]:
    """The model files a previous conversion's manifest says it copied (none if unreadable)."""
    url = join_url(out_url, MANIFEST_NAME)
    try:
        raw = (
            storage.read_small(url, limit_bytes=OUTPUT_JSON_MAX_BYTES, what="a zerosafe manifest")
            if storage.exists(url)
            else b"{}"
        )
        return [e.file for e in Manifest.from_json(json.loads(raw)).model_files]
    except ValueError:  # a RecordError too
        return []


def clear_output(storage: Storage, out_url: str) -> None:
    """Remove a previous conversion: the marker first, so nothing looks complete meanwhile."""
    storage.remove(join_url(out_url, MARKER_NAME))
    _remove_files(storage, out_url, _copied_model_files(storage, out_url))
    for name in storage.listdir(out_url):
        if _is_model_file(name) or name == MANIFEST_NAME:
            storage.remove(join_url(out_url, name))
    storage.remove_tree(join_url(out_url, WORK_DIR_NAME))


def prepare_output(
    storage: Storage,
    out_url: str,
    job_key: str,
    *,
    overwrite: bool,
    model_files_from: str | None | _Recorded = RECORDED,
    file_sha256: bool = False,
) -> OutputState:
    """Decide whether to convert into `out_url`; clears it when `overwrite` says to. A
    complete output of this job whose model files are not those of `model_files_from` (see
    `inspect_output`) is repaired: only the copies are redone. So is one lacking the
    whole-file SHA-256 when `file_sha256` asks for it: every shard is kept and verified again.

    Returns:
        The state found: `done` means there is nothing to do.

    Raises:
        OutputExistsError: If the folder holds another conversion and `overwrite` is off.
        ConfigError: If `model_files_from` is `out_url` or inside it (checked first, before
            anything is removed).
    """
    if isinstance(model_files_from, str):
        check_model_files_outside(model_files_from, out_url)
    state = inspect_output(
        storage, out_url, job_key, model_files_from=model_files_from, file_sha256=file_sha256
    )
    if state.kind == "unusable" and not overwrite:
        raise OutputExistsError(state.detail)
    if state.kind in ("other", "foreign", "unusable"):
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
    if state.kind == "repair":
        _start_repair(storage, out_url, job_key, state, model_files_from)
        return OutputState("partial", state.detail)
    return state


def _start_repair(
    storage: Storage,
    out_url: str,
    job_key: str,
    state: OutputState,
    model_files_from: str | None | _Recorded,
) -> None:
    """Take a complete output whose files changed back to an unfinished one: keep the
    manifest it was published with (intact shards are reused from it), remove the marker
    first, then the index, the manifest and the changed files."""
    assert state.manifest is not None
    if state.detail == _NO_FILE_SHA256:
        log.warning("%s: %s", out_url, state.detail)
    else:
        log.warning("%s: published files changed (%s); merging them again", out_url, state.detail)
    storage.write_bytes(
        join_url(pending_url(out_url, job_key), PREVIOUS_MANIFEST_NAME),
        json.dumps(state.manifest.to_json()).encode(),
    )
    storage.remove(join_url(out_url, MARKER_NAME))
    storage.remove(join_url(out_url, INDEX_NAME))
    storage.remove(join_url(out_url, MANIFEST_NAME))
    changed = changed_files(storage, out_url, state.manifest, model_files_from=model_files_from)
    _remove_files(storage, out_url, list(changed))


def _remove_files(storage: Storage, out_url: str, names: list[str]) -> None:
    """Remove output files by name, and a folder a name was in (chat templates) left empty."""
    for name in names:
        storage.remove(join_url(out_url, name))
    for folder in {n.rsplit("/", 1)[0] for n in names if "/" in n}:
        _remove_if_empty(storage, join_url(out_url, folder))


def _checks(verifies: Sequence[VerifyResult], lowp: LowpCheck | None) -> Checks:
    """What verification covered, for the manifest."""
    counts = None
    if lowp is not None:
        counts = LowpCounts(
            lowp_checked=lowp.lowp_checked,
            lowp_mismatched=lowp.lowp_mismatched,
            lowp_skipped=lowp.lowp_skipped,
        )
    return Checks(verified_tensors=sum(v.num_tensors for v in verifies), lowp_cross_check=counts)


def _file_sha256(
    verifies: Sequence[VerifyResult], merges: Sequence[MergeResult], *, wanted: bool
) -> dict[str, str]:
    """Each shard's whole-file SHA-256 as its verify computed it (`file_sha256`): file -> hex
    digest; empty when not asked for."""
    if not wanted:
        return {}
    sums = {v.file: v.sha256 for v in verifies if v.sha256 is not None}
    missing = [m.file for m in merges if m.file not in sums]
    # Verify results are cached with `file_sha256` in their key, so each one has its sum.
    assert not missing, f"verify computed no file SHA-256 for {missing}"
    return sums


def _stage_model_files(
    plan: Plan, storage: Storage, pending: str, options: ConvertOptions
) -> list[ModelFileEntry]:
    """Copy the job's model files (config, tokenizer) into the pending folder, for publish to
    move into place with the shards; their manifest entries."""
    folder = model_files_folder(plan.source, options)
    if folder is None:
        return []
    entries = copy_model_files(
        storage,
        folder,
        find_model_files(storage, folder, adapter=options.adapter),
        pending,
        chunk_bytes=options.chunk_bytes,
        config_update=(
            {"quantization_config": plan.quantization} if plan.quantization is not None else None
        ),
    )
    config = plan.source.model_config
    if config is not None and not options.adapter and "config.json" not in _names(entries):
        if plan.quantization is not None:
            config = {**config, "quantization_config": plan.quantization}
        entries.append(write_generated_config(storage, config, pending, dtype=options.dtype))
    return entries


def _names(entries: Sequence[ModelFileEntry]) -> set[str]:
    return {e.file for e in entries}


def _published_model_files(
    storage: Storage, out_url: str, entries: list[ModelFileEntry]
) -> tuple[ModelFileEntry, ...]:
    """The entries with each copy's size and version as published.

    Raises:
        VerificationError: If a copy did not arrive whole.
    """
    out = []
    for entry in entries:
        ident = storage.identity(join_url(out_url, entry.file))
        if ident.size_bytes != entry.size_bytes:
            raise VerificationError(
                f"{ident.url}: {ident.size_bytes} bytes after moving it into place, expected "
                f"{entry.size_bytes}; the output was not marked complete. Run the same "
                "command again.",
                [],
            )
        out.append(replace(entry, version=ident.version))
    return tuple(out)


def _move_into_place(
    storage: Storage,
    out_url: str,
    job_key: str,
    merges: Sequence[MergeResult],
    model_files: Sequence[ModelFileEntry] = (),
) -> dict[str, FileIdentity]:
    """Rename the pending shards and copied model files to their final names; returns each
    shard's identity.

    Raises:
        VerificationError: If a shard in place does not have the size its merge wrote.
    """
    pending = pending_url(out_url, job_key)
    for name in [m.file for m in merges] + [e.file for e in model_files]:
        src = join_url(pending, name)
        if storage.exists(src):
            if is_local(out_url) and "/" in name:
                storage.makedirs(join_url(out_url, name.rsplit("/", 1)[0]))
            storage.rename(src, join_url(out_url, name))
    versions = {m.file: storage.identity(join_url(out_url, m.file)) for m in merges}
    for m in merges:
        if versions[m.file].size_bytes != m.file_bytes:
            raise VerificationError(
                f"{join_url(out_url, m.file)}: {versions[m.file].size_bytes} bytes after "
                f"moving it into place, expected {m.file_bytes}; the output was not marked "
                "complete. Run the same command again.",
                [],
            )
    return versions


def _refuse_failures(
    out_url: str, verifies: Sequence[VerifyResult], lowp: LowpCheck | None
) -> None:
    """Raise `VerificationError` naming the first failures, if any check failed."""
    failures = [f for v in verifies for f in v.failures]
    failures += lowp.failures if lowp is not None else ()
    if failures:
        lines = [f"{f['file']}: {f['tensor']}: {f['check']}: {f['detail']}" for f in failures[:20]]
        raise VerificationError(
            f"{out_url}: {len(failures)} check(s) failed; the output was not marked complete:\n  "
            + "\n  ".join(lines),
            failures,
        )


def _write_index(
    plan: Plan, storage: Storage, out_url: str, by_shard: Sequence[MergeResult], total_size: int
) -> IndexEntry | None:
    """Write `model.safetensors.index.json` when there are several shards; returns its
    manifest entry (None for one shard: no index)."""
    if len(plan.shards) <= 1:
        return None
    weight_map = {name: m.file for m in by_shard for name in m.tensors}
    index: dict[str, Any] = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    if plan.aliases:
        index["metadata"]["aliases"] = plan.aliases
    storage.write_bytes(
        join_url(out_url, INDEX_NAME), (json.dumps(index, indent=2) + "\n").encode()
    )
    written = storage.identity(join_url(out_url, INDEX_NAME))
    return IndexEntry(file=INDEX_NAME, size_bytes=written.size_bytes, version=written.version)


def publish(
    plan: Plan,
    storage: Storage,
    out_url: str,
    *,
    options: ConvertOptions,
    merges: Sequence[MergeResult],
    verifies: Sequence[VerifyResult],
    integrity: IntegrityReport,
    stats: RunStats | None = None,
    lowp: LowpCheck | None = None,
) -> Manifest:
    """Move the verified shards and the copied model files into place, write the index and
    the manifest, then the completion marker, last.

    Args:
        lowp: The optional 16-bit cross-check (`zerosafe.verify.output.lowp_report`).

    Returns:
        The manifest written.

    Raises:
        VerificationError: If any shard failed verification; then nothing is written.
    """
    _refuse_failures(out_url, verifies, lowp)
    by_shard = sorted(merges, key=lambda m: m.shard)
    if [m.shard for m in by_shard] != list(range(len(plan.shards))):
        raise AssertionError("publish needs one merge result per shard")
    file_sha256 = _file_sha256(verifies, by_shard, wanted=options.file_sha256)
    model_files = _stage_model_files(plan, storage, pending_url(out_url, plan.job_key), options)
    versions = _move_into_place(storage, out_url, plan.job_key, by_shard, model_files)
    total_size = sum(m.data_bytes for m in by_shard)
    index_entry = _write_index(plan, storage, out_url, by_shard, total_size)
    roles = {t.name: t.role for t in plan.tensors}
    manifest = Manifest(
        manifest_format=MANIFEST_FORMAT,
        zerosafe_version=__version__,
        job_key=plan.job_key,
        created_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        source=plan.source,
        options={**options.identity(), "direct": options.direct},
        keep_work=options.keep_work,
        files=tuple(
            ShardEntry(
                file=m.file,
                size_bytes=m.file_bytes,
                data_bytes=m.data_bytes,
                version=versions[m.file].version,
                sha256=file_sha256.get(m.file),
            )
            for m in by_shard
        ),  # fmt: skip
        total_size=total_size,
        index=index_entry,
        tensors={
            name: {**info, "file": m.file, "role": roles.get(name, "param")}
            for m in by_shard
            for name, info in m.tensors.items()
        },
        aliases=plan.aliases,
        model_files_from=model_files_folder(plan.source, options),
        model_files=_published_model_files(storage, out_url, model_files),
        integrity=integrity,
        checks=_checks(verifies, lowp),
        notes=tuple(plan.notes),
        warnings=tuple(plan.warnings),
        stats=stats,
    )
    raw = (json.dumps(manifest.to_json(), indent=1) + "\n").encode()
    storage.write_bytes(join_url(out_url, MANIFEST_NAME), raw)
    marker = Marker(
        job_key=plan.job_key,
        manifest_sha256=hashlib.sha256(raw).hexdigest(),
        completed_at=manifest.created_at,
        zerosafe_version=__version__,
    )
    storage.write_bytes(
        join_url(out_url, MARKER_NAME), (json.dumps(marker.to_json(), indent=1) + "\n").encode()
    )
    return manifest
