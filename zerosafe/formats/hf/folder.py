"""Which files of a Hugging Face safetensors folder hold the model, and their tensors.

`save_pretrained` (transformers) and `save_torch_state_dict` (huggingface_hub) write either one
`model.safetensors`, or shards `model-0000K-of-0000N.safetensors` with
`model.safetensors.index.json` (`{"metadata": {"total_size": ...}, "weight_map": {name: file}}`);
torch's `HuggingFaceStorageWriter` with `enable_consolidation=True` writes the same. A folder
holding a single other `*.safetensors` file and no index is read too. The index is checked
against the files: every file it names exists, and every tensor of every header is in the map
under that file, and no other.

Tied weights are kept as the source has them: transformers stores a tied head once and ties it
again from `config.json`, so the folder simply lacks it; a zerosafe output records its tied
aliases (`alias -> target`) in the index's `metadata.aliases` and each shard's `__metadata__`
(`aliases`, JSON), and those become the layout's aliases again.
Format: https://huggingface.co/docs/safetensors/index#format
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from zerosafe.errors import CheckpointFormatError
from zerosafe.formats.hf.headers import SafetensorsHeader, read_checked_header
from zerosafe.io.storage import Storage, join_url

__all__ = [
    "INDEX_NAME",
    "SINGLE_NAME",
    "SUFFIX",
    "HfFolder",
    "WeightFiles",
    "read_folder",
    "weight_files",
]

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
SUFFIX = ".safetensors"
_MODEL_FILE = re.compile(r"^model(-\d+-of-\d+)?\.safetensors$")
"""The names `save_pretrained` gives a model's weight files."""
_INDEX_MAX_BYTES = 256 * 2**20
"""The largest index parsed: real ones are a few MB (a name and a file name per tensor)."""


@dataclass(kw_only=True)
class HfFolder:
    """The weight files of one folder, their checked headers, and the tied aliases."""

    url: str
    names: list[str]
    """The weight files read, in read order."""
    headers: list[SafetensorsHeader]
    order: list[str]
    """Every tensor name, in output order (the index's, else the files' data order)."""
    aliases: dict[str, str] = field(default_factory=dict)
    index: str | None = None
    """The index file read, where there is one."""
    unreferenced: list[str] = field(default_factory=list)
    """`*.safetensors` files in the folder that the index does not name (never read)."""
    metadata_bytes: int = 0


@dataclass(frozen=True, kw_only=True, slots=True)
class WeightFiles:
    """Which files hold a folder's weights: the index (where there is one) and the files."""

    index: str | None
    """`INDEX_NAME`, or None for a folder of one file."""
    weight_map: dict[str, str] | None
    """The index's tensor name -> file name."""
    index_aliases: dict[str, str]
    """Tied aliases the index records (`metadata.aliases`, as zerosafe writes them)."""
    names: list[str]


def weight_files(storage: Storage, url: str) -> WeightFiles:
    """The weight files a conversion reads, from the listing and the index.

    Raises:
        CheckpointFormatError: If the folder holds no safetensors file, several without an
            index, an index that is not the JSON `save_pretrained` writes, or one that names
            a file the folder lacks.
    """
    names = storage.listdir(url)
    if INDEX_NAME in names:
        weight_map, aliases = _read_index(storage, url)
        missing = sorted(set(weight_map.values()) - set(names))
        if missing:
            raise CheckpointFormatError(
                f"{join_url(url, INDEX_NAME)}: names {len(missing)} file(s) not in the folder "
                f"({', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}); the save was "
                "copied in part. Copy the missing files"
            )
        return WeightFiles(
            index=INDEX_NAME, weight_map=weight_map, index_aliases=aliases,
            names=sorted(set(weight_map.values())),
        )  # fmt: skip
    if SINGLE_NAME in names:
        return WeightFiles(index=None, weight_map=None, index_aliases={}, names=[SINGLE_NAME])
    found = sorted(n for n in names if n.endswith(SUFFIX))
    if len(found) == 1:
        return WeightFiles(index=None, weight_map=None, index_aliases={}, names=found)
    if not found:
        raise CheckpointFormatError(
            f"{url}: no `{SINGLE_NAME}`, `{INDEX_NAME}` or other `*.safetensors` file; not a "
            "safetensors model folder"
        )
    shown = ", ".join(found[:6]) + (" ..." if len(found) > 6 else "")
    raise CheckpointFormatError(
        f"{url}: {len(found)} safetensors files ({shown}) and no `{INDEX_NAME}` saying which "
        f"tensor is in which; copy the index the save wrote, or put the model's file alone "
        "in a folder"
    )


def _read_index(storage: Storage, url: str) -> tuple[dict[str, str], dict[str, str]]:
    index_url = join_url(url, INDEX_NAME)
    data = storage.read_bytes(index_url)
    if len(data) > _INDEX_MAX_BYTES:
        raise CheckpointFormatError(
            f"{index_url}: {len(data)} bytes, over the {_INDEX_MAX_BYTES // 2**20} MiB an index "
            "can be; is it the right file?"
        )
    try:
        index = json.loads(data)
    except ValueError as e:
        raise CheckpointFormatError(
            f"{index_url}: not JSON ({e}); expected the index save_pretrained writes"
        ) from e
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) and v and "/" not in v
        for k, v in weight_map.items()
    ):
        raise CheckpointFormatError(
            f"{index_url}: expected `weight_map`, an object of tensor name -> file name in this "
            f"folder, found {str(weight_map)[:120]!r}; copy the index again"
        )
    metadata = index.get("metadata")
    aliases = metadata.get("aliases") if isinstance(metadata, dict) else None
    if aliases is not None and not (
        isinstance(aliases, dict)
        and all(isinstance(k, str) and isinstance(v, str) for k, v in aliases.items())
    ):
        raise CheckpointFormatError(
            f"{index_url}: `metadata.aliases` is {str(aliases)[:120]!r}, expected an object of "
            "alias -> tensor name (as zerosafe writes it)"
        )
    return weight_map, dict(aliases or {})


