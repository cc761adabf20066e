"""Find and read the metadata of one DeepSpeed ZeRO checkpoint tag (pickles only, no weights).

Folder layout (DeepSpeed `runtime/engine.py`, `save_checkpoint`): `CKPT_DIR/latest` holds the
tag; `CKPT_DIR/<tag>/` holds, per data-parallel rank r, `[bf16_]zero_pp_rank_{r}_mp_rank_00_
optim_states.pt`, plus `mp_rank_00_model_states.pt` (ZeRO-1/2) or one
`zero_pp_rank_{r}_mp_rank_00_model_states.pt` per rank (ZeRO-3), plus, for MoE models,
`layer_<L>_expert_<E>_mp_rank_00_model_states.pt` per expert (`zerosafe.formats.deepspeed.moe`).
The keys each file holds are described in docs/formats.md ("DeepSpeed ZeRO"); this module
checks them, refuses what it does not support by name, and returns a `ZeroCheckpoint` the
planner turns into a plan.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from zerosafe.errors import (
    CheckpointFormatError,
    LayoutMismatchError,
    UnsupportedCheckpointError,
)
from zerosafe.formats.deepspeed.layout import FlatGroup, GroupParam
from zerosafe.formats.deepspeed.masters import (
    MASTER_DTYPES,
    SWAP_FOLDER,
    find_swap_files,
    is_master_swap,
    master_dtype_of,
    optimizer_name_of,
    swap_folder_url,
)
from zerosafe.formats.deepspeed.moe import (
    EXPERTS_INFIX,
    MoELayout,
    autoep_aliases,
    autoep_layer_of,
    check_moe_file_name,
    read_moe_layout,
)
from zerosafe.formats.deepspeed.save_identity import check_one_save
from zerosafe.formats.torch_legacy import open_torch_file
from zerosafe.formats.torch_zip import InertObject, TensorRecord, TorchZipFile
from zerosafe.io.storage import FileIdentity, Storage, join_url, normalize_url

__all__ = [
    "TESTED_DEEPSPEED_VERSIONS",
    "quick_identities",
    "FrozenParam",
    "LoadedFile",
    "ZeroCheckpoint",
    "find_tag_dir",
    "open_zero_checkpoint",
]

log = logging.getLogger(__name__)

TESTED_DEEPSPEED_VERSIONS = ("0.19.",)
"""Version prefixes of DeepSpeed whose checkpoints the test-suite converts."""

_OPTIM_RE = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_Z3_MODEL_RE = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")
_MODEL_RE = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")
_LAYER_RE = re.compile(r"^layer_(\d+)(-model_(\d+))?-model_states\.pt$")


@dataclass(kw_only=True)
class LoadedFile:
    """One checkpoint file: its identity, zip directory and unpickled (lazy) contents."""

    url: str
    role: str
    """`optim`, `model` or `expert` (an MoE expert file)."""
    rank: int
    """The data-parallel rank that wrote it (an expert file: the first rank holding its expert)."""
    identity: FileIdentity
    zip: TorchZipFile
    obj: dict[str, Any]


@dataclass(frozen=True, kw_only=True, slots=True)
class FrozenParam:
    """A parameter without fp32 master weights, saved in the training dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    source: str
    """`fragments` (ZeRO-2/3 `frozen_param_fragments`), `module` (the 16-bit module copy) or
    `expert file` (an MoE expert's file)."""
    pieces: tuple[tuple[int, TensorRecord], ...]
    """`(rank, tensor)` in rank order; concatenated and cut to `numel` they give the param."""
    url: str = ""
    """The file holding the pieces when it is not their rank's model states (an expert file)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SwapFile:
    """A ZeRO-3 master partition that NVMe offload keeps in a swap file, not the optim file."""

    url: str
    identity: FileIdentity
    rank: int
    numel: int
    dtype: str


@dataclass(kw_only=True)
class ZeroCheckpoint:
    """Everything the planner needs about one tag of a ZeRO checkpoint."""

    ckpt_url: str
    tag: str
    tag_url: str
    stage: int
    optimizer_kind: str
    """`zero` (DeepSpeed's ZeRO optimizer) or `bf16_optimizer` (`BF16_Optimizer`, ZeRO-1)."""
    world_size: int
    train_dtype: str
    ds_version: str | None
    optim_files: list[LoadedFile]
    model_files: list[LoadedFile]
    param_groups: list[list[tuple[str, tuple[int, ...]]]]
    """Per flat group (ZeRO-3: per sub-group), the params in flat order with their shapes, as
    rank 0's `param_shapes` names them (MoE: rank 0's local experts)."""
    fp32_partitions: list[list[TensorRecord]]
    """Per rank, per flat group of that rank's optimizer file, the saved fp32 partition."""
    frozen: list[FrozenParam]
    buffers: list[tuple[str, TensorRecord]]
    shared: dict[str, str]
    """Tied aliases: alias name -> the name of the tensor it shares memory with."""
    module_order: list[str]
    master_dtype: str = "float32"
    """The dtype of the master weights (the groups DeepSpeed names `fp32`): bfloat16 or float16
    with `bf16_master_weights_and_grads` / `fp16_master_weights_and_grads`."""
    optimizer_name: str = "unknown"
    """The wrapped torch optimizer, as `inspect` names it (`AdamW`, `Muon`), with its state."""
    empty_params: list[tuple[str, tuple[int, ...], str]] = field(default_factory=list)
    """Zero-element params `(name, shape, dtype)`: in the output with their shape and no data."""
    swapped: dict[tuple[int, int], SwapFile] = field(default_factory=dict)
    """NVMe offload: `(rank, sub-group)` -> the swap file holding that partition's masters."""
    pipeline_stage: int | None = None
    """The pipeline stage (`mp_rank_XX`) these files are, in a pipeline-parallel checkpoint
    (`zerosafe.formats.deepspeed.pipeline`): its buffers and frozen params are in the layer
    files, not in the model states."""
    flat_groups: list[FlatGroup] = field(default_factory=list)
    """ZeRO-1/2: every flat group, where its partitions are and their sizes. ZeRO-3: only for
    MoE, whose sub-groups are partitioned over different ranks (otherwise `param_groups`
    over all ranks)."""
    expert_files: list[LoadedFile] = field(default_factory=list)
    """MoE expert files, by layer and expert."""
    moe: MoELayout | None = None
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def files(self) -> list[LoadedFile]:
        return [*self.optim_files, *self.model_files, *self.expert_files]

    @property
    def trained_params(self) -> list[tuple[str, tuple[int, ...]]]:
        """Every param with fp32 masters: output name and shape (MoE: every expert, by its
        global name or, for AutoEP, as one logical tensor)."""
        if self.moe is not None:
            return list(self.moe.params.items())
        return [(name, shape) for group in self.param_groups for name, shape in group]

    @property
    def param_names(self) -> list[str]:
        return [name for name, _ in self.trained_params]


def _file_not_folder(url: str) -> str:
    """The error for a file given where a checkpoint folder is expected, with the fix."""
    folder, _, name = url.rpartition("/")
    if name.endswith(("_optim_states.pt", "_model_states.pt")):
        fix = f"give its tag folder '{folder or '.'}' (or the folder above, holding `latest`)"
    else:
        fix = f"to convert one torch.save file, use `zerosafe pt2st {url}`"
    return (
        f"{url}: is a file; expected a DeepSpeed checkpoint folder (holding `latest`) or a tag "
        f"folder (holding *_optim_states.pt); {fix}"
    )


def checkpoint_folder_names(storage: Storage, ckpt_url: str) -> list[str]:
    """The listing of the checkpoint folder `ckpt_url` (normalized).

    Raises:
        CheckpointFormatError: If it is a file, or not there.
    """
    if not storage.isdir(ckpt_url):
        if storage.exists(ckpt_url):
            raise CheckpointFormatError(_file_not_folder(ckpt_url))
        raise CheckpointFormatError(f"{ckpt_url}: no such checkpoint folder")
    return storage.listdir(ckpt_url)


def find_tag_dir(storage: Storage, ckpt_url: str, tag: str | None) -> tuple[str, str]:
    """Resolve `CKPT_DIR [--tag T]` to `(tag, tag folder URL)`.

    `ckpt_url` is the folder holding `latest`, or a tag folder itself.

    Raises:
        CheckpointFormatError: If no tag can be found, with what the folder does hold.
    """
    ckpt_url = normalize_url(ckpt_url)
    names = checkpoint_folder_names(storage, ckpt_url)
    if tag is not None:
        _check_tag_name(ckpt_url, tag, "`--tag`")
        tag_url = join_url(ckpt_url, tag)
        if not storage.isdir(tag_url):
            tags = [n for n in names if storage.isdir(join_url(ckpt_url, n))]
            raise CheckpointFormatError(
                f"{tag_url}: tag '{tag}' not found in {ckpt_url}; tags there: {tags or 'none'}"
            )
        return tag, tag_url
    if any(n.endswith("_model_states.pt") for n in names):
        return ckpt_url.rstrip("/").rsplit("/", 1)[-1], ckpt_url
    if "latest" in names:
        tag = _tag_from_latest(storage, ckpt_url)
        tag_url = join_url(ckpt_url, tag)
        if not storage.isdir(tag_url):
            raise CheckpointFormatError(
                f"{ckpt_url}/latest names tag '{tag}' but {tag_url} does not exist; is training "
                "still saving it? Pass --tag to convert another tag."
            )
        return tag, tag_url
    from zerosafe.formats.registry import formats_text

    subdirs = [n for n in names if storage.isdir(join_url(ckpt_url, n))]
    raise CheckpointFormatError(
        f"{ckpt_url}: no 'latest' file and no '*_model_states.pt' here, so this is not a "
        f"DeepSpeed checkpoint folder or tag folder. Folders inside: {subdirs or 'none'}; "
        "pass the folder that holds 'latest', or --tag TAG. zerosafe reads: "
        f"{formats_text()}."
    )


def _check_tag_name(ckpt_url: str, tag: str, where: str) -> None:
    """A tag names one folder inside the checkpoint folder, nothing else."""
    if (
        not tag
        or tag in (".", "..")
        or "/" in tag
        or "\\" in tag
        or "\0" in tag
        or "://" in tag
        or tag != tag.strip()
    ):
        raise CheckpointFormatError(
            f"{ckpt_url}: {where} names tag {tag!r}, which is not a folder name inside the "
            "checkpoint folder (a tag is one folder name, e.g. 'global_step1000'). Fix "
            "'latest', or pass --tag with the tag folder to convert."
        )


def _tag_from_latest(storage: Storage, ckpt_url: str) -> str:
    url = join_url(ckpt_url, "latest")
    raw = storage.read_bytes(url)
    try:
        tag = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        tag = repr(raw[:40])
    if not tag or len(raw) > 4096:
        raise CheckpointFormatError(
            f"{url}: expected the name of the tag to convert (e.g. 'global_step1000'), found "
            f"{'an empty file' if not tag else f'{len(raw)} bytes'}. Is training still saving? "
            "Pass --tag TAG to convert a tag folder that is complete."
        )
    _check_tag_name(ckpt_url, tag, "'latest'")
    return tag


@dataclass(kw_only=True)
class TagFiles:
    """A tag folder's checkpoint files by model-parallel rank (the `mp_rank_XX` of their names:
    the pipeline stage, or the tensor-parallel rank), from its listing alone."""

    tag_url: str
    names: list[str]
    optim: dict[int, dict[int, str]]
    """mp rank -> data-parallel rank -> optimizer file."""
    model: dict[int, dict[int, str]]
    """mp rank -> rank -> model states file (ZeRO-1/2: rank 0 only, `mp_rank_XX_model_states.pt`)."""
    layers: dict[int, str]
    """Pipeline layer index -> `layer_XX-model_states.pt` (written by a `PipelineModule`)."""
    experts: dict[tuple[int, int], str] = field(default_factory=dict)
    """MoE expert files (`layer_<L>_expert_<E>_mp_rank_00_model_states.pt`) by `(layer, expert)`."""

    @property
    def model_parallel(self) -> bool:
        """Whether the folder holds more than plain data parallelism (mp_rank_00 alone)."""
        return bool(self.layers) or any(mp != 0 for mp in (*self.optim, *self.model))


def _scan_files(storage: Storage, tag_url: str) -> TagFiles:
    """Classify the tag folder's files by model-parallel rank and rank, MoE expert files by
    layer and expert, and refuse layouts zerosafe does not read by name (MoE combined with
    pipeline or tensor parallelism among them)."""
    names = storage.listdir(tag_url)
    optim: dict[int, dict[int, str]] = {}
    model: dict[int, dict[int, str]] = {}
    z3_model: dict[int, dict[int, str]] = {}
    layers: dict[int, str] = {}
    experts: dict[tuple[int, int], str] = {}
    if "zero" in names or any(n.startswith("latest_universal") for n in names):
        raise UnsupportedCheckpointError(
            f"{tag_url}: this is a DeepSpeed universal checkpoint (a 'zero/' folder), not a ZeRO "
            "tag; give the folder itself, or its parent with --tag, to convert it as one."
        )
    for name in names:
        if m := _LAYER_RE.match(name):
            if m.group(2):
                raise UnsupportedCheckpointError(
                    f"{tag_url}/{name}: pipeline-parallel layer files split over tensor-parallel "
                    f"ranks ('-model_{m.group(3)}') are not supported yet: the checkpoint does not "
                    "record along which dimension each parameter is split across the "
                    "tensor-parallel ranks. zerosafe converts pipeline-parallel checkpoints "
                    "without tensor parallelism (layer_XX-model_states.pt)."
                )
            layers[int(m.group(1))] = join_url(tag_url, name)
            continue
        expert = check_moe_file_name(tag_url, name)
        if expert is not None:
            experts[expert] = join_url(tag_url, name)
            continue
        if m := _OPTIM_RE.match(name):
            rank, mp = int(m.group(2)), int(m.group(3))
            by_rank = optim.setdefault(mp, {})
            if rank in by_rank:
                raise CheckpointFormatError(
                    f"{tag_url}: two optimizer files for rank {rank}: "
                    f"'{by_rank[rank].rsplit('/', 1)[-1]}' and '{name}'; files from two runs "
                    "(bf16 and not) are mixed. Remove the stale one."
                )
            by_rank[rank] = join_url(tag_url, name)
        elif m := _Z3_MODEL_RE.match(name):
            z3_model.setdefault(int(m.group(2)), {})[int(m.group(1))] = join_url(tag_url, name)
        elif m := _MODEL_RE.match(name):
            model.setdefault(int(m.group(1)), {})[0] = join_url(tag_url, name)
    if not optim.get(0) and layers:
        raise UnsupportedCheckpointError(
            f"{tag_url}: pipeline-parallel layer files but no '*_optim_states.pt' files: a "
            "PipelineModule trained without ZeRO (stage 0, fp32 or fp16) keeps its weights in "
            "the layer files and the model states' `optimizer`, which zerosafe does not read "
            "yet. zerosafe converts pipeline checkpoints trained with ZeRO stage 1, or bf16 "
            "(BF16_Optimizer, which writes bf16_zero_pp_rank_* files)."
        )
    if not optim.get(0):
        raise CheckpointFormatError(
            f"{tag_url}: no '*_optim_states.pt' files; the fp32 master weights of a ZeRO "
            "checkpoint live there. Was the checkpoint saved without optimizer states, or is "
            "the copy incomplete?"
        )
    if not model.get(0) and not z3_model.get(0):
        raise CheckpointFormatError(
            f"{tag_url}: no '*_model_states.pt' file; it holds the parameter shapes. The copy "
            "is incomplete: copy the whole tag folder."
        )
    by_mp = {mp: z3_model.get(mp) or model.get(mp) or {} for mp in {*model, *z3_model}}
    found = TagFiles(
        tag_url=tag_url, names=names, optim=optim, model=by_mp, layers=layers, experts=experts
    )
    if experts and found.model_parallel:
        _refuse_moe_with_model_parallel(found)
    return found


def _refuse_moe_with_model_parallel(found: TagFiles) -> None:
    """MoE expert files beside pipeline layer files or `mp_rank_01`+ files: refused, naming
    both kinds of files."""
    expert = found.experts[min(found.experts)].rsplit("/", 1)[-1]
    more = len(found.experts) - 1
    experts = f"{expert} and {more} more" if more else expert
    if found.layers:
        other = found.layers[min(found.layers)].rsplit("/", 1)[-1]
        what = "pipeline-parallel layer files"
    else:
        mp = min(m for m in (*found.optim, *found.model) if m != 0)
        by_rank = found.optim.get(mp) or found.model[mp]
        other = by_rank[min(by_rank)].rsplit("/", 1)[-1]
        what = f"model-parallel rank files (mp_rank_{mp:02d})"
    raise UnsupportedCheckpointError(
        f"{found.tag_url}: MoE expert files ({experts}) beside "
        f"{what} ({other}): MoE combined with pipeline or tensor parallelism is not supported; "
        "zerosafe converts MoE checkpoints with data and expert parallelism only (mp_rank_00 "
        "files, no layer_XX-model_states.pt), and pipeline-parallel checkpoints without experts."
    )


def _refuse_moe_in_model_parallel_files(
    files: list[LoadedFile], pipeline_stage: int | None, model_parallel: int
) -> None:
    """An MoE layout read from a pipeline stage or model-parallel rank files (AutoEP ZeRO-3
    writes no expert files, so `_scan_files` cannot tell from the listing): refused."""
    names = [f.url.rsplit("/", 1)[-1] for f in files]
    mp_named = [
        n
        for n in names
        if (m := _OPTIM_RE.match(n) or _Z3_MODEL_RE.match(n) or _MODEL_RE.match(n))
        and int(m.groups()[-1]) != 0
    ]
    if pipeline_stage is None and model_parallel == 1 and not mp_named:
        return
    shown = mp_named[0] if mp_named else names[0]
    raise UnsupportedCheckpointError(
        f"{files[0].url.rsplit('/', 1)[0]}: an MoE checkpoint (expert param groups or AutoEP "
        f"metadata) whose files are model-parallel ({shown}"
        + (f", pipeline stage {pipeline_stage}" if pipeline_stage is not None else "")
        + "): MoE combined with pipeline or tensor parallelism is not supported; zerosafe "
        "converts MoE checkpoints with data and expert parallelism only (mp_rank_00 files)."
    )


def quick_identities(
    storage: Storage, ckpt_url: str, tag: str | None
) -> tuple[str, list[dict[str, Any]]]:
    """`(tag, identities)` of the files a conversion reads, from listings and stats only.

    The same files, in the same order, as `ZeroCheckpoint.files` for a valid checkpoint, so a
    job key computed from them matches a finished conversion's without opening any file.
    """
    tag, tag_url = find_tag_dir(storage, ckpt_url, tag)
    found = _scan_files(storage, tag_url)
    if found.model_parallel:
        from zerosafe.formats.deepspeed.model_parallel import model_parallel_urls

        urls = model_parallel_urls(found)
        return tag, [storage.identity(u).as_dict() for u in urls]
    optim, model = found.optim[0], found.model[0]
    urls = [optim[r] for r in sorted(optim)] + [model[r] for r in sorted(model)]
    urls += [found.experts[k] for k in sorted(found.experts)]
    # NVMe offload: the masters' swap files, as the reader orders them
    if SWAP_FOLDER in found.names:
        for r in sorted(optim):
            folder = swap_folder_url(tag_url, r)
            if storage.isdir(folder):
                urls += [
                    join_url(folder, n)
                    for n in sorted(storage.listdir(folder))
                    if is_master_swap(n)
                ]
    return tag, [storage.identity(u).as_dict() for u in urls]


def _load(storage: Storage, url: str, role: str, rank: int) -> LoadedFile:
    identity = storage.identity(url)
    source = storage.open_source(url)
    zf = open_torch_file(source)
    obj = zf.load()
    if not isinstance(obj, dict):
        raise CheckpointFormatError(
            f"{url}: expected a dict at the top of the pickle, got {type(obj).__name__}"
        )
    return LoadedFile(url=url, role=role, rank=rank, identity=identity, zip=zf, obj=obj)


def _stage_of(osd: Mapping[str, Any], url: str) -> tuple[int, str]:
    raw = osd.get("zero_stage")
    if raw is None:
        if "single_partition_of_fp32_groups" in osd:
            return 1, "bf16_optimizer"
        raise CheckpointFormatError(
            f"{url}: not a ZeRO checkpoint: 'optimizer_state_dict' has no 'zero_stage' and no "
            f"fp32 partitions (keys: {sorted(osd)})"
        )
    stage = raw.value if isinstance(raw, InertObject) else raw
    if stage not in (1, 2, 3):
        raise UnsupportedCheckpointError(
            f"{url}: ZeRO stage {stage!r} is not supported (stages 1, 2 and 3 are). Stage 0 "
            "checkpoints hold no partitioned fp32 weights; load them with DeepSpeed instead."
        )
    return int(stage), "zero"


def _world_size_of(f: LoadedFile, dp_world_size: Any) -> int:
    """The data-parallel world size an optimizer file was partitioned over: its
    `partition_count` (ZeRO-1/2: per param group). MoE expert groups are partitioned over fewer
    ranks (their expert-data-parallel group), so only the dense groups' count is the world
    size; with expert groups alone it is the model states' `dp_world_size`."""
    osd = f.obj["optimizer_state_dict"]
    partition_count = osd.get("partition_count")
    if isinstance(partition_count, int):
        return partition_count
    if not isinstance(partition_count, (list, tuple)) or not partition_count:
        raise CheckpointFormatError(f"{f.url}: unreadable 'partition_count' {partition_count!r}")
    counts = [int(c) for c in partition_count]
    if len(set(counts)) == 1:
        return counts[0]
    base = osd.get("base_optimizer_state")
    groups = base.get("param_groups") if isinstance(base, Mapping) else None
    moe = [bool(g.get("moe")) for g in groups] if isinstance(groups, (list, tuple)) else []
    if len(moe) != len(counts) or not any(moe):
        raise UnsupportedCheckpointError(
            f"{f.url}: param groups are partitioned over different world sizes ({counts}) and "
            "none is an MoE expert group (`moe: True` in the optimizer's param groups); this "
            "layout is not supported"
        )
    dense = {c for c, m in zip(counts, moe, strict=True) if not m}
    if len(dense) > 1:
        raise LayoutMismatchError(
            f"{f.url}: the dense param groups are partitioned over different world sizes "
            f"({sorted(dense)}); the file is not understood"
        )
    if dense:
        return dense.pop()
    if isinstance(dp_world_size, int):
        return dp_world_size
    return max(counts)


def _train_dtype(model: Mapping[str, Any], param_names: list[str]) -> str:
    module = model.get("module")
    if isinstance(module, Mapping):
        for name in param_names:
            t = module.get(name)
            if isinstance(t, TensorRecord):
                return t.dtype
    cfg = model.get("ds_config") or {}
    if isinstance(cfg, Mapping):
        for key, dtype in (("bf16", "bfloat16"), ("bfloat16", "bfloat16"), ("fp16", "float16")):
            section = cfg.get(key)
            if isinstance(section, Mapping) and section.get("enabled"):
                return dtype
    return "float32"


def _shapes(groups: Any, url: str) -> list[list[tuple[str, tuple[int, ...]]]]:
    if not isinstance(groups, (list, tuple)) or not groups:
        raise CheckpointFormatError(f"{url}: 'param_shapes' is missing or empty")
    out = []
    for group in groups:
        if not isinstance(group, Mapping):
            raise CheckpointFormatError(f"{url}: 'param_shapes' entries must be dicts")
        out.append([(str(k), tuple(int(s) for s in v)) for k, v in group.items()])
    return out


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def open_zero_checkpoint(
    storage: Storage, ckpt_url: str, *, tag: str | None = None, max_workers: int = 8
) -> Any:
    """Read and check the metadata of one ZeRO checkpoint tag. Reads pickles only.

    Args:
        storage: Where the checkpoint lives.
        ckpt_url: The folder holding `latest`, or a tag folder.
        tag: The tag to read; by default the one `latest` names.
        max_workers: Files read at once (the pickles of all ranks).

    Returns:
        A `ZeroCheckpoint`; for a pipeline-parallel checkpoint (`layer_XX-model_states.pt`
        files, one `mp_rank_XX` per stage) a `PipelineCheckpoint`
        (`zerosafe.formats.deepspeed.pipeline`), which holds one `ZeroCheckpoint` per stage.

    Raises:
        CheckpointFormatError: Missing, truncated or foreign files.
        UnsupportedCheckpointError: Layouts zerosafe does not convert yet.
        LayoutMismatchError: Ranks or sizes that disagree.
    """
    ckpt_url = normalize_url(ckpt_url)
    tag, tag_url = find_tag_dir(storage, ckpt_url, tag)
    found = _scan_files(storage, tag_url)
    if found.model_parallel:
        from zerosafe.formats.deepspeed.model_parallel import open_model_parallel

        return open_model_parallel(storage, ckpt_url, tag, found, max_workers=max_workers)
    optim_by_rank, model_by_rank, expert_files = _load_files(storage, found, max_workers)
    return open_rank_files(
        ckpt_url, tag, tag_url, storage, optim_by_rank, model_by_rank, expert_files=expert_files
    )


def open_rank_files(
    ckpt_url: str,
    tag: str,
    tag_url: str,
    storage: Storage,
    optim_by_rank: dict[int, LoadedFile],
    model_by_rank: dict[int, LoadedFile],
    *,
    expert_files: Mapping[tuple[int, int], LoadedFile] | None = None,
    pipeline_stage: int | None = None,
    model_parallel: int = 1,
) -> ZeroCheckpoint:
    """The `ZeroCheckpoint` of one data-parallel group's loaded files (the whole checkpoint, or
    one pipeline stage's `mp_rank_XX` files, whose model states record `model_parallel` as
    `mp_world_size`), with its MoE expert files by `(layer, expert)` (plain data parallelism
    only: `_scan_files` refuses experts beside model-parallel files)."""
    mp = pipeline_stage or 0
    expert_files = dict(expert_files or {})
    first_optim = optim_by_rank[min(optim_by_rank)]
    osd0 = first_optim.obj.get("optimizer_state_dict")
    if not isinstance(osd0, Mapping):
        raise CheckpointFormatError(
            f"{first_optim.url}: no 'optimizer_state_dict'; not a DeepSpeed optimizer file"
        )
    stage, optimizer_kind = _stage_of(osd0, first_optim.url)
    model0 = _model0(tag_url, stage, model_by_rank, mp)
    world_size = _world_size_of(first_optim, model0.obj.get("dp_world_size"))
    _check_world_sizes(model0, first_optim, world_size, model_parallel)
    _check_ranks(tag_url, "optimizer", optim_by_rank, world_size, stage, mp)
    if stage == 3:
        _check_ranks(tag_url, "model states", model_by_rank, world_size, stage, mp)
    optim_files = [optim_by_rank[r] for r in range(world_size)]
    model_files = [model_by_rank[r] for r in sorted(model_by_rank)]
    check_one_save(tag_url, optim_files, model_files)
    _check_optim_files_agree(optim_files, first_optim, stage, optimizer_kind, world_size)
    param_groups = _param_groups(model_files, stage)
    moe = read_moe_layout(
        tag_url=tag_url, stage=stage, world_size=world_size, optim_files=optim_files,
        model_files=model_files, param_groups=param_groups, expert_files=expert_files,
    )  # fmt: skip
    if moe is not None:
        _refuse_moe_in_model_parallel_files(
            [*optim_files, *model_files], pipeline_stage, model_parallel
        )
    ds_version = model0.obj.get("ds_version") or osd0.get("ds_version")
    ckpt = ZeroCheckpoint(
        ckpt_url=ckpt_url, tag=tag, tag_url=tag_url, stage=stage,
        optimizer_kind=optimizer_kind, world_size=world_size,
        train_dtype=_train_dtype(model0.obj, [n for g in param_groups for n, _ in g]),
        ds_version=str(ds_version) if ds_version is not None else None,
        optim_files=optim_files, model_files=model_files, param_groups=param_groups,
        fp32_partitions=[], frozen=[], buffers=[], shared={}, module_order=[], moe=moe,
        expert_files=[expert_files[k] for k in sorted(expert_files)],
        pipeline_stage=pipeline_stage,
    )  # fmt: skip
    if moe is not None:
        ckpt.notes += moe.notes
    ckpt.optimizer_name = optimizer_name_of(ckpt)
    _version_and_optimizer_notes(ckpt)
    _read_partitions(ckpt, storage)
    _read_module_side(ckpt)
    _master_notes(ckpt)
    return ckpt


def _master_notes(ckpt: ZeroCheckpoint) -> None:
    if ckpt.master_dtype != "float32":
        key = "bf16" if ckpt.master_dtype == "bfloat16" else "fp16"
        ckpt.notes.append(
            f"master weights are {ckpt.master_dtype} (`{key}_master_weights_and_grads`): the "
            "groups DeepSpeed names fp32 hold them, and the output is their exact cast (fp32 "
            f"output adds no precision; DeepSpeed's zero_to_fp32 returns them as {ckpt.master_dtype})"
        )
    if ckpt.empty_params:
        ckpt.notes.append(
            f"{len(ckpt.empty_params)} zero-element param(s) are in the output with their shape "
            "and no data: " + ", ".join(f"{n} {list(s)}" for n, s, _ in ckpt.empty_params)
        )


def _load_files(
    storage: Storage, found: TagFiles, max_workers: int
) -> tuple[dict[int, LoadedFile], dict[int, LoadedFile], dict[tuple[int, int], LoadedFile]]:
    """Every file of a plain data-parallel folder (mp_rank_00), its pickle read at once:
    optimizer and model states by rank, MoE expert files by `(layer, expert)`."""
    with ThreadPoolExecutor(max_workers=max_workers) as pool:
        model_futures = {
            r: pool.submit(_load, storage, u, "model", r) for r, u in found.model[0].items()
        }
        optim_futures = {
            r: pool.submit(_load, storage, u, "optim", r) for r, u in found.optim[0].items()
        }
        expert_futures = {
            k: pool.submit(_load, storage, u, "expert", 0) for k, u in found.experts.items()
        }
        model_by_rank = {r: f.result() for r, f in sorted(model_futures.items())}
        optim_by_rank = {r: f.result() for r, f in sorted(optim_futures.items())}
        experts = {k: f.result() for k, f in sorted(expert_futures.items())}
    return optim_by_rank, model_by_rank, experts


def _model0(
    tag_url: str, stage: int, model_by_rank: dict[int, LoadedFile], mp: int = 0
) -> LoadedFile:
    """Rank 0's model states, which hold the shapes; refused when it belongs to another run."""
    if (
        stage == 3
        and len(model_by_rank) == 1
        and 0 in model_by_rank
        and model_by_rank[0].url.endswith(f"/mp_rank_{mp:02d}_model_states.pt")
    ):
        raise CheckpointFormatError(
            f"{tag_url}: ZeRO-3 optimizer files but a ZeRO-1/2 'mp_rank_{mp:02d}_model_states.pt'; "
            "files from different runs are mixed"
        )
    model0 = model_by_rank.get(0)
    if model0 is None:
        raise CheckpointFormatError(
            f"{tag_url}: rank 0's model states file is missing "
            f"({f'zero_pp_rank_0_mp_rank_{mp:02d}_model_states.pt' if stage == 3 else f'mp_rank_{mp:02d}_model_states.pt'}); "
            "copy the whole tag folder."
        )
    return model0


def _check_world_sizes(
    model0: LoadedFile, first_optim: LoadedFile, world_size: int, model_parallel: int = 1
) -> None:
    dp_world_size = model0.obj.get("dp_world_size")
    mp_world_size = model0.obj.get("mp_world_size")
    if isinstance(mp_world_size, int) and mp_world_size > model_parallel:
        raise UnsupportedCheckpointError(
            f"{model0.url}: mp_world_size={mp_world_size}; tensor-parallel checkpoints are not "
            "supported yet: the checkpoint does not record how each parameter is split across "
            "the model-parallel ranks"
        )
    if isinstance(dp_world_size, int) and dp_world_size != world_size:
        raise LayoutMismatchError(
            f"{model0.url}: dp_world_size={dp_world_size} but {first_optim.url} was partitioned "
            f"over {world_size} ranks; files from runs with different world sizes are mixed. "
            "Use one run's complete tag folder."
        )


def _check_optim_files_agree(
    optim_files: list[LoadedFile],
    first_optim: LoadedFile,
    stage: int,
    optimizer_kind: str,
    world_size: int,
) -> None:
    """Every optimizer file has the first one's ZeRO stage, optimizer and world size."""
    for f in optim_files:
        osd = f.obj.get("optimizer_state_dict")
        if not isinstance(osd, Mapping):
            raise CheckpointFormatError(f"{f.url}: no 'optimizer_state_dict'")
        f_stage, f_kind = _stage_of(osd, f.url)
        if (f_stage, f_kind) != (stage, optimizer_kind):
            raise LayoutMismatchError(
                f"{f.url}: ZeRO stage {f_stage} ({f_kind}) but {first_optim.url} says stage "
                f"{stage} ({optimizer_kind}); files from different runs are mixed"
            )
        f_ws = _world_size_of(f, world_size)
        if f_ws != world_size:
            raise LayoutMismatchError(
                f"{f.url}: partitioned over {f_ws} ranks, but {first_optim.url} over "
                f"{world_size}; files from runs with different world sizes are mixed. Use one "
                "run's complete tag folder."
            )


def _param_groups(
    model_files: list[LoadedFile], stage: int
) -> list[list[tuple[str, tuple[int, ...]]]]:
    """`param_shapes` of rank 0 (ZeRO-3: the same in every rank's file), names unique."""
    model0 = model_files[0]
    param_groups = _shapes(model0.obj.get("param_shapes"), model0.url)
    if stage == 3:
        for f in model_files[1:]:
            if _shapes(f.obj.get("param_shapes"), f.url) != param_groups:
                raise LayoutMismatchError(
                    f"{f.url}: 'param_shapes' differ from {model0.url}; the rank files come "
                    "from different runs"
                )
    names_seen: set[str] = set()
    for group in param_groups:
        for name, _ in group:
            if name in names_seen:
                raise CheckpointFormatError(
                    f"{model0.url}: param '{name}' appears twice in 'param_shapes'"
                )
            names_seen.add(name)
    return param_groups


def _version_and_optimizer_notes(ckpt: ZeroCheckpoint) -> None:
    if ckpt.ds_version is None or not ckpt.ds_version.startswith(TESTED_DEEPSPEED_VERSIONS):
        ckpt.warnings.append(
            f"checkpoint written by DeepSpeed {ckpt.ds_version or 'of unknown version'}; zerosafe "
            f"is tested with DeepSpeed {', '.join(v + 'x' for v in TESTED_DEEPSPEED_VERSIONS)}. "
            "Run `zerosafe verify --against` on the output."
        )
    if ckpt.optimizer_kind == "bf16_optimizer":
        ckpt.notes.append(
            "optimizer is DeepSpeed's BF16_Optimizer (bf16 + ZeRO-1 + fp32 grad accumulation), "
            "which DeepSpeed's zero_to_fp32 refuses; its fp32 partitions are converted the ZeRO-1 way"
        )


def _check_ranks(
    tag_url: str,
    what: str,
    by_rank: Mapping[int, LoadedFile],
    world_size: int,
    stage: int,
    mp: int = 0,
) -> None:
    ranks = set(by_rank)
    missing = sorted(set(range(world_size)) - ranks)
    extra = sorted(ranks - set(range(world_size)))
    prefix = (
        "bf16_"
        if what == "optimizer"
        and any(f.url.rsplit("/", 1)[-1].startswith("bf16_") for f in by_rank.values())
        else ""
    )
    pattern = (
        prefix
        + f"zero_pp_rank_{{r}}_mp_rank_{mp:02d}_"
        + ("optim_states.pt" if what == "optimizer" else "model_states.pt")
    )
    if missing:
        raise CheckpointFormatError(
            f"{tag_url}: {what} file for rank(s) {missing} missing ({pattern.format(r=missing[0])}); "
            f"the checkpoint was saved by {world_size} ranks, so files for ranks 0..{world_size - 1} "
            "must all be present. Copy the whole tag folder."
        )
    if extra:
        names = ", ".join(by_rank[r].url.rsplit("/", 1)[-1] for r in extra)
        raise LayoutMismatchError(
            f"{tag_url}: stale {what} files for rank(s) {extra} ({names}); this checkpoint was "
            f"saved by {world_size} ranks, so these come from an older, larger run. Move them "
            "out of the tag folder and run again."
        )


def _read_partitions(ckpt: ZeroCheckpoint, storage: Storage) -> None:
    key = "fp32_flat_groups" if ckpt.stage == 3 else "single_partition_of_fp32_groups"
    for f in ckpt.optim_files:
        osd = f.obj["optimizer_state_dict"]
        groups = osd.get(key)
        if not isinstance(groups, (list, tuple)) or not groups:
            raise CheckpointFormatError(f"{f.url}: '{key}' is missing or empty")
        for t in groups:
            if not isinstance(t, TensorRecord) or t.dtype not in MASTER_DTYPES or len(t.shape) != 1:
                raise CheckpointFormatError(
                    f"{f.url}: '{key}' must hold 1-D master weights in "
                    f"{'/'.join(MASTER_DTYPES)}, found {t!r}"
                )
            if not t.is_contiguous():
                raise CheckpointFormatError(f"{f.url}: a '{key}' tensor is not contiguous")
        ckpt.fp32_partitions.append(list(groups))
    counts = {len(p) for p in ckpt.fp32_partitions}
    if len(counts) != 1:
        raise LayoutMismatchError(
            f"{ckpt.tag_url}: ranks hold different numbers of fp32 groups ({sorted(counts)}); "
            "files from different runs are mixed"
        )
    ckpt.master_dtype = master_dtype_of(ckpt, key)
    if ckpt.stage == 3 and ckpt.moe is not None:
        _zero3_moe_partitions(ckpt, ckpt.moe)
    elif ckpt.stage == 3:
        _zero3_partitions(ckpt, storage)
    else:
        _zero12_partitions(ckpt)


def _zero3_moe_partitions(ckpt: ZeroCheckpoint, moe: MoELayout) -> None:
    """AutoEP ZeRO-3: each sub-group partitioned over its own ranks, `ceil(numel / count)`
    elements of each param per rank; a partition saved empty (NVMe) is refused, as DeepSpeed
    refuses to save AutoEP ZeRO-3 with NVMe offload."""
    for group in moe.groups:
        count = len(group.parts)
        want = sum(-(-p.numel // count) for p in group.params)
        for r, h in group.parts:
            got = ckpt.fp32_partitions[r][h].numel
            if got != want:
                raise LayoutMismatchError(
                    f"{ckpt.optim_files[r].url}: fp32 sub-group {h} holds {got} elements but "
                    f"{group.label}, partitioned over {count} rank(s), needs exactly {want}; "
                    "was the checkpoint saved with another world size or another model?"
                )
    ckpt.flat_groups = list(moe.groups)


def _zero3_partitions(ckpt: ZeroCheckpoint, storage: Storage) -> None:
    """Every sub-group partition holds `sum(ceil(numel / world_size))` elements of its params,
    saved in the optim file or (NVMe offload) saved empty there and kept in a swap file."""
    if len(ckpt.fp32_partitions[0]) != len(ckpt.param_groups):
        if all(t.numel for groups in ckpt.fp32_partitions for t in groups):
            return  # the reader checks the total; sub-groups are only needed to place swaps
        raise LayoutMismatchError(
            f"{ckpt.model_files[0].url}: 'param_shapes' has {len(ckpt.param_groups)} sub-groups "
            f"but {ckpt.optim_files[0].url} has {len(ckpt.fp32_partitions[0])} fp32 partitions; "
            "was the checkpoint saved with another world size or another model?"
        )
    want = [
        sum(-(-_numel(shape) // ckpt.world_size) for _, shape in group)
        for group in ckpt.param_groups
    ]
    missing: dict[tuple[int, int], int] = {}
    for f in ckpt.optim_files:
        for g, t in enumerate(ckpt.fp32_partitions[f.rank]):
            if t.numel == 0 and want[g] > 0:
                missing[(f.rank, g)] = want[g]
            elif t.numel != want[g]:
                raise LayoutMismatchError(
                    f"{f.url}: fp32 partition {g} of rank {f.rank} holds {t.numel} elements but "
                    f"'param_shapes' partitioned over {ckpt.world_size} ranks needs exactly {want[g]}; "
                    "was the checkpoint saved with another world size or another model?"
                )
    if missing:
        ckpt.swapped = find_swap_files(storage, ckpt, missing)
        ckpt.notes.append(
            f"{len(missing)} master partition(s) offloaded to NVMe are read from their swap "
            f"files in {SWAP_FOLDER}/ (the optimizer files hold them empty)"
        )


def _zero12_partitions(ckpt: ZeroCheckpoint) -> None:
    """Every flat group with its partition size and alignment paddings. Without MoE a group's
    partitions are its index in every rank's file; MoE groups come from `ckpt.moe`."""
    num_groups = len(ckpt.fp32_partitions[0])
    if num_groups != len(ckpt.param_groups):
        raise LayoutMismatchError(
            f"{ckpt.model_files[0].url}: 'param_shapes' has {len(ckpt.param_groups)} groups but "
            f"{ckpt.optim_files[0].url} has {num_groups} fp32 partitions"
        )
    if ckpt.moe is not None:
        groups = ckpt.moe.groups
    else:
        groups = [
            FlatGroup(
                label=f"param group {g}", parts=tuple((r, g) for r in range(ckpt.world_size)),
                params=tuple(GroupParam(name=n, numel=math.prod(s)) for n, s in group),
            )
            for g, group in enumerate(ckpt.param_groups)
        ]  # fmt: skip
    ckpt.flat_groups = [_sized_group(ckpt, group) for group in groups]


def _sized_group(ckpt: ZeroCheckpoint, group: FlatGroup) -> FlatGroup:
    """`group` with its partition size (every partition but the last holds it; the last less
    its `group_paddings`) and the alignment padding after each param."""
    r0, h0 = group.parts[0]
    raw_paddings = ckpt.optim_files[r0].obj["optimizer_state_dict"].get("param_alignment_paddings")
    if raw_paddings is not None:
        pads = tuple(int(p) for p in raw_paddings[h0])
    else:
        pads = (0,) * len(group.params)
    saved = [ckpt.fp32_partitions[r][h].numel for r, h in group.parts]
    gpads = []
    for r, h in group.parts:
        gp = ckpt.optim_files[r].obj["optimizer_state_dict"].get("group_paddings")
        gpads.append(int(gp[h]) if isinstance(gp, (list, tuple)) and len(gp) > h else 0)
    if ckpt.optimizer_kind == "zero":
        sizes = {s + p for s, p in zip(saved, gpads, strict=True)}
    else:  # BF16_Optimizer saves whole partitions, padding included
        sizes = set(saved)
    if len(sizes) != 1:
        raise LayoutMismatchError(
            f"{ckpt.tag_url}: {group.label} partitions disagree (saved {saved}, paddings "
            f"{gpads}); files from different runs are mixed"
        )
    return dataclasses.replace(group, partition_numel=sizes.pop(), alignment_paddings=pads)


def _read_module_side(ckpt: ZeroCheckpoint) -> None:
    """Buffers, frozen params, tied aliases and the output order, from the model states."""
    model0 = ckpt.model_files[0]
    obj = model0.obj
    module = obj.get("module")
    module = module if isinstance(module, Mapping) else {}
    ckpt.module_order = [k for k in module if isinstance(k, str)]
    shared = _real_ties(ckpt, obj, module)
    if ckpt.moe is not None:
        ckpt.module_order = _with_experts(ckpt.module_order, ckpt.moe)
        known = set(ckpt.param_names) | set(obj.get("buffer_names") or ()) | set(shared)
        ckpt.moe.aliases = autoep_aliases(ckpt.moe, ckpt.module_order, known)
        if ckpt.moe.aliases:
            ckpt.notes.append(
                f"{len(ckpt.moe.aliases)} module key(s) name an AutoEP router a second time "
                "(AutoEP registers it under the Hugging Face block's name too; DeepSpeed records "
                "no tie): written as tied aliases: "
                + ", ".join(f"{a} -> {t}" for a, t in list(ckpt.moe.aliases.items())[:4])
                + (" ..." if len(ckpt.moe.aliases) > 4 else "")
            )
        shared = {**shared, **ckpt.moe.aliases}
    for alias, target in shared.items():
        seen = {alias}
        while target in shared and target not in seen:  # resolve alias chains to the owner
            seen.add(target)
            target = shared[target]
        ckpt.shared[str(alias)] = str(target)
    if ckpt.pipeline_stage is not None:
        return  # `module` is None: buffers and frozen params are in the layer files
    buffer_names = obj.get("buffer_names") or []
    for name in buffer_names:
        t = module.get(name)
        if isinstance(t, TensorRecord):
            ckpt.buffers.append((name, t))
        else:
            ckpt.notes.append(
                f"buffer '{name}' is not in the saved module (non-persistent); not converted"
            )
    frozen_shapes = obj.get("frozen_param_shapes")
    if isinstance(frozen_shapes, Mapping):
        for n, shape in frozen_shapes.items():
            if ckpt.moe is not None and EXPERTS_INFIX in str(n):
                continue  # rank 0's experts only, by local id: all are read from expert files
            if ckpt.moe is not None and autoep_layer_of(ckpt.moe.layers, str(n)):
                raise UnsupportedCheckpointError(
                    f"{model0.url}: AutoEP expert weight '{n}' is frozen; frozen AutoEP experts "
                    "are not supported (DeepSpeed itself refuses to save them at ZeRO-3)"
                )
            if _numel(tuple(int(x) for x in shape)) == 0:  # "not owned by the optimizer"
                ckpt.empty_params.append((str(n), tuple(int(x) for x in shape), ckpt.train_dtype))
            else:
                ckpt.frozen.append(_frozen_from_fragments(ckpt, n, shape))
    for name, rank, f, t in ckpt.moe.frozen if ckpt.moe is not None else ():
        if not t.is_contiguous():
            raise CheckpointFormatError(f"{f.url}: frozen expert param '{name}' is not contiguous")
        ckpt.frozen.append(
            FrozenParam(
                name=name, shape=tuple(t.shape), dtype=t.dtype, source="expert file",
                pieces=((rank, t),), url=f.url,
            )
        )  # fmt: skip
    recovered = _frozen_from_module(ckpt, module, buffer_names)
    if recovered:
        why = (
            "DeepSpeed saves no frozen_param_fragments for ZeRO-1"
            if frozen_shapes is None
            else "they are in neither 'param_shapes' nor 'frozen_param_shapes'"
        )
        ckpt.notes.append(
            f"{len(recovered)} frozen param(s) taken from the {ckpt.train_dtype} module weights in "
            f"{model0.url.rsplit('/', 1)[-1]} ({why}; DeepSpeed's converter drops them): "
            + ", ".join(recovered)
        )
    if ckpt.stage >= 2 and "frozen_param_shapes" in obj and frozen_shapes is None and not recovered:
        # DeepSpeed writes None here only when saving with `exclude_frozen_parameters=True`
        # (engine.py: save_frozen_param = partition_gradients and not exclude_frozen_parameters).
        ckpt.notes.append(
            "saved with DeepSpeed's `exclude_frozen_parameters`: frozen parameters are not in "
            "the checkpoint, so the output holds only the trained ones and buffers"
        )
    owners = set(ckpt.param_names) | {fp.name for fp in ckpt.frozen}
    owners |= {n for n, _, _ in ckpt.empty_params}
    for alias, target in ckpt.shared.items():
        if target not in owners:
            raise LayoutMismatchError(
                f"{model0.url}: tied param '{alias}' shares memory with '{target}', which is "
                "neither a trained nor a frozen param of this checkpoint"
            )


def _with_experts(order: list[str], moe: MoELayout) -> list[str]:
    """The module order with the expert params (which `module` leaves out) after the last key
    of their MoE layer, where a model's `state_dict()` has them."""
    out = list(order)
    for layer in moe.layers:
        head = layer.prefix + "."
        mine = [n for n in moe.expert_order if n.startswith(head)]
        at = max((i + 1 for i, k in enumerate(out) if k.startswith(head)), default=len(out))
        out[at:at] = mine
    return out


def _shape_of(
    obj: Mapping[str, Any], module: Mapping[str, Any], name: str, stage: int
) -> tuple[int, ...] | None:
    """A param's shape: `frozen_param_shapes` (ZeRO-2/3), `param_shapes`, or the module copy
    (ZeRO-1/2 only: ZeRO-3 keeps empty placeholders there)."""
    frozen = obj.get("frozen_param_shapes")
    if isinstance(frozen, Mapping) and name in frozen:
        return tuple(int(x) for x in frozen[name])
    for group in obj.get("param_shapes") or ():
        if isinstance(group, Mapping) and name in group:
            return tuple(int(x) for x in group[name])
    t = module.get(name)
    return tuple(t.shape) if isinstance(t, TensorRecord) and stage < 3 else None


def _real_ties(
    ckpt: ZeroCheckpoint, obj: Mapping[str, Any], module: Mapping[str, Any]
) -> dict[str, str]:
    """`shared_params` without the ties DeepSpeed infers between zero-element params: it
    compares `data_ptr()`, and every empty tensor has the same one, so `{empty_b: empty_a}`
    appears though the two share nothing (not even a shape)."""
    shared = obj.get("shared_params") or {}
    ties = {}
    for alias, target in shared.items():
        shapes = [_shape_of(obj, module, str(n), ckpt.stage) for n in (alias, target)]
        if any(sh is not None and _numel(sh) == 0 for sh in shapes):
            ckpt.notes.append(
                f"DeepSpeed records '{alias}' as tied to '{target}' because both are empty "
                f"(shapes {[list(sh) if sh is not None else None for sh in shapes]}); they "
                "share no memory, so each is written with its own shape (DeepSpeed's "
                "zero_to_fp32 gives the alias the target's tensor, shape included)"
            )
            continue
        ties[str(alias)] = str(target)
    return ties


def _frozen_from_fragments(ckpt: ZeroCheckpoint, name: str, shape: Any) -> FrozenParam:
    """A frozen param listed in `frozen_param_shapes`: its fragment in every model file."""
    shape = tuple(int(s) for s in shape)
    pieces = []
    for f in ckpt.model_files:
        fragments = f.obj.get("frozen_param_fragments") or {}
        t = fragments.get(name)
        if not isinstance(t, TensorRecord):
            raise CheckpointFormatError(
                f"{f.url}: 'frozen_param_fragments' lacks '{name}', listed in 'frozen_param_shapes'"
            )
        if not t.is_contiguous():
            raise CheckpointFormatError(f"{f.url}: frozen fragment '{name}' is not contiguous")
        pieces.append((f.rank, t))
    held = sum(t.numel for _, t in pieces)
    if held < _numel(shape):
        raise LayoutMismatchError(
            f"{ckpt.tag_url}: frozen param '{name}' has shape {list(shape)} "
            f"({_numel(shape)} elements) but its fragments hold {held}"
        )
    return FrozenParam(
        name=name, shape=shape, dtype=pieces[0][1].dtype, source="fragments", pieces=tuple(pieces)
    )


def _frozen_from_module(
    ckpt: ZeroCheckpoint, module: Mapping[str, Any], buffer_names: list[str]
) -> list[str]:
    """Module tensors that are no trained param, buffer, frozen param or alias: frozen params
    DeepSpeed saved only in the module copy (ZeRO-1). Adds them; returns their names."""
    model0 = ckpt.model_files[0]
    known = (
        set(ckpt.param_names)
        | {n for n, _ in ckpt.buffers}
        | {fp.name for fp in ckpt.frozen}
        | {n for n, _, _ in ckpt.empty_params}
        | set(ckpt.shared)
    )
    recovered = []
    for name in ckpt.module_order:
        t = module.get(name)  # expert params are in the order, not in `module`
        if name in known or name in buffer_names or not isinstance(t, TensorRecord):
            continue
        if t.numel == 0 and ckpt.stage < 3:  # ZeRO-1/2 leave zero-element params out of groups
            ckpt.empty_params.append((name, tuple(t.shape), t.dtype))
            continue
        if t.numel == 0 and ckpt.stage == 3:
            raise LayoutMismatchError(
                f"{model0.url}: module param '{name}' is neither in 'param_shapes' nor in "
                "'frozen_param_shapes' and ZeRO-3 saved only an empty placeholder for it, so "
                "its values are not in the checkpoint"
            )
        if not t.is_contiguous():
            raise CheckpointFormatError(f"{model0.url}: module tensor '{name}' is not contiguous")
        ckpt.frozen.append(
            FrozenParam(name=name, shape=t.shape, dtype=t.dtype, source="module", pieces=((0, t),))
        )
        recovered.append(name)
    return recovered
