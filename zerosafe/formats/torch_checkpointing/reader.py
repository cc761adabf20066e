"""Meta's torch_checkpointing saves as a format reader: a `SourceLayout`.

torch_checkpointing 0.1.1's `CheckpointManager.save(checkpoint_id, {item: value})`
(torch_checkpointing/checkpoint_layout.py, checkpoint_writer.py) writes, into the folder
`checkpoint_id` (`step_N/` by convention), one file per top-level item and rank R:

- by default `<item>_R.pt`, a `torch.save` of the rank's value: `model_R.pt` holds the rank's
  `model.state_dict()` (under FSDP2 a `DTensor` per parameter: its local shard and its spec),
  `optim_R.pt` the optimizer state, `step_R.pt` whatever else the payload holds;
- with `SafetensorsSerialization` as the item's layout, `model_R.safetensors`: each rank's
  local shards under their full names, whose global layout only `metadata.pkl` records (a
  pickle of the library's own classes, written only when an item declares a resharder).

Only the `model` item is read: its rank files go through the restricted unpickler
(`zerosafe.formats.torch_pickle`: DTensors become inert records, nothing runs), and their
local shards become fragments with the geometry verl's FSDP2 files share
(`zerosafe.formats.verl.shards`). In the safetensors layout the rank files' headers and
`metadata.pkl` (read as data) place the local shards (`safetensors_layout.py`). The other
items' files (optimizer moments, counters) are listed by `inspect` and never read.
"""

from __future__ import annotations

import re

from zerosafe.config import ConvertOptions
from zerosafe.errors import CheckpointFormatError
from zerosafe.formats.base import SourceFile, SourceLayout, one_save_tag
from zerosafe.formats.torch_checkpointing.facts import describe
from zerosafe.formats.torch_checkpointing.safetensors_layout import read_safetensors_save
from zerosafe.formats.torch_pickle import DTensorRecord, InertObject, TensorRecord
from zerosafe.formats.verl.rank_files import RankFolderReader, build_from_rank_files
from zerosafe.formats.verl.shards import RankFile
from zerosafe.io.storage import Storage, join_url, normalize_url

__all__ = ["FORMAT_NAME", "MODEL_ITEM", "TorchCheckpointingReader", "item_files"]

FORMAT_NAME = "torch_checkpointing"
MODEL_ITEM = "model"
"""The item whose tensors are the weights (`manager.save(id, {"model": ...})`)."""
TEMP_PREFIX = "tmp_"
"""The folder a save is written into before its rename (`CheckpointWriterConfig.temp_dir_prefix`'s
default)."""
_FALLBACK = (
    "load it with torch_checkpointing's CheckpointManager.load into the sharded model and "
    "save each parameter's full_tensor()"
)
"""What a refused placement or mesh is told to do instead (torch_checkpointing has no
consolidation of its default layout)."""
_ITEM_FILE = re.compile(r"^(?P<item>.+)_(?P<rank>\d+)\.(?P<ext>pt|safetensors)$")
_MODEL_FILE = re.compile(rf"^({MODEL_ITEM}_\d+\.pt|{MODEL_ITEM}_0\.safetensors)$")
"""What claims a folder: any rank's `model_R.pt`, or rank 0's `model_0.safetensors` (accelerate's
`save_state` of several models writes `model.safetensors`, `model_1.safetensors`...)."""


class TorchCheckpointingReader(RankFolderReader):
    """torch_checkpointing saves: a folder holding `model_R.pt` (or `model_R.safetensors`)."""

    name = "torch_checkpointing"
    claims = _MODEL_FILE
    title = FORMAT_NAME
    parts_below: tuple[str, ...] = ("torch_checkpointing",)
    tag_folders = False
    looks_like = (
        "a CheckpointManager save folder holding `model_R.pt` (or `model_R.safetensors` and "
        "`metadata.pkl`) and `optim_R.pt` per rank"
    )
    selects = False

    def read(
        self, storage: Storage, url: str, *, tag: str | None, options: ConvertOptions
    ) -> SourceLayout:
        url = normalize_url(url)
        resolved = self.tag_of(url, tag)
        read_before = storage.counter.bytes_read
        names = _model_file_names(storage, url)
        fingerprint = None
        if names[0].endswith(".safetensors"):
            save = read_safetensors_save(storage, url, names)
            files, built, fingerprint = save.files, save.built, save.fingerprint
        else:
            files = _source_files(storage, url, names)
            saves = f"{FORMAT_NAME} saves the rank's value of the `{MODEL_ITEM}` item, a state dict"
            built = build_from_rank_files(
                storage, url, files, saves=saves, fallback=_FALLBACK, check=_check_mesh
            )
        layout = describe(
            url=url, tag=resolved, files=files, built=built,
            other_items=_other_items(storage, url),
            metadata_bytes=storage.counter.bytes_read - read_before,
            safetensors_fingerprint=fingerprint,
        )  # fmt: skip
        if resolved.startswith(TEMP_PREFIX):
            layout.warnings.append(
                f"{url}: the folder's name starts with '{TEMP_PREFIX}', the folder "
                f"{FORMAT_NAME} writes a save into and renames when every rank has finished: "
                "this save was not finalized (its model rank files are all there and check out "
                "whole, so the weights are complete); prefer a finished save"
            )
        return layout

    @staticmethod
    def tag_of(url: str, tag: str | None) -> str:
        """A save folder is one save; its tag is the folder's name (`step_4`)."""
        return one_save_tag(
            url, tag, this=f"a {FORMAT_NAME} save folder",
            give="the folder holding its model_R.pt files",
        )  # fmt: skip

    @staticmethod
    def read_names(storage: Storage, url: str) -> list[str]:
        return _model_file_names(storage, url)


