"""verl's FSDP checkpoints as a format reader: a `SourceLayout`.

verl's `FSDPCheckpointManager.save_checkpoint` (verl/utils/checkpoint/fsdp_checkpoint_manager.py,
verl 0.9.1) writes, into one folder (`global_step_N/actor/` under the trainer's checkpoint
folder), per rank R of W:

- `model_world_size_W_rank_R.pt`: `torch.save` of the rank's `model.state_dict()`: under FSDP2
  a `DTensor` per parameter, its local shard and its spec (device mesh, placements); under
  FSDP1 (`SHARDED_STATE_DICT`) the same DTensors, as verl wraps FSDP1 with a device mesh
  (without one, torch saves `ShardedTensor`s: refused in one line);
- `optim_world_size_W_rank_R.pt` and `extra_state_world_size_W_rank_R.pt`: optimizer, LR
  scheduler and RNG state, never read;
and on rank 0 `fsdp_config.json` (`{"FSDP_version": 2, "world_size": W}`) and `huggingface/`
(the model's config, generation config and tokenizer; with `hf_model` in `save_contents` also
full weights).

Each rank file is opened through the restricted unpickler (`zerosafe.formats.torch_pickle`:
DTensor, its spec, mesh and placements become inert records). `shards.py` turns the ranks'
local shards into fragments; `facts.py` says what `inspect` and the manifest report. Names are
the state dict's keys, as verl's own `model_merger` writes them; a tied head (the same storage
as the embedding, in every rank file) is an alias, which the merger drops as well.
"""

from __future__ import annotations

import json
import re
from typing import Any

from zerosafe.config import ConvertOptions
from zerosafe.errors import (
    CheckpointFormatError,
    UnsafePickleError,
    UnsupportedCheckpointError,
)
from zerosafe.formats.base import SourceFile, SourceLayout, one_save_tag
from zerosafe.formats.verl.facts import describe
from zerosafe.formats.verl.rank_files import RankFolderReader, build_from_rank_files
from zerosafe.io.storage import Storage, join_url, normalize_url

__all__ = ["CONFIG_FILE", "FORMAT_NAME", "HF_FOLDER", "VerlReader", "rank_file_names"]

FORMAT_NAME = "verl FSDP"
CONFIG_FILE = "fsdp_config.json"
HF_FOLDER = "huggingface"
_RANK_FILE = re.compile(r"^model_world_size_(\d+)_rank_(\d+)\.pt$")
_CONFIG_MAX_BYTES = 1 << 16
"""verl writes two keys (`{"FSDP_version": 2, "world_size": W}`): anything near 64 KiB is
another file, refused before it is read whole."""


class VerlReader(RankFolderReader):
    """verl FSDP checkpoints: a folder holding `model_world_size_W_rank_R.pt` files."""

    name = "verl"
    claims = _RANK_FILE
    title = FORMAT_NAME
    looks_like = (
        "a verl actor/critic folder holding `model_world_size_W_rank_R.pt`, "
        "`fsdp_config.json` and `huggingface/`"
    )
    selects = False
    parts_below: tuple[str, ...] = ("verl",)
    tag_folders = False

    def read(
        self, storage: Storage, url: str, *, tag: str | None, options: ConvertOptions
    ) -> SourceLayout:
        url = normalize_url(url)
        resolved = self.tag_of(url, tag)
        read_before = storage.counter.bytes_read
        world_size, _ = rank_file_names(storage, url)
        config = _read_config(storage, url, world_size)
        files = _source_files(storage, url)
        built = build_from_rank_files(
            storage, url, [f for f in files if f.role == "model"],
            saves="verl saves the rank's model state dict", refuse=_fsdp1_refusal,
        )  # fmt: skip
        hf_url = join_url(url, HF_FOLDER)
        model_files = hf_url if storage.isdir(hf_url) else None
        metadata_bytes = storage.counter.bytes_read - read_before
        return describe(
            url=url, tag=resolved, files=files, built=built, config=config,
            model_files=model_files, metadata_bytes=metadata_bytes,
        )  # fmt: skip

    @staticmethod
    def tag_of(url: str, tag: str | None) -> str:
        """A verl folder is one save; its tag is `global_step_N/actor` (the last two names)."""
        return one_save_tag(
            url, tag, this="a verl FSDP checkpoint folder", depth=2,
            give="the folder holding the save's model_world_size_W_rank_R.pt files",
        )  # fmt: skip

    @staticmethod
    def read_names(storage: Storage, url: str) -> list[str]:
        return _file_names(storage, url)


