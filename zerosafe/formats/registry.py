"""The checkpoint formats zerosafe reads, and which one a folder holds.

A new format is one `FormatReader` (`zerosafe.formats.base`) added to `READERS`; nothing after
the reader (planning, stages, verify, publish, the flow) changes.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

from zerosafe.config import ConvertOptions
from zerosafe.errors import CheckpointFormatError, ConfigError
from zerosafe.formats.base import FormatReader, ReadsLowpCopies, SourceLayout
from zerosafe.formats.dcp.reader import DcpReader
from zerosafe.formats.deepspeed.reader import DeepSpeedReader
from zerosafe.formats.deepspeed.universal import UniversalReader
from zerosafe.formats.hf.reader import HfShardedReader, SafetensorsReader
from zerosafe.formats.megatron.reader import MegatronReader
from zerosafe.formats.nested import (
    Found,
    find_latest_step,
    find_nested,
    refuse_optimizer_only,
    refuse_saves_beside,
)
from zerosafe.formats.resemble import looks_like_deepspeed, resemblance
from zerosafe.formats.torch_checkpointing.reader import TorchCheckpointingReader
from zerosafe.formats.verl.reader import VerlReader
from zerosafe.io.storage import Storage, join_url, normalize_url

__all__ = [
    "READERS",
    "check_options",
    "detect_format",
    "find_save",
    "formats_listed",
    "formats_text",
    "quick_identities",
    "read_source",
]


def formats_text() -> str:
    """The supported formats and what a folder of each holds, for errors."""
    return "; ".join(f"{r.title}: {r.looks_like}" for r in READERS)


@contextlib.contextmanager
def formats_listed() -> Iterator[None]:
    """A `CheckpointFormatError` raised inside with `lists_formats` set (a folder that holds
    no checkpoint of the format read) ends with the formats zerosafe reads: a reader knows
    only its own format."""
    try:
        yield
    except CheckpointFormatError as e:
        if e.lists_formats:
            e.args = (f"{e.args[0]} zerosafe reads: {formats_text()}.", *e.args[1:])
            e.lists_formats = False  # listed once, however many callers wrap it
        raise


READERS: tuple[FormatReader, ...] = (
    MegatronReader(),
    DcpReader(),
    VerlReader(),
    TorchCheckpointingReader(),
    UniversalReader(),
    DeepSpeedReader(errors=formats_listed),
    HfShardedReader(),
    SafetensorsReader(),
)
"""Every format, in the order `detect_format` asks them (Megatron's `torch_dist` first: its
`iter_N/` is a DCP folder with Megatron's `metadata.json` beside `.metadata`; then DCP: its
`.metadata` file is unambiguous, while DeepSpeed's detection looks into subfolders; universal before ZeRO: a
universal folder holds the ZeRO tag's model states too; safetensors last, so a training
checkpoint that also keeps a `model.safetensors` is read as the training checkpoint)."""
FALLBACK = "deepspeed"
"""The reader of a folder no reader claims."""


def reader_named(name: str) -> FormatReader:
    for reader in READERS:
        if reader.name == name:
            return reader
    names = ", ".join(r.name for r in READERS)
    raise CheckpointFormatError(f"unknown checkpoint format '{name}'; zerosafe reads {names}")


def detect_format(storage: Storage, url: str, tag: str | None = None) -> FormatReader:
    """The reader of the checkpoint at `url` (and `tag`), from listings only (`find_save`)."""
    return find_save(storage, url, tag).reader


def find_save(storage: Storage, url: str, tag: str | None = None) -> Found:
    """Where the checkpoint at `url` (and `tag`, a folder inside it) is, and its reader, from
    listings only.

    With a `tag` that names a folder of `url`, that folder decides (a DeepSpeed checkpoint
    folder may hold both a ZeRO tag and the universal folder ds_to_universal.py made of it).
    Else a reader that claims `url` reads it, unless a save of another format lies one level
    down beside its own (`refuse_saves_beside`); else the save of the latest step where
    `latest_checkpointed_iteration.txt` names one (`ckpt/global_step_3/model` for `ckpt`);
    else the one save one level down (`zerosafe.formats.nested`:
    `checkpoint-4/pytorch_model_fsdp_0` for `checkpoint-4`).
    A folder no reader claims goes to DeepSpeed's, the original format, whose errors say
    precisely what the folder lacks (and list the formats), where it shows something of
    DeepSpeed's; any other is refused naming what it looks like (`refuse_unrecognised`).

    Raises:
        CheckpointFormatError: If several subfolders hold a save, or one holds a save of
            another format than the folder's own, or DCP chunks lack their `.metadata`.
    """
    url = normalize_url(url)
    if tag and "/" not in tag and tag not in (".", ".."):
        tag_url = join_url(url, tag)
        if storage.isdir(tag_url):
            for reader in READERS:
                if reader.detect(storage, tag_url):
                    return Found(reader=reader, url=url, given=url)
    for reader in READERS:
        if reader.detect(storage, url):
            found = Found(reader=reader, url=url, given=url)
            if tag is None:  # a `--tag` picks the claimed save
                refuse_saves_beside(storage, found, READERS)
            return found
    if tag is None:
        with formats_listed():
            latest = find_latest_step(storage, url, READERS)
        nested = latest or find_nested(storage, url, READERS)
        if nested is not None:
            return nested
        refuse_unrecognised(storage, url)
    return Found(reader=reader_named(FALLBACK), url=url, given=url)


def refuse_unrecognised(storage: Storage, url: str) -> None:
    """Refuse a folder that no reader claims and that shows nothing of DeepSpeed's, naming
    the layout it most resembles (`zerosafe.formats.resemble`); a folder with a sign of
    DeepSpeed's is left to DeepSpeed's reader, whose errors say precisely what is missing.

    Raises:
        CheckpointFormatError: One line: what the folder looks like, and what zerosafe reads.
    """
    if not storage.isdir(url):
        return  # DeepSpeed's reader says "no such checkpoint folder", or that it is a file
    names = storage.listdir(url)
    if looks_like_deepspeed(names):
        return
    raise CheckpointFormatError(
        f"{url}: not a checkpoint zerosafe reads: {resemblance(storage, url, names)}. "
        f"zerosafe reads: {formats_text()}."
    )


def check_options(reader: FormatReader, url: str, options: ConvertOptions) -> None:
    """Refuse options the format has no use for, before anything is read.

    Raises:
        ConfigError: For `select`/`strip_prefix` on a format that holds one state dict,
            `check_lowp` on a format that keeps no 16-bit copy (no `ReadsLowpCopies`), or
            `keep_names` on any format but Megatron-LM's.
    """
    if options.check_lowp and not isinstance(reader, ReadsLowpCopies):
        raise _no_lowp_copy(url, f"a {reader.title} checkpoint keeps no 16-bit copy")
    if options.keep_names and reader.name != "megatron":
        raise ConfigError(
            f"{url}: `--keep-names` applies only to Megatron-LM torch_dist checkpoints (it "
            f"unstacks their layers), and this is a {reader.title} checkpoint, whose names are "
            "written as stored already; drop `--keep-names`"
        )
    if reader.selects:
        return
    given = [
        flag
        for flag, value in (("--select", options.select), ("--strip-prefix", options.strip_prefix))
        if value not in ((), None)
    ]
    if given:
        selecting = [r.title for r in READERS if r.selects]
        raise ConfigError(
            f"{url}: {' and '.join(given)} {'apply' if len(given) > 1 else 'applies'} only to {', '.join(selecting)} checkpoints, "
            f"and this is a {reader.title} checkpoint, which holds one model; drop "
            f"{' and '.join(given)}"
        )


def read_source(
    storage: Storage, url: str, *, tag: str | None, options: ConvertOptions
) -> SourceLayout:
    """Detect the format of `url` and read its metadata into a `SourceLayout`.

    Raises:
        ConfigError: For options the format refuses (`check_options`), or `check_lowp` on a
            checkpoint that keeps no 16-bit copy (`SourceLayout.lowp_missing`).
    """
    found = find_save(storage, url, tag)
    check_options(found.reader, found.url, options)
    layout = found.reader.read(storage, found.url, tag=tag, options=options)
    refuse_optimizer_only(layout, options)
    if found.nested:  # say which folder was converted, what was not, and keep the one given
        layout.notes[:0] = [n for n in (found.note, found.beside_note) if n]
        layout.source = dataclasses.replace(layout.source, found_in=found.given)
    if options.check_lowp and layout.lowp_missing is not None:
        raise _no_lowp_copy(layout.where, layout.lowp_missing)
    return layout


def _no_lowp_copy(url: str, why: str) -> ConfigError:
    return ConfigError(
        f"{url}: `--check-lowp` compares the output with the 16-bit weights DeepSpeed ZeRO-1/2 "
        f"saves beside its fp32 masters, but {why}; drop `--check-lowp` (verify and "
        "`verify --against` still check the output)"
    )


def quick_identities(
    storage: Storage, url: str, tag: str | None
) -> tuple[str, list[dict[str, Any]]]:
    """`(tag, identities)` of the files converting `url` reads, from listings and stats."""
    found = find_save(storage, url, tag)
    return found.reader.quick_identities(storage, found.url, tag)
