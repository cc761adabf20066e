"""`zerosafe verify OUT_DIR [--against CKPT_DIR]`: check a whole Hugging Face style output.

Works on any safetensors output (zerosafe's, DeepSpeed's, transformers'): every file's header
and data region, the index (every file and tensor exactly once, `total_size`), finiteness, the
manifest's checksums when there is one (per tensor, and each weight file's whole-file SHA-256
where it records one), the model files it copied (config, tokenizer: size and SHA-256), tied
aliases; and with `--against`, coverage of the
source checkpoint (params, frozen params, buffers, aliases; shapes) and, for ZeRO-1/2, that
each fp32 tensor cast to the training dtype equals the 16-bit weight DeepSpeed saved beside
it, a witness that owes nothing to the fp32 partitions.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from zerosafe.cast import cast_bytes
from zerosafe.dtypes import dtype_info
from zerosafe.errors import CheckpointFormatError, ConversionError
from zerosafe.io.lease import DESTINATION_LEASE_NAME
from zerosafe.io.storage import Storage, join_url, normalize_url
from zerosafe.plan.adapter import ADAPTER_WEIGHTS_NAME, adapter_layout, read_adapter_config
from zerosafe.stages.model_files import sha256_of
from zerosafe.stages.output import (
    INDEX_NAME,
    MANIFEST_NAME,
    MARKER_NAME,
    OUTPUT_JSON_MAX_BYTES,
    WORK_DIR_NAME,
    read_complete_manifest,
    shard_location,
)
from zerosafe.verify.quantized import (
    as_checkpoint_names,
    check_scheme,
    quantized_report,
)
from zerosafe.verify.source import sample_values
from zerosafe.verify.tensors import Failure, parse_safetensors_header, verify_shard

if TYPE_CHECKING:
    from zerosafe.formats.base import LowpCopy, LowpWitness, SourceDescription, SourceLayout
    from zerosafe.stages.results import MergeResult

__all__ = ["render_verify", "verify_output"]

log = logging.getLogger(__name__)

_SHARD_RE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")


def _load_json(storage: Storage, url: str) -> Any:
    """The output's index or manifest, parsed."""
    raw = storage.read_small(
        url,
        limit_bytes=OUTPUT_JSON_MAX_BYTES,
        what="JSON written by zerosafe",
        fix="convert into the folder again (--overwrite)",
    )
    try:
        return json.loads(raw)
    except ValueError as e:
        raise CheckpointFormatError(f"{url}: not valid JSON: {e}") from e


def verify_output(
    out_url: str,
    *,
    against: str | None = None,
    tag: str | None = None,
    allow_nonfinite: bool = False,
    storage: Storage | None = None,
    chunk_bytes: int = 16 * 2**20,
    max_workers: int = 2,
) -> dict[str, Any]:
    """Check an output folder; returns a report with `ok` and a list of `failures`.

    The steps: the folder's files (an index with its shards, or one `model.safetensors`), the
    manifest and completion marker, the model files it copied, every file's header and data against its checksums,
    where each tensor is stored, tied aliases, and with `against` the checkpoint itself.

    Raises:
        CheckpointFormatError: If there is no safetensors output to check at all.
    """
    storage = storage or Storage()
    out_url = normalize_url(out_url)
    names = _output_names(storage, out_url)
    failures: list[Failure] = []
    unfinished = _unfinished_work(names)
    if unfinished and MARKER_NAME not in names:
        failures.append(
            Failure(
                MARKER_NAME,
                "*",
                "complete",
                f"incomplete conversion: zerosafe work files ({', '.join(unfinished)}) but no "
                "completion marker; run the same `zerosafe convert` again to finish it",
            )  # fmt: skip
        )
        if not {INDEX_NAME, "model.safetensors", ADAPTER_WEIGHTS_NAME} & set(names):
            return _report(out_url, failures, complete=False)
    files, index = _weight_files(storage, out_url, names, failures)
    weight_map = index.get("weight_map") if index is not None else None
    manifest, complete = _read_manifest(storage, out_url, names, failures)
    if manifest is not None:
        failures.extend(_check_model_files(storage, out_url, manifest))
    reports = _verify_files(
        storage, out_url, files, manifest, failures,
        allow_nonfinite=allow_nonfinite, chunk_bytes=chunk_bytes, max_workers=max_workers,
    )  # fmt: skip
    where = _check_placement(reports, files, weight_map, index, failures)
    aliases = _collect_aliases(manifest, reports, index, where, failures)
    against_report = None
    if against is not None:
        against_report = _check_against(
            storage, out_url, against, tag, reports, aliases, failures, chunk_bytes,
            recorded_options=(manifest or {}).get("options") or {},
            source=(manifest or {}).get("source"),
        )  # fmt: skip
    tensors = {t: info for r in reports for t, info in r.tensors.items()}
    quantized = quantized_report([r.quantized for r in reports])
    stored = {t: (r.file, info) for r in reports for t, info in r.tensors.items()}
    for file, name, detail in check_scheme(
        storage, out_url, stored, quantized.get("quantized", {})
    ):
        failures.append(Failure(file, name, "quantization", detail))
    return {
        "output": out_url,
        "ok": not failures,
        "files": files,
        "num_tensors": len(tensors),
        "data_bytes": sum(r.bytes_read for r in reports),
        "file_sha256": {r.file: r.sha256 for r in reports if r.sha256 is not None},
        "complete": complete,
        "has_manifest": manifest is not None,
        "aliases": aliases,
        "nonfinite": {
            t: {k: info[k] for k in ("nan", "posinf", "neginf")}
            for t, info in tensors.items()
            if info["nan"] or info["posinf"] or info["neginf"]
        },
        "against": against_report,
        **quantized,
        "failures": [f.as_dict() for f in failures],
    }


