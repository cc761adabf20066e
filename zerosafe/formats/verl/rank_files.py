"""What the readers of a folder of per-rank DTensor files share: verl FSDP
(`model_world_size_W_rank_R.pt`) and torch_checkpointing (`model_R.pt`) claim, list, open and
describe their saves the same way, and differ only in the file names, the tag and their own
manifest fields.

- `RankFolderReader`: `detect` and `quick_identities` of a reader whose folder is one save;
- `build_from_rank_files`: each rank file through the restricted unpickler, its state dict to
  `shards.build_tensors`, every file closed whatever happens;
- `shards_source`, `built_fields` and `shards_layout`: the parts of `describe` both make alike.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from zerosafe.errors import CheckpointFormatError, UnsafePickleError
from zerosafe.formats.base import InspectFacts, SourceDescription, SourceLayout
from zerosafe.formats.torch_zip import TorchZipFile
from zerosafe.formats.verl.shards import VERL_FALLBACK, Built, RankFile, build_tensors
from zerosafe.io.storage import FileIdentity, Storage, join_url, normalize_url

if TYPE_CHECKING:
    from collections import Counter

    from zerosafe.formats.base import SourceDetails, SourceFile

__all__ = [
    "RankFolderReader",
    "build_from_rank_files",
    "built_fields",
    "shards_layout",
    "shards_source",
]


class RankFolderReader:
    """`detect` and `quick_identities` of a reader whose folder is one save: the folder is
    claimed by a file `claims` matches; a subclass says the save's tag and the files a
    conversion reads."""

    claims: re.Pattern[str]

    @staticmethod
    def tag_of(url: str, tag: str | None) -> str:
        """The save's tag (raises ConfigError where another is asked for)."""
        raise NotImplementedError

    @staticmethod
    def read_names(storage: Storage, url: str) -> list[str]:
        """The names of the files a conversion reads, in `SourceLayout.files` order."""
        raise NotImplementedError

    def detect(self, storage: Storage, url: str) -> bool:
        url = normalize_url(url)
        return storage.isdir(url) and any(self.claims.match(n) for n in storage.listdir(url))

    def quick_identities(
        self, storage: Storage, url: str, tag: str | None
    ) -> tuple[str, list[FileIdentity]]:
        url = normalize_url(url)
        resolved = self.tag_of(url, tag)
        names = self.read_names(storage, url)
        return resolved, [storage.identity(join_url(url, n)) for n in names]


def build_from_rank_files(
    storage: Storage,
    url: str,
    files: Sequence[SourceFile],
    *,
    saves: str,
    fallback: str = VERL_FALLBACK,
    check: Callable[[str, list[RankFile]], None] | None = None,
    refuse: Callable[[str, UnsafePickleError], Exception | None] | None = None,
) -> Built:
    """The tensors of the model rank `files` (in rank order), each loaded as a state dict.

    `saves` ends the message for a file holding anything else (`where {saves}`); `check` sees
    the loaded ranks before they are built; `refuse` may turn a file's refused pickle into
    another error (returning None keeps the refusal).

    Raises:
        CheckpointFormatError: If a rank file holds no dict, or the shards do not fit.
        UnsafePickleError: If a rank file's pickle is refused.
    """
    loaded: list[RankFile] = []
    try:
        for source in files:
            archive = TorchZipFile(storage.open_source(source.url))
            loaded.append(RankFile(rank=source.rank, file=source, zip=archive, state={}))
            try:
                state = archive.load()
            except UnsafePickleError as e:
                other = refuse(source.url, e) if refuse else None
                if other is not None:
                    raise other from e
                raise
            if not isinstance(state, dict):
                raise CheckpointFormatError(
                    f"{source.url}: holds a {type(state).__name__}, where {saves}"
                )
            loaded[-1].state = state
        if check is not None:
            check(url, loaded)
        return build_tensors(url, loaded, fallback=fallback)
    finally:
        for rank_file in loaded:
            rank_file.zip.source.close()


def shards_source(
    *,
    fmt: str,
    url: str,
    tag: str,
    files: Sequence[SourceFile],
    built: Built,
    content_sha256: str,
    details: SourceDetails,
    model_files: str | None = None,
) -> SourceDescription:
    """The manifest's `source` block of a save of rank files."""
    return SourceDescription(
        format=fmt,
        checkpoint=url,
        tag=tag,
        num_params=sum(math.prod(t.shape) for t in built.tensors.values()),
        checkpoint_bytes=sum(f.size_bytes for f in files),
        files=tuple(f.identity for f in files),
        content_sha256=content_sha256,
        details=details,
        model_files=model_files,
    )


def built_fields(built: Built, dtypes: Counter[str]) -> dict[str, object]:
    """`inspect --json`'s keys from the rebuilt tensors, from `placements` to
    `non_tensor_entries`, in that order."""
    return {
        "placements": dict(built.placements),
        "uneven": built.uneven,
        "dtypes": dict(dtypes),
        "aliases": dict(built.aliases),
        "copies": dict(built.copies),
        "non_tensor_entries": list(built.non_tensor),
    }


def shards_layout(
    *,
    fmt: str,
    url: str,
    tag: str,
    files: list[SourceFile],
    built: Built,
    source: SourceDescription,
    facts: InspectFacts,
    metadata_bytes: int,
    main_slot_kind: str,
    notes: list[str],
    lowp_missing: str,
    warnings: list[str] | None = None,
) -> SourceLayout:
    """The reader's `SourceLayout` from the rebuilt tensors and what `describe` says."""
    return SourceLayout(
        format=fmt, where=url, tag=tag, files=files, slots=built.slots,
        tensors=built.tensors, order=built.order, aliases=built.aliases, source=source,
        facts=facts, metadata_bytes=metadata_bytes, main_slot_kind=main_slot_kind,
        notes=notes, warnings=list(warnings or []), lowp_missing=lowp_missing,
    )  # fmt: skip