def _header_aliases(header: SafetensorsHeader) -> dict[str, str]:
    raw = header.metadata.get("aliases")
    if raw is None:
        return {}
    try:
        aliases = json.loads(raw)
    except ValueError as e:
        raise CheckpointFormatError(
            f"{header.url}: `__metadata__` `aliases` is {raw[:120]!r}, expected JSON (alias -> "
            "tensor, as zerosafe writes it)"
        ) from e
    if not isinstance(aliases, dict):
        raise CheckpointFormatError(
            f"{header.url}: `__metadata__` `aliases` is {raw[:120]!r}, expected a JSON object"
        )
    return {str(k): str(v) for k, v in aliases.items()}


def _read_headers(
    storage: Storage, url: str, names: Sequence[str], max_workers: int
) -> list[SafetensorsHeader]:
    def one(name: str) -> SafetensorsHeader:
        source = storage.open_source(join_url(url, name))
        try:
            return read_checked_header(source)
        finally:
            source.close()

    with ThreadPoolExecutor(max_workers=max_workers) as pool:
        return list(pool.map(one, names))


def _check_against_index(
    url: str, weight_map: dict[str, str], headers: Sequence[SafetensorsHeader]
) -> None:
    index_url = join_url(url, INDEX_NAME)
    for header in headers:
        name = header.url.rsplit("/", 1)[-1]
        for tensor in header.tensors:
            mapped = weight_map.get(tensor)
            if mapped != name:
                where = f"maps it to {mapped}" if mapped else "does not list it"
                raise CheckpointFormatError(
                    f"{index_url}: {name} holds tensor '{tensor}', but the index {where}; the "
                    "index and the files come from different saves. Copy the folder again as "
                    "one save"
                )
    held = {(t, h.url.rsplit("/", 1)[-1]) for h in headers for t in h.tensors}
    for tensor, name in weight_map.items():
        if (tensor, name) not in held:
            raise CheckpointFormatError(
                f"{index_url}: maps tensor '{tensor}' to {name}, whose header has no such "
                "tensor; the index and the files come from different saves. Copy the folder "
                "again as one save"
            )


def _check_aliases(url: str, aliases: dict[str, str], tensors: set[str]) -> None:
    for alias, target in aliases.items():
        if alias in tensors or target not in tensors:
            what = "is stored as a tensor too" if alias in tensors else f"'{target}' is not stored"
            raise CheckpointFormatError(
                f"{url}: records '{alias}' as tied to '{target}', but {what}; the recorded "
                "aliases and the files come from different saves"
            )


def read_folder(storage: Storage, url: str, *, max_workers: int = 8) -> HfFolder:
    """Read and check the headers of a safetensors folder's weight files.

    Args:
        storage: Opens the files.
        url: The folder.
        max_workers: Headers read at once.

    Returns:
        The files, headers, output order and tied aliases.

    Raises:
        CheckpointFormatError: If the index and the files disagree, a file is missing or
            unreadable, a tensor is in two files, or a recorded alias has no target.
    """
    read_before = storage.counter.bytes_read
    weights = weight_files(storage, url)
    names = weights.names
    listed = set(storage.listdir(url))
    headers = _read_headers(storage, url, names, max_workers)
    seen: dict[str, str] = {}
    for header in headers:
        for tensor in header.tensors:
            if tensor in seen:
                raise CheckpointFormatError(
                    f"{url}: tensor '{tensor}' is in both {seen[tensor]} and "
                    f"{header.url.rsplit('/', 1)[-1]}; a folder holds each tensor once"
                )
            seen[tensor] = header.url.rsplit("/", 1)[-1]
    aliases: dict[str, str] = {}
    for header in headers:
        aliases.update(_header_aliases(header))
    if weights.weight_map is not None:
        _check_against_index(url, weights.weight_map, headers)
        aliases.update(weights.index_aliases)
        order = list(weights.weight_map)
    else:
        order = [t for h in headers for t in h.tensors]
    _check_aliases(url, aliases, set(seen))
    unreferenced = sorted(n for n in listed if n.endswith(SUFFIX) and n not in names)
    shards = [n for n in unreferenced if _MODEL_FILE.match(n)]
    if shards:  # the save's own files, left out of its index: their tensors would be lost
        raise CheckpointFormatError(
            f"{join_url(url, INDEX_NAME)}: lists no tensor of {', '.join(shards[:4])}, which "
            "the folder holds; the index and the files come from different saves. Copy the "
            "folder again as one save, or move the files the index does not name elsewhere"
        )
    return HfFolder(
        url=url, names=list(names), headers=headers, order=order + sorted(aliases),
        aliases=aliases, index=weights.index, unreferenced=unreferenced,
        metadata_bytes=storage.counter.bytes_read - read_before,
    )  # fmt: skip