def rank_file_names(storage: Storage, url: str) -> tuple[int, list[str]]:
    """`(world size, the model rank files in rank order)`, from the listing.

    Raises:
        CheckpointFormatError: If the files name several world sizes, or a rank is missing.
    """
    found: dict[int, dict[int, str]] = {}
    for name in storage.listdir(url):
        match = _RANK_FILE.match(name)
        if match:
            found.setdefault(int(match.group(1)), {})[int(match.group(2))] = name
    if not found:
        raise CheckpointFormatError(
            f"{url}: no model_world_size_W_rank_R.pt file; not a verl FSDP checkpoint folder"
        )
    if len(found) > 1:
        sizes = ", ".join(f"{w} ({len(r)} file(s))" for w, r in sorted(found.items()))
        raise CheckpointFormatError(
            f"{url}: model rank files of several world sizes ({sizes}): saves of different "
            "runs share this folder; move the files of the save to convert into a folder of "
            "their own"
        )
    ((world_size, ranks),) = found.items()
    missing = [r for r in range(world_size) if r not in ranks]
    extra = sorted(r for r in ranks if r >= world_size)
    if missing or extra:
        raise CheckpointFormatError(
            f"{url}: expected model_world_size_{world_size}_rank_R.pt for R = 0..{world_size - 1}, "
            f"but rank(s) {missing or extra} {'are missing' if missing else 'are extra'}; "
            "each rank writes its own file, so the save did not finish or was copied in "
            "part. Copy the whole folder again."
        )
    return world_size, [ranks[r] for r in range(world_size)]


def _file_names(storage: Storage, url: str) -> list[str]:
    """What a conversion reads, in `SourceLayout.files` order: `fsdp_config.json` where
    present, then the model rank files (never the optimizer or extra-state files)."""
    names = [CONFIG_FILE] if CONFIG_FILE in storage.listdir(url) else []
    return names + rank_file_names(storage, url)[1]


def _source_files(storage: Storage, url: str) -> list[SourceFile]:
    files = []
    for i, name in enumerate(_file_names(storage, url)):
        ident = storage.identity(join_url(url, name))
        match = _RANK_FILE.match(name)
        files.append(
            SourceFile(
                index=i, url=ident.url, role="model" if match else "metadata",
                rank=int(match.group(2)) if match else 0, size_bytes=ident.size_bytes,
                version=ident.version,
            )
        )  # fmt: skip
    return files


def _read_config(storage: Storage, url: str, world_size: int) -> dict[str, Any] | None:
    """`fsdp_config.json` (None where absent), checked against the rank files.

    Raises:
        CheckpointFormatError: If it is not the JSON verl writes, or names another world size.
    """
    config_url = join_url(url, CONFIG_FILE)
    if not storage.exists(config_url):
        return None
    data = storage.read_small(
        config_url,
        limit_bytes=_CONFIG_MAX_BYTES,
        what="verl's `fsdp_config.json` (a few lines of JSON)",
    )
    try:
        config = json.loads(data)
    except ValueError as e:
        raise CheckpointFormatError(
            f"{config_url}: not the JSON verl writes ({e}); copy the file again"
        ) from e
    if not isinstance(config, dict):
        raise CheckpointFormatError(f"{config_url}: expected a JSON object, found {config!r}")
    saved = config.get("world_size")
    if saved != world_size:
        raise CheckpointFormatError(
            f"{config_url}: says world_size {saved!r}, but the folder holds the model files "
            f"of world size {world_size} (model_world_size_{world_size}_rank_R.pt); the files "
            "come from different saves. Copy the save's folder again as one."
        )
    return config


def _fsdp1_refusal(where: str, refused: UnsafePickleError) -> Exception | None:
    if "torch.distributed._shard." not in str(refused):  # ShardedTensor and its metadata
        return None
    return UnsupportedCheckpointError(
        f"{where}: an FSDP1 save of `ShardedTensor`s (FSDP1 wrapped without a device mesh), "
        "which zerosafe does not read (it reads DTensors: FSDP2, and FSDP1 with a device mesh, "
        "as verl wraps it), nor does verl's model_merger (torch.load needs a process group); "
        "load it into the FSDP-wrapped model on its W ranks and save a FULL_STATE_DICT"
    )