def _output_names(storage: Storage, out_url: str) -> list[str]:
    if not storage.isdir(out_url):
        what = "a file" if storage.exists(out_url) else "missing"
        raise CheckpointFormatError(
            f"{out_url}: expected an output folder (model.safetensors or an index with its "
            f"shards), found {what}. Pass the folder `zerosafe convert` wrote."
        )
    return storage.listdir(out_url)


def _weight_files(
    storage: Storage, out_url: str, names: list[str], failures: list[Failure]
) -> tuple[list[str], dict[str, Any] | None]:
    """The weight files to check (those present), and the index if there is one; files the
    index names but lacks, and weight files it does not list, are failures."""
    if INDEX_NAME not in names:
        if "model.safetensors" not in names and ADAPTER_WEIGHTS_NAME in names:
            return [ADAPTER_WEIGHTS_NAME], None  # a PEFT adapter (`convert --adapter`)
        if "model.safetensors" not in names:
            raise CheckpointFormatError(
                f"{out_url}: no {INDEX_NAME}, no model.safetensors and no "
                f"{ADAPTER_WEIGHTS_NAME}; nothing to verify"
            )
        failures.extend(
            Failure(f, "*", "indexed", f"shard file beside model.safetensors but no {INDEX_NAME}")
            for f in names
            if f != "model.safetensors" and _SHARD_RE.match(f)
        )
        return ["model.safetensors"], None
    index = _load_json(storage, join_url(out_url, INDEX_NAME))
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if (
        not isinstance(weight_map, dict)
        or not weight_map
        or not all(isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items())
        or not isinstance(index.get("metadata", {}), dict)
    ):
        raise CheckpointFormatError(
            f"{out_url}/{INDEX_NAME}: not a safetensors index (expected an object with a "
            "non-empty 'weight_map' of tensor name -> file name, and an object 'metadata')"
        )
    files = sorted(set(weight_map.values()))
    failures.extend(
        Failure(f, "*", "present", f"named in {INDEX_NAME} but missing")
        for f in files
        if f not in names
    )
    for f in names:
        if _is_weights_file(f) and f not in files:
            detail = f"not listed in {INDEX_NAME}"
            if f == "model.safetensors":
                detail += "; loaders read it instead of the index"
            failures.append(Failure(f, "*", "indexed", detail))
    return [f for f in files if f in names], index


