"""Per-tensor checksums of output shards: written while merging, recomputed by verify.

They guard against corruption between the merge and the reader (a bad disk, a torn upload,
a file changed later), not against an adversary, so a fast non-cryptographic hash does the
job: XXH3-128 runs at about 12 GB/s per core here against 1.3 GB/s for SHA-256, and the merge
and verify of every output byte each pay one of them. The name of the algorithm is the key of
the checksum in every record (`{"xxh3_128": "..."}`), so manifests written with SHA-256 by
earlier versions (`{"sha256": "..."}`) are still verified with SHA-256.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any, Protocol

__all__ = ["ALGORITHMS", "TENSOR_CHECKSUM", "Digest", "new_digest", "recorded_checksum"]

TENSOR_CHECKSUM = "xxh3_128"
"""The algorithm new outputs record per tensor."""
ALGORITHMS = ("xxh3_128", "sha256")
"""Every algorithm a record may name, preferred first."""


class Digest(Protocol):
    def update(self, data: Any, /) -> None: ...

    def hexdigest(self) -> str: ...


def new_digest(algorithm: str) -> Digest:
    """A running digest of `algorithm` (one of `ALGORITHMS`)."""
    if algorithm == "xxh3_128":
        import xxhash

        digest: Digest = xxhash.xxh3_128()
        return digest
    if algorithm == "sha256":
        return hashlib.sha256()
    raise ValueError(f"unknown checksum algorithm '{algorithm}'")


def recorded_checksum(record: Mapping[str, Any]) -> tuple[str, str] | None:
    """`(algorithm, hex digest)` a tensor record carries, or None."""
    for algorithm in ALGORITHMS:
        value = record.get(algorithm)
        if isinstance(value, str):
            return algorithm, value
    return None