def item_files(storage: Storage, url: str) -> dict[str, dict[int, str]]:
    """Every item's rank files in the folder's listing: item -> rank -> file name."""
    found: dict[str, dict[int, str]] = {}
    for name in storage.listdir(url):
        match = _ITEM_FILE.match(name)
        if match:
            found.setdefault(match.group("item"), {})[int(match.group("rank"))] = name
    return found


def _model_file_names(storage: Storage, url: str) -> list[str]:
    """The model item's rank files in rank order, for ranks 0 to W - 1, where W is the world
    size every item's files name (each item is saved once per rank).

    Raises:
        CheckpointFormatError: If a rank's model file is missing, or ranks save it both ways.
    """
    items = item_files(storage, url)
    ranks = items.get(MODEL_ITEM, {})
    if not ranks:
        raise CheckpointFormatError(
            f"{url}: no {MODEL_ITEM}_R.pt file; not a {FORMAT_NAME} save folder"
        )
    world_size = 1 + max(max(r) for r in items.values())
    suffixes = {n.rsplit(".", 1)[-1] for n in ranks.values()}
    if len(suffixes) > 1:
        raise CheckpointFormatError(
            f"{url}: holds both {MODEL_ITEM}_R.pt and {MODEL_ITEM}_R.safetensors files: saves "
            "of different runs share this folder; move the save to convert into its own folder"
        )
    suffix = suffixes.pop()
    missing = [f"{MODEL_ITEM}_{r}.{suffix}" for r in range(world_size) if r not in ranks]
    if missing:
        raise CheckpointFormatError(
            f"{url}: expected {MODEL_ITEM}_R.{suffix} for R = 0..{world_size - 1} (the item files "
            f"name {world_size} ranks), but {', '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} missing; each rank writes its own file, "
            "so the save did not finish or was copied in part. Copy the whole folder again."
        )
    return [ranks[r] for r in range(world_size)]


def _other_items(storage: Storage, url: str) -> dict[str, int]:
    """The items besides the model (optimizer, step...): item -> number of rank files."""
    return {k: len(v) for k, v in sorted(item_files(storage, url).items()) if k != MODEL_ITEM}


def _source_files(storage: Storage, url: str, names: list[str]) -> list[SourceFile]:
    files = []
    for rank, name in enumerate(names):
        ident = storage.identity(join_url(url, name))
        files.append(
            SourceFile(
                index=rank, url=ident.url, role="model", rank=rank,
                size_bytes=ident.size_bytes, version=ident.version,
            )
        )  # fmt: skip
    return files


def _check_mesh(url: str, ranks: list[RankFile]) -> None:
    """A DTensor's device mesh spans the ranks that saved it: more than there are model files
    means files are missing (with every other item's files gone too).

    Raises:
        CheckpointFormatError: If the mesh spans more ranks than the folder has model files.
    """
    for key, value in ranks[0].state.items():
        if not isinstance(value, DTensorRecord):
            continue
        mesh = value.spec.get("mesh")
        rank_map = mesh.get("_rank_map") if isinstance(mesh, InertObject) else None
        if isinstance(rank_map, TensorRecord) and rank_map.numel > len(ranks):
            missing = [f"{MODEL_ITEM}_{r}.pt" for r in range(len(ranks), rank_map.numel)]
            raise CheckpointFormatError(
                f"{url}: '{key}' is sharded over {rank_map.numel} ranks, but only "
                f"{len(ranks)} model file(s) are here: {', '.join(missing)} missing; copy the "
                "whole save folder again"
            )
        return