def _read_manifest(
    storage: Storage, out_url: str, names: list[str], failures: list[Failure]
) -> tuple[dict[str, Any] | None, bool | None]:
    """`(manifest, complete)`: zerosafe's manifest if there is one, and whether the completion
    marker vouches for it (None when there is no manifest)."""
    if MANIFEST_NAME not in names:
        if MARKER_NAME in names:
            failures.append(
                Failure(
                    MANIFEST_NAME, "*", "complete",
                    "completion marker present but the manifest is missing; checksums cannot be compared",
                )
            )  # fmt: skip
        return None, None
    manifest = _load_json(storage, join_url(out_url, MANIFEST_NAME))
    if not isinstance(manifest, dict) or not isinstance(manifest.get("tensors", {}), dict):
        raise CheckpointFormatError(f"{out_url}/{MANIFEST_NAME}: not a zerosafe manifest")
    if MARKER_NAME not in names:
        failures.append(
            Failure(
                MARKER_NAME, "*", "complete", "no completion marker: the conversion did not finish"
            )
        )
        return manifest, False
    try:
        vouched = read_complete_manifest(storage, out_url)
    except (ValueError, AttributeError, TypeError, ConversionError) as e:
        failures.append(Failure(MARKER_NAME, "*", "complete", f"completion marker not usable: {e}"))
    else:
        if vouched is None:
            failures.append(
                Failure(
                    MARKER_NAME, "*", "complete",
                    "the completion marker does not match the manifest",
                )
            )  # fmt: skip
    return manifest, True


def _verify_files(
    storage: Storage,
    out_url: str,
    files: list[str],
    manifest: dict[str, Any] | None,
    failures: list[Failure],
    *,
    allow_nonfinite: bool,
    chunk_bytes: int,
    max_workers: int,
) -> list[Any]:
    """Every weight file's header and data, against the manifest's checksums if any: per
    tensor, and the whole file's SHA-256 where the manifest records one (hashed in the same
    re-read)."""
    expected_by_file: dict[str, dict[str, dict[str, Any]]] = {}
    file_sha256: dict[str, str] = {}
    if manifest is not None:
        for name, info in manifest.get("tensors", {}).items():
            expected_by_file.setdefault(info["file"], {})[name] = info
        file_sha256 = _recorded_file_sha256(manifest)
    with ThreadPoolExecutor(max_workers=max_workers) as pool:
        reports = list(
            pool.map(
                lambda f: verify_shard(
                    storage,
                    join_url(out_url, f),
                    expected=expected_by_file.get(f, {}) if manifest is not None else None,
                    allow_nonfinite=allow_nonfinite,
                    chunk_bytes=chunk_bytes,
                    file_sha256=f in file_sha256,
                ),  # fmt: skip
                files,
            )
        )
    for r in reports:
        failures.extend(r.failures)
        want = file_sha256.get(r.file)
        if want is not None and r.sha256 is not None and r.sha256 != want:
            failures.append(
                Failure(
                    r.file, "*", "sha256",
                    f"whole-file SHA-256 {r.sha256[:16]}..., recorded {want[:16]}...: the file "
                    "changed since it was published (convert again to repair it)",
                )
            )  # fmt: skip
    for f, tensors in expected_by_file.items():
        if f not in files:
            failures.extend(
                Failure(f, t, "present", f"in {MANIFEST_NAME} but its file is not in the output")
                for t in sorted(tensors)
            )
    return reports


def _recorded_file_sha256(manifest: dict[str, Any]) -> dict[str, str]:
    """Weight file -> the whole-file SHA-256 the manifest records (`--file-sha256`); empty
    for manifests without them."""
    entries = manifest.get("files")
    if not isinstance(entries, list):
        return {}
    return {
        str(e["file"]): e["sha256"]
        for e in entries
        if isinstance(e, dict) and isinstance(e.get("sha256"), str)
    }


