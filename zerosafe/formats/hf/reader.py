"""Safetensors weights as a format reader: a Hugging Face model folder, and the per-rank save
of torch's `HuggingFaceStorageWriter(save_distributed=True)`.

- `SafetensorsReader`: a folder as `save_pretrained` writes it (`model.safetensors`, or
  `model-0000K-of-0000N.safetensors` + `model.safetensors.index.json`), a zerosafe output, or
  a folder holding one `*.safetensors` file (`folder.py`). Each tensor is one slot, read whole.
- `HfShardedReader`: `shard-0000R-model-0000K-of-0000N.safetensors` from every rank, each
  tensor reassembled from its ranks' chunks (`sharded.py`). With `enable_consolidation=True`
  these are in `sharded/` below a finished folder of the first kind; given that parent, the
  consolidated files are converted and a note names `sharded/`.

Every header is checked against its file before anything is planned (`headers.py`); only
headers and the index are read here, never tensor data.
"""

from __future__ import annotations

from zerosafe.config import ConvertOptions
from zerosafe.formats.base import Slot, SourceFile, SourceLayout, SourceTensor, one_save_tag
from zerosafe.formats.hf.facts import Described, describe
from zerosafe.formats.hf.folder import INDEX_NAME, SINGLE_NAME, SUFFIX, read_folder, weight_files
from zerosafe.formats.hf.headers import SafetensorsHeader, read_checked_header
from zerosafe.formats.hf.sharded import RANK_FILE, rank_files, reassemble
from zerosafe.formats.nested import OUTPUT_MARKER, OUTPUT_WORK_DIR
from zerosafe.io.storage import FileIdentity, Storage, join_url, normalize_url

__all__ = ["HfShardedReader", "SafetensorsReader"]

SHARDED_DIR = "sharded"
"""Where `HuggingFaceStorageWriter(enable_consolidation=True)` puts the rank files."""


def _tag_of(url: str, tag: str | None, title: str) -> str:
    """A safetensors folder is one save; its tag is its own name."""
    return one_save_tag(url, tag, this=f"a {title} folder", give="the folder itself")


def _being_written(names: set[str]) -> bool:
    """A zerosafe output not finished yet (its work folder, no completion marker): never
    taken for a source, so a conversion cannot read a half-written output."""
    return OUTPUT_WORK_DIR in names and OUTPUT_MARKER not in names


def _source_files(
    storage: Storage, url: str, names: list[tuple[str, str, int]]
) -> list[SourceFile]:
    files = []
    for i, (name, role, rank) in enumerate(names):
        ident = storage.identity(join_url(url, name))
        files.append(
            SourceFile(
                index=i, url=ident.url, role=role, rank=rank, size_bytes=ident.size_bytes,
                version=ident.version,
            )
        )  # fmt: skip
    return files


