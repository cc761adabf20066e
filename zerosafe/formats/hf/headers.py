"""The header of one safetensors file, read and checked against the file before any of its
tensors is planned.

Format (https://github.com/huggingface/safetensors#format): 8 bytes little-endian header
length N, N bytes of JSON `{name: {"dtype", "shape", "data_offsets": [begin, end]},
"__metadata__": {str: str}}`, then the data. The `safetensors` library refuses a file whose
tensors do not tile the data exactly (`MetadataIncompleteBuffer`, `InvalidOffset`): the same
rules are checked here, so a file zerosafe plans from is one the library itself would load.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from zerosafe.dtypes import dtype_info, from_safetensors_code
from zerosafe.errors import CheckpointFormatError
from zerosafe.formats.safetensors import read_header
from zerosafe.io.storage import ByteSource

__all__ = ["HeaderTensor", "SafetensorsHeader", "read_checked_header"]


@dataclass(frozen=True, kw_only=True, slots=True)
class HeaderTensor:
    """One tensor of a safetensors file: where its bytes are, absolute in the file."""

    name: str
    dtype: str
    """torch name (`bfloat16`)."""
    shape: tuple[int, ...]
    byte_offset: int
    """Absolute file offset of the tensor's first byte."""
    nbytes: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True, kw_only=True, slots=True)
class SafetensorsHeader:
    """A checked safetensors header: its tensors in data order, and its `__metadata__`."""

    url: str
    size_bytes: int
    tensors: dict[str, HeaderTensor]
    metadata: dict[str, str]
    header_bytes: int
    """The 8-byte length prefix plus the JSON: what reading the header costs."""


def _bad(url: str, name: str, what: str) -> CheckpointFormatError:
    return CheckpointFormatError(
        f"{url}: tensor '{name}' {what}; the file is corrupt or not a safetensors file "
        "(safetensors' own loader refuses it too). Copy it again from where it was saved"
    )


def _entry(url: str, name: str, raw: Any, data_start: int) -> tuple[HeaderTensor, int, int]:
    if not isinstance(raw, dict) or not {"dtype", "shape", "data_offsets"} <= set(raw):
        raise _bad(url, name, f"has header entry {raw!r}, expected dtype, shape, data_offsets")
    try:
        dtype = from_safetensors_code(str(raw["dtype"])).name
    except ValueError as e:
        raise _bad(url, name, f"has dtype {raw['dtype']!r}, which zerosafe does not know") from e
    shape, offsets = raw["shape"], raw["data_offsets"]
    if not isinstance(shape, list) or not all(
        isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape
    ):
        raise _bad(url, name, f"has shape {shape!r}, expected a list of sizes >= 0")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        raise _bad(url, name, f"has data_offsets {offsets!r}, expected [begin, end]")
    begin, end = offsets
    nbytes = math.prod(shape) * dtype_info(dtype).itemsize
    if end - begin != nbytes:
        raise _bad(url, name, f"spans {end - begin} bytes, where {shape} x {dtype} needs {nbytes}")
    tensor = HeaderTensor(
        name=name, dtype=dtype, shape=tuple(shape), byte_offset=data_start + begin, nbytes=nbytes
    )
    return tensor, begin, end


def read_checked_header(source: ByteSource) -> SafetensorsHeader:
    """Read a safetensors file's header and check every entry against the file.

    Args:
        source: The open file.

    Returns:
        Its tensors (in data order) and `__metadata__`.

    Raises:
        CheckpointFormatError: If the header is not safetensors JSON, a tensor's dtype, shape
            or byte range is invalid, tensors overlap or leave holes, or the data does not end
            where the file does (a truncated or appended file).
    """
    url = source.url
    try:
        raw, metadata, data_start = read_header(source)
    except (AttributeError, KeyError, TypeError, IndexError) as e:  # JSON of another shape
        raise CheckpointFormatError(
            f"{url}: the header is JSON but not a safetensors header ({type(e).__name__}: {e}); "
            "the file is corrupt or not a safetensors file"
        ) from e
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise CheckpointFormatError(
            f"{url}: `__metadata__` is {metadata!r}, expected a JSON object of strings"
        )
    entries = [_entry(url, name, value, data_start) for name, value in raw.items()]
    entries.sort(key=lambda e: (e[1], e[2]))
    expected = 0
    for tensor, begin, end in entries:
        if begin != expected:
            what = "overlaps the tensor before it" if begin < expected else "leaves a hole"
            raise _bad(
                url, tensor.name, f"starts at data byte {begin}, expected {expected}: it {what}"
            )
        expected = end
    if data_start + expected != source.size_bytes:
        raise CheckpointFormatError(
            f"{url}: the header's tensors end at byte {data_start + expected}, but the file has "
            f"{source.size_bytes} bytes; the file is truncated or has bytes appended. Copy it "
            "again from where it was saved"
        )
    return SafetensorsHeader(
        url=url,
        size_bytes=source.size_bytes,
        tensors={t.name: t for t, _, _ in entries},
        metadata=dict(metadata),
        header_bytes=data_start,
    )