def _check_placement(
    reports: list[Any],
    files: list[str],
    weight_map: dict[str, str] | None,
    index: dict[str, Any] | None,
    failures: list[Failure],
) -> dict[str, list[str]]:
    """Each tensor in one file, the one the index names; the index's total size. Returns
    tensor -> the files holding it."""
    where: dict[str, list[str]] = {}
    for r in reports:
        for tensor in r.tensors:
            where.setdefault(tensor, []).append(r.file)
    failures.extend(
        Failure(", ".join(in_files), tensor, "unique", f"stored in {len(in_files)} files")
        for tensor, in_files in where.items()
        if len(in_files) > 1
    )
    if weight_map is None:
        return where
    for tensor, f in weight_map.items():
        if f in files and tensor not in where:
            failures.append(
                Failure(f, tensor, "present", f"{INDEX_NAME} maps it here but the file lacks it")
            )
        elif tensor in where and f not in where[tensor]:
            failures.append(
                Failure(f, tensor, "indexed", f"{INDEX_NAME} says {f}, stored in {where[tensor]}")
            )
    failures.extend(
        Failure(in_files[0], tensor, "indexed", f"not listed in {INDEX_NAME}")
        for tensor, in_files in where.items()
        if tensor not in weight_map
    )
    total = sum(
        dtype_info(t["dtype"]).itemsize * math.prod(t["shape"])
        for r in reports
        for t in r.tensors.values()
    )
    declared = (index or {}).get("metadata", {}).get("total_size")
    if declared is not None and int(declared) != total:
        failures.append(
            Failure(
                INDEX_NAME,
                "*",
                "total_size",
                f"metadata.total_size {declared}, tensors hold {total}",
            )
        )
    return where


def _collect_aliases(
    manifest: dict[str, Any] | None,
    reports: list[Any],
    index: dict[str, Any] | None,
    where: dict[str, list[str]],
    failures: list[Failure],
) -> dict[str, str]:
    """Tied aliases from the manifest, the files' `__metadata__` and the index: they must
    agree, point at stored tensors, and stay out of the index's weight map."""
    sources: list[tuple[str, Any]] = []
    if manifest is not None:
        sources.append((MANIFEST_NAME, manifest.get("aliases") or {}))
    for r in reports:
        if "aliases" in r.metadata:
            try:
                sources.append((r.file, json.loads(r.metadata["aliases"])))
            except ValueError:
                failures.append(
                    Failure(r.file, "*", "tied", "__metadata__ 'aliases' is not valid JSON")
                )
    if index is not None:
        sources.append((INDEX_NAME, index.get("metadata", {}).get("aliases") or {}))
    aliases: dict[str, str] = {}
    for origin, mapping in sources:
        if not isinstance(mapping, dict):
            failures.append(Failure(origin, "*", "tied", "aliases must map alias -> target"))
            continue
        for alias, target in mapping.items():
            if alias in aliases and aliases[alias] != target:
                failures.append(
                    Failure(
                        origin, alias, "tied",
                        f"alias of '{target}' here but of '{aliases[alias]}' elsewhere",
                    )
                )  # fmt: skip
                continue
            aliases.setdefault(alias, target)
            if target not in where:
                failures.append(
                    Failure(origin, alias, "tied", f"alias of '{target}', which is not stored")
                )
    weight_map = (index or {}).get("weight_map") or {}
    failures.extend(
        Failure(
            INDEX_NAME, alias, "tied", f"alias listed in {INDEX_NAME}; loaders would look for it"
        )
        for alias in aliases
        if alias in weight_map
    )
    return aliases


def _check_model_files(storage: Storage, out_url: str, manifest: dict[str, Any]) -> list[Failure]:
    """The model files the manifest says were copied (config, tokenizer): each present, with
    the size and SHA-256 it was copied with."""
    failures = []
    for entry in manifest.get("model_files") or []:
        name = str(entry.get("file"))
        url = join_url(out_url, name)
        if not storage.exists(url):
            failures.append(Failure(name, "*", "model file", f"in {MANIFEST_NAME} but missing"))
            continue
        size_bytes, sha256 = sha256_of(storage, url)  # streamed: a model file may be GBs
        if size_bytes != entry.get("size_bytes"):
            found = f"{size_bytes} bytes, copied as {entry.get('size_bytes')}"
        elif sha256 != entry.get("sha256"):
            found = "its SHA-256 differs from the copy's"
        else:
            continue
        failures.append(
            Failure(
                name,
                "*",
                "model file",
                f"{found} (from {entry.get('source')}): changed after publishing; run the "
                "same `zerosafe convert` again to copy it anew",
            )  # fmt: skip
        )
    return failures


def _unfinished_work(names: list[str]) -> list[str]:
    """The zerosafe work files among a folder's entries (a run's plan, pending shards,
    intermediates or lease)."""
    return [n for n in names if n in (WORK_DIR_NAME, DESTINATION_LEASE_NAME)]