class SafetensorsReader:
    """A safetensors model folder: `model.safetensors`, or shards and their index."""

    name = "safetensors"
    title = "safetensors model folder"
    parts_below: tuple[str, ...] = ("safetensors", "hf-sharded")
    """torch's consolidation writes the rank files it merged into `sharded/` beside them."""
    tag_folders = False
    looks_like = (
        f"`{SINGLE_NAME}`, or `model-0000K-of-0000N.safetensors` with `{INDEX_NAME}` "
        "(save_pretrained, a zerosafe output), or one `*.safetensors` file"
    )
    selects = False

    def detect(self, storage: Storage, url: str) -> bool:
        url = normalize_url(url)
        if not storage.isdir(url):
            return False
        names = set(storage.listdir(url))
        if _being_written(names):
            return False
        if INDEX_NAME in names or SINGLE_NAME in names:
            return True
        weights = [n for n in names if n.endswith(SUFFIX) and not RANK_FILE.match(n)]
        return len(weights) == 1

    @staticmethod
    def _names(index: str | None, names: list[str]) -> list[tuple[str, str, int]]:
        """`(name, role, rank)` of the files read: the index first, where there is one."""
        return [(n, "metadata", 0) for n in (index,) if n] + [(n, "model", 0) for n in names]

    def quick_identities(
        self, storage: Storage, url: str, tag: str | None
    ) -> tuple[str, list[FileIdentity]]:
        url = normalize_url(url)
        resolved = _tag_of(url, tag, self.title)
        weights = weight_files(storage, url)
        names = [n for n, _, _ in self._names(weights.index, weights.names)]
        return resolved, [storage.identity(join_url(url, n)) for n in names]

    def read(
        self, storage: Storage, url: str, *, tag: str | None, options: ConvertOptions
    ) -> SourceLayout:
        url = normalize_url(url)
        resolved = _tag_of(url, tag, self.title)
        folder = read_folder(storage, url)
        files = _source_files(storage, url, self._names(folder.index, folder.names))
        by_name = {f.url.rsplit("/", 1)[-1]: f for f in files}
        slots: list[Slot] = []
        tensors: dict[str, SourceTensor] = {}
        for header in folder.headers:
            file = by_name[header.url.rsplit("/", 1)[-1]]
            for t in header.tensors.values():
                fragments: tuple[tuple[int, int, int, int], ...] = ()
                if t.numel:
                    fragments = ((len(slots), 0, t.numel, 0),)
                    slots.append(
                        Slot(
                            index=len(slots), file=file.index, rank=0, kind="chunk",
                            name=t.name, record=t.name, record_offset=t.byte_offset,
                            record_size_bytes=t.nbytes, record_crc32=0, element_offset=0,
                            numel=t.numel, dtype=t.dtype,
                        )
                    )  # fmt: skip
                tensors[t.name] = SourceTensor(
                    name=t.name, shape=t.shape, dtype=t.dtype, role="param", fragments=fragments
                )
        notes = []
        if folder.unreferenced:
            notes.append(
                f"{len(folder.unreferenced)} safetensors file(s) not in {INDEX_NAME}, not "
                f"read: {', '.join(folder.unreferenced[:4])}"
            )
        sharded = join_url(url, SHARDED_DIR)
        if storage.isdir(sharded) and HfShardedReader().detect(storage, sharded):
            notes.append(
                f"converting the consolidated files in {url}; {sharded} holds the same save "
                "as written by each rank (HuggingFaceStorageWriter): pass that folder to "
                "convert from the rank files instead"
            )
        return describe(
            Described(
                format=self.name, format_name="safetensors", url=url, tag=resolved,
                files=files, headers=folder.headers, slots=slots, tensors=tensors,
                order=folder.order, aliases=folder.aliases, world_size=None, notes=notes,
                metadata_bytes=folder.metadata_bytes, main_label="tensors",
                model_files=url, ties_by_config=True,
            )
        )  # fmt: skip


class HfShardedReader:
    """A `HuggingFaceStorageWriter(save_distributed=True)` save: one file per rank."""

    name = "hf-sharded"
    title = "HuggingFaceStorageWriter rank files"
    parts_below: tuple[str, ...] = ("hf-sharded",)
    tag_folders = False
    looks_like = (
        "`shard-0000R-model-0000K-of-0000N.safetensors` per rank (torch's "
        "HuggingFaceStorageWriter with save_distributed=True)"
    )
    selects = False

    def detect(self, storage: Storage, url: str) -> bool:
        url = normalize_url(url)
        if not storage.isdir(url):
            return False
        names = storage.listdir(url)
        return INDEX_NAME not in names and any(RANK_FILE.match(n) for n in names)

    def quick_identities(
        self, storage: Storage, url: str, tag: str | None
    ) -> tuple[str, list[FileIdentity]]:
        url = normalize_url(url)
        resolved = _tag_of(url, tag, self.title)
        _, ranks = rank_files(storage, url)
        return resolved, [storage.identity(join_url(url, n)) for _, n in ranks]

    def read(
        self, storage: Storage, url: str, *, tag: str | None, options: ConvertOptions
    ) -> SourceLayout:
        url = normalize_url(url)
        resolved = _tag_of(url, tag, self.title)
        read_before = storage.counter.bytes_read
        world_size, ranks = rank_files(storage, url)
        files = _source_files(storage, url, [(n, "model", r) for r, n in ranks])
        headers: list[SafetensorsHeader] = []
        for _, name in ranks:
            source = storage.open_source(join_url(url, name))
            try:
                headers.append(read_checked_header(source))
            finally:
                source.close()
        built = reassemble(url, headers, files)
        notes = [
            f"{built.split} of {len(built.tensors)} tensor(s) reassembled from chunks of "
            f"{world_size} rank(s); shapes inferred from the chunks' offsets (the files "
            "record no global shape)"
        ]
        return describe(
            Described(
                format=self.name, format_name="HuggingFaceStorageWriter", url=url,
                tag=resolved, files=files, headers=headers, slots=built.slots,
                tensors=built.tensors, order=built.order, aliases={}, world_size=world_size,
                notes=notes, metadata_bytes=storage.counter.bytes_read - read_before,
                main_label="chunks of the rank files",
            )
        )  # fmt: skip
