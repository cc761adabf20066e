"""The checkpoint formats zerosafe reads, and which one a folder holds.

A new format is one `FormatReader` (`zerosafe.formats.base`) added to `READERS`; nothing after
the reader (planning, stages, verify, publish, the flow) changes.
"""

from __future__ import annotations

from typing import Any

from zerosafe.config import ConvertOptions
from zerosafe.errors import CheckpointFormatError
from zerosafe.formats.base import FormatReader, SourceLayout
from zerosafe.formats.deepspeed.reader import DeepSpeedReader
from zerosafe.io.storage import Storage, normalize_url

__all__ = ["READERS", "detect_format", "formats_text", "quick_identities", "read_source"]

READERS: tuple[FormatReader, ...] = (DeepSpeedReader(),)
"""Every format, in the order `detect_format` asks them."""


def formats_text() -> str:
    """The supported formats and what a folder of each holds, for errors."""
    return "; ".join(f"{r.title}: {r.looks_like}" for r in READERS)


def reader_named(name: str) -> FormatReader:
    for reader in READERS:
        if reader.name == name:
            return reader
    names = ", ".join(r.name for r in READERS)
    raise CheckpointFormatError(f"unknown checkpoint format '{name}'; zerosafe reads {names}")


def detect_format(storage: Storage, url: str) -> FormatReader:
    """The reader of the checkpoint at `url`, from listings only.

    A folder no reader claims goes to DeepSpeed's, the original format, whose errors say
    precisely what the folder lacks (and list the formats).
    """
    url = normalize_url(url)
    for reader in READERS:
        if reader.detect(storage, url):
            return reader
    return READERS[0]


def read_source(
    storage: Storage, url: str, *, tag: str | None, options: ConvertOptions
) -> SourceLayout:
    """Detect the format of `url` and read its metadata into a `SourceLayout`."""
    return detect_format(storage, url).read(storage, url, tag=tag, options=options)


def quick_identities(
    storage: Storage, url: str, tag: str | None
) -> tuple[str, list[dict[str, Any]]]:
    """`(tag, identities)` of the files converting `url` reads, from listings and stats."""
    return detect_format(storage, url).quick_identities(storage, url, tag)