def _report(out_url: str, failures: list[Failure], *, complete: bool | None) -> dict[str, Any]:
    """The report of an output with nothing to check tensor by tensor."""
    return {
        "output": out_url,
        "ok": not failures,
        "files": [],
        "num_tensors": 0,
        "data_bytes": 0,
        "file_sha256": {},
        "complete": complete,
        "has_manifest": False,
        "aliases": {},
        "nonfinite": {},
        "against": None,
        "failures": [f.as_dict() for f in failures],
    }


def _is_weights_file(name: str) -> bool:
    return name.startswith("model") and name.endswith(".safetensors")


def _check_against(
    storage: Storage,
    out_url: str,
    ckpt_url: str,
    tag: str | None,
    reports: list[Any],
    aliases: dict[str, str],
    failures: list[Failure],
    chunk_bytes: int,
    *,
    recorded_options: dict[str, Any],
    source: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Coverage against the checkpoint (any format), its identity (`source`: the manifest's
    record), a sample of values, and DeepSpeed ZeRO-1/2's 16-bit cross-check.

    The output's manifest says how it was converted (`recorded_options`, the job key's
    options): with `exclude_frozen`, frozen params must be absent instead of present; a DCP
    output is checked against the tensors its `select` and `strip_prefix` chose, a Megatron
    one against its names (`keep_names`); a PEFT
    adapter (`adapter`) against the checkpoint's adapter tensors under PEFT's names.
    """
    from zerosafe.config import ConvertOptions
    from zerosafe.formats.registry import read_source

    exclude_frozen = bool(recorded_options.get("exclude_frozen"))
    options = ConvertOptions(
        exclude_frozen=exclude_frozen,
        select=tuple(recorded_options.get("select") or ()),
        strip_prefix=recorded_options.get("strip_prefix"),
        keep_names=bool(recorded_options.get("keep_names")),
    )
    layout = read_source(storage, ckpt_url, tag=tag, options=options)
    if recorded_options.get("adapter"):  # a PEFT adapter: as its own copied config maps it
        config = read_adapter_config(storage, out_url)
        layout = adapter_layout(layout, config, config_url=out_url)
    stored = {t: (r.file, info) for r in reports for t, info in r.tensors.items()}
    expected = _check_coverage(layout, stored, aliases, failures, exclude_frozen=exclude_frozen)
    content = layout.source.content_sha256
    recorded = (source or {}).get("content_sha256")
    if recorded is not None and recorded != content:
        failures.append(
            Failure(
                MANIFEST_NAME,
                "*",
                "source",
                f"converted from {(source or {}).get('checkpoint')} (tag {(source or {}).get('tag')}) "
                f"whose contents differ from {layout.source.checkpoint} (tag {layout.tag}): "
                "another checkpoint, another step, or files changed since",
            )  # fmt: skip
        )
    sampled = sample_values(storage, out_url, layout, stored, failures)
    witness = lowp_witness(storage, layout.source, layout=layout)
    if witness is not None:
        checked, mismatched, skipped_why = lowp_cross_check(
            out_url, witness, stored, failures, chunk_bytes, storage=storage
        )
    else:
        checked, mismatched, skipped_why = 0, 0, f"{layout.format} keeps no 16-bit copy"
    return {
        "checkpoint": layout.source.checkpoint,
        "tag": layout.tag,
        "source_identity": _identity_word(recorded, content or ""),
        "values_sampled": sampled,
        "expected_tensors": len(expected),
        "lowp_checked": checked,
        "lowp_mismatched": mismatched,
        "lowp_skipped": skipped_why,
    }


def _check_coverage(
    layout: SourceLayout,
    stored: dict[str, tuple[str, dict[str, Any]]],
    aliases: dict[str, str],
    failures: list[Failure],
    *,
    exclude_frozen: bool,
) -> dict[str, tuple[int, ...]]:
    """Every tensor of the checkpoint stored with its shape (or recorded as a tied alias),
    nothing else stored (NVFP4 `_packed` weights by their checkpoint names, quantized
    weights' scales aside). Returns the tensors expected in the output."""
    stored = as_checkpoint_names(stored)
    expected: dict[str, tuple[int, ...]] = {}
    for name, tensor in layout.tensors.items():
        if tensor.role != "frozen" or not exclude_frozen:
            expected[name] = tensor.shape
        elif name in stored:
            failures.append(
                Failure(
                    stored[name][0], name, "coverage",
                    "frozen param stored, but the output excludes frozen params",
                )
            )  # fmt: skip
    for name, shape in expected.items():
        if name not in stored:
            failures.append(
                Failure("*", name, "coverage", "in the checkpoint but not in the output")
            )
        elif tuple(stored[name][1]["shape"]) != tuple(shape):
            failures.append(
                Failure(
                    stored[name][0], name, "coverage",
                    f"shape {stored[name][1]['shape']}, checkpoint {list(shape)}",
                )
            )  # fmt: skip
    for alias, target in layout.aliases.items():
        if alias in stored:
            continue  # written as a copy
        if aliases.get(alias) != target:
            failures.append(
                Failure(
                    "*", alias, "coverage",
                    f"tied to '{target}' in the checkpoint; not stored and not recorded as an alias",
                )
            )  # fmt: skip
    for name in stored:
        if name not in expected and name not in layout.aliases:
            failures.append(Failure(stored[name][0], name, "coverage", "not in the checkpoint"))
    return expected


def _identity_word(recorded: str | None, content: str) -> str:
    if recorded is None:
        return "no record in the output"
    return "same contents" if recorded == content else "different"


def lowp_witness(
    storage: Storage, source: SourceDescription, *, layout: SourceLayout | None = None
) -> LowpWitness | None:
    """The checkpoint's 16-bit copies, from its reader's optional `ReadsLowpCopies`
    capability (from `layout` where given, else read again); None for a format that keeps
    none."""
    from zerosafe.formats.base import ReadsLowpCopies
    from zerosafe.formats.registry import detect_format, reader_named

    reader = (
        reader_named(source.format)
        if source.format
        else detect_format(storage, source.checkpoint, source.tag)
    )
    if not isinstance(reader, ReadsLowpCopies):
        return None
    return reader.lowp_witness(storage, source, layout=layout)


def lowp_report(
    storage: Storage,
    source: SourceDescription,
    out_url: str,
    merges: Sequence[MergeResult],
    *,
    job_key: str | None = None,
) -> dict[str, Any]:
    """The 16-bit cross-check of a conversion's output, as a verify-shaped report.

    Args:
        source: The plan's source description (its reader reads the 16-bit copies again).
        merges: The merge summaries (which file holds which tensor, its dtype and shape).
        job_key: The job whose shards are still pending publish (read them there).
    """
    stored = {name: (m.file, info) for m in merges for name, info in m.tensors.items()}
    failures: list[Failure] = []
    witness = lowp_witness(storage, source)
    why: str | None
    if witness is None:
        checked, mismatched, why = 0, 0, f"{source.format} keeps no 16-bit copy"
    else:
        checked, mismatched, why = lowp_cross_check(
            out_url, witness, stored, failures, storage=storage,
            locate=(lambda f: shard_location(storage, out_url, job_key, f)) if job_key else None,
        )  # fmt: skip
    return {
        "file": "*",
        "check": "lowp",
        "lowp_checked": checked,
        "lowp_mismatched": mismatched,
        "lowp_skipped": why,
        "failures": [f.as_dict() for f in failures],
    }


def lowp_cross_check(
    out_url: str,
    witness: LowpWitness,
    stored: dict[str, tuple[str, dict[str, Any]]],
    failures: list[Failure],
    chunk_bytes: int = 16 * 2**20,
    *,
    storage: Storage,
    locate: Callable[[str], str] | None = None,
) -> tuple[int, int, str | None]:
    """Each output tensor cast to a 16-bit copy's dtype must equal that copy (ZeRO-1/2: the
    weights DeepSpeed saved in the model states), a witness independent of the masters.

    Args:
        witness: The checkpoint's 16-bit copies (`lowp_witness`).
        stored: tensor name -> (file, {"dtype", "shape"}) of the output.
        failures: Receives one `lowp` failure per tensor that differs.

    Returns:
        `(checked, mismatched, why_skipped)`; reads the 16-bit copies and the output tensors.
    """
    if witness.missing is not None:
        return 0, 0, witness.missing
    checked = mismatched = 0
    skipped_why = None
    sources: dict[str, Any] = {}
    try:
        for copy in witness.copies:
            if copy.name not in stored:
                continue
            out_dtype = stored[copy.name][1]["dtype"]
            out_numel = math.prod(stored[copy.name][1]["shape"])
            if copy.element_offset + copy.numel > out_numel:
                continue
            if copy.numel != out_numel and not copy.partial:
                continue
            if out_dtype not in ("float32", copy.dtype):
                skipped_why = (
                    f"output dtype {out_dtype} cannot be compared with {copy.dtype} weights"
                )
                continue
            file = stored[copy.name][0]
            if file not in sources:
                src = storage.open_source(locate(file) if locate else join_url(out_url, file))
                sources[file] = (src, *parse_safetensors_header(src))
            checked += 1
            if not _compare_lowp(sources[file], out_dtype, copy, chunk_bytes):
                mismatched += 1
                failures.append(
                    Failure(
                        file, copy.name, "lowp",
                        f"cast to {copy.dtype} differs from the {copy.dtype} weight in "
                        f"{copy.file_url.rsplit('/', 1)[-1]}",
                    )
                )  # fmt: skip
    finally:
        for src, *_ in sources.values():
            src.close()
    return checked, mismatched, skipped_why


def _compare_lowp(src_info: Any, out_dtype: str, copy: LowpCopy, chunk_bytes: int) -> bool:
    """Output elements `[offset, offset + numel)` of `copy.name`, cast, against the copy."""
    src, header, _, data_start = src_info
    out_size = dtype_info(out_dtype).itemsize
    begin = header[copy.name]["data_offsets"][0] + copy.element_offset * out_size
    lowp = copy.dtype
    low_size = dtype_info(lowp).itemsize
    step = max(1, chunk_bytes // out_size)
    for start in range(0, copy.numel, step):
        count = min(step, copy.numel - start)
        raw = src.read_range(
            data_start + begin + start * out_size, data_start + begin + (start + count) * out_size
        )
        ref_raw = copy.source.read_range(
            copy.byte_offset + start * low_size, copy.byte_offset + (start + count) * low_size
        )
        if cast_bytes(raw, out_dtype, lowp) != bytes(ref_raw):
            return False
    return True


def render_verify(report: dict[str, Any]) -> str:
    """The verify report for people: a summary line and a table of failures."""
    lines = []
    status = "OK" if report["ok"] else "FAILED"
    lines.append(
        f"{status}  {report['output']}: {report['num_tensors']} tensors in {len(report['files'])} file(s)"
        + (
            ", manifest checksums compared"
            if report["has_manifest"]
            else ", no manifest (structure and values only)"
        )
        + (
            f", whole-file SHA-256 of {len(report['file_sha256'])} file(s) compared"
            if report.get("file_sha256")
            else ""
        )
    )
    if report.get("quantized"):
        q = report["quantized"]
        lines.append(
            f"  quantized: {q['tensors']} weight(s), {q['params']} parameters at "
            f"{q['bits_per_parameter']} bits per parameter with their scales"
        )
    if report["aliases"]:
        lines.append("  tied: " + ", ".join(f"{a} -> {t}" for a, t in report["aliases"].items()))
    if report["against"]:
        a = report["against"]
        lines.append(
            f"  against {a['checkpoint']} (tag {a['tag']}): {a['expected_tensors']} tensors expected; "
            f"source {a.get('source_identity')}; {a.get('values_sampled', 0)} value samples compared; "
            + (
                f"16-bit cross-check skipped ({a['lowp_skipped']})"
                if a["lowp_checked"] == 0 and a["lowp_skipped"]
                else f"16-bit cross-check {a['lowp_checked'] - a['lowp_mismatched']}/{a['lowp_checked']} equal"
            )
        )
    if report["failures"]:
        rows = [("file", "tensor", "check", "detail")] + [
            (f["file"], f["tensor"], f["check"], f["detail"]) for f in report["failures"]
        ]
        widths = [max(len(r[i]) for r in rows) for i in range(3)]
        for r in rows:
            lines.append("  " + "  ".join(r[i].ljust(widths[i]) for i in range(3)) + "  " + r[3])
    return "\n".join(lines)
