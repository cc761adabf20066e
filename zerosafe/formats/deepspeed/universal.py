"""DeepSpeed universal checkpoints (what `ds_to_universal.py` writes) as a format reader.

Layout, as DeepSpeed 0.19.8's `deepspeed/checkpoint/ds_to_universal.py` writes it (docs/formats.md,
"DeepSpeed universal"):

- `CKPT_DIR/latest_universal`: the name of the universal folder (written beside
  `--output_folder`, so usually in the ZeRO checkpoint's own folder, next to `latest`).
- `CKPT_DIR/<tag>/zero/<param name>/fp32.pt`: one param's master weights, whole. ZeRO-1/2:
  `{'param': tensor in the param's shape, 'cat_dim': 0}`; ZeRO-3: the bare flat tensor. ZeRO-1/2
  also write `{'param': module_tensor.float()}` for every entry of the module copy that has no
  master fragment: frozen params, buffers, tied aliases and zero-element params (upcast from
  their 16-bit or integer copies).
- `zero/<param name>/exp_avg.pt`, `exp_avg_sq.pt`, `step.pt` and `zero/optimizer_state.pt`: the
  optimizer state. Never opened.
- `<tag>/mp_rank_00_model_states.pt` (ZeRO-1/2) or every `zero_pp_rank_{r}_mp_rank_00_
  model_states.pt` (ZeRO-3), copied unchanged from the ZeRO tag: the param shapes, frozen
  params, buffers, tied aliases and module order, read as the ZeRO reader reads them
  (`zerosafe.formats.deepspeed.rank_files`, `module_side`).

Each trained param is one slot: the whole storage record of its `fp32.pt` (found from the zip
directory, the pickle and one local header; no tensor byte is read). Frozen params, buffers,
zero-element params and tied aliases come from the model states, so the output names, order,
dtypes and ties are those of converting the original ZeRO checkpoint.
"""

from __future__ import annotations

import functools
import hashlib
import math
import re
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from zerosafe.config import ConvertOptions
from zerosafe.errors import CheckpointFormatError, LayoutMismatchError, UnsupportedCheckpointError
from zerosafe.formats.base import (
    InspectFacts,
    LowpWitness,
    ReadLabels,
    SourceDescription,
    SourceFile,
    SourceLayout,
    SourceTensor,
)
from zerosafe.formats.deepspeed.files import (
    check_ranks,
    check_tag_name,
    checkpoint_folder_names,
    load_file,
)
from zerosafe.formats.deepspeed.lowp import zero_lowp_witness
from zerosafe.formats.deepspeed.masters import MASTER_DTYPES
from zerosafe.formats.deepspeed.module_side import read_module_side
from zerosafe.formats.deepspeed.rank_files import (
    TESTED_DEEPSPEED_VERSIONS,
    master_notes,
    read_param_groups,
    train_dtype_of,
)
from zerosafe.formats.deepspeed.save_identity import (
    SAMPLE_ELEMENTS,
    SAMPLE_PARAMS,
    check_one_save,
    lowp_copy_missing,
)
from zerosafe.formats.deepspeed.slots import (
    SlotBuilder,
    buffer_tensor,
    frozen_tensor,
    metadata_bytes_of,
)
from zerosafe.formats.deepspeed.types import LoadedFile, ZeroCheckpoint
from zerosafe.formats.torch_legacy import open_torch_file
from zerosafe.formats.torch_pickle import TensorRecord
from zerosafe.io.storage import (
    TAG_NAME_MAX_BYTES,
    FileIdentity,
    Storage,
    join_url,
    normalize_url,
)
from zerosafe.units import format_bytes

if TYPE_CHECKING:
    from zerosafe.plan.model import Plan

__all__ = [
    "FORMAT_NAME",
    "LATEST_UNIVERSAL",
    "UniversalCheckpoint",
    "UniversalReader",
    "find_universal_tag",
    "open_universal_checkpoint",
    "universal_layout",
]

FORMAT_NAME = "deepspeed-universal"
LATEST_UNIVERSAL = "latest_universal"
ZERO_FOLDER = "zero"
MASTER_FILE = "fp32.pt"
_NOT_PARAMS = {"optimizer_state.pt"}
"""Files (not param folders) ds_to_universal writes into `zero/`."""

_Z12_MODEL_RE = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")
_Z3_MODEL_RE = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")
_LAYER_RE = re.compile(r"^layer_\d+.*_model_states\.pt$")

_PARAM_KEYS = {"param", "cat_dim", "vocab_tensor", "sub_param_shape", "param_n_sub_params"}
"""Keys of a ZeRO-1/2 `fp32.pt` dict (DeepSpeed's `checkpoint/constants.py`). With one tensor
parallel rank the merges they describe (`cat_dim`, sub-params) leave the param as saved; vocab
padding is cut off, which the element count check catches. Any other key is refused."""
_AUTOEP_KEYS = ("ds_autoep_layers", "autoep_layers")


class UniversalReader:
    """DeepSpeed universal checkpoints: `CKPT_DIR/latest_universal` and folders holding
    `zero/<param>/fp32.pt` beside the copied model states."""

    name = FORMAT_NAME
    title = "DeepSpeed universal"
    looks_like = (
        "a folder holding `latest_universal` (and no `latest`), or a universal tag folder "
        "holding `zero/<param>/fp32.pt` and `*_model_states.pt` (ds_to_universal.py's output)"
    )
    selects = False
    parts_below: tuple[str, ...] = (FORMAT_NAME, "deepspeed")
    tag_folders = True

    def detect(self, storage: Storage, url: str) -> bool:
        url = normalize_url(url)
        if not storage.isdir(url):
            return False
        names = storage.listdir(url)
        if ZERO_FOLDER in names and storage.isdir(join_url(url, ZERO_FOLDER)):
            return True
        # A folder holding `latest` too is the ZeRO checkpoint ds_to_universal read: its
        # `latest` tag goes to the ZeRO reader (`--tag` picks the universal folder instead).
        return LATEST_UNIVERSAL in names and "latest" not in names

    def quick_identities(
        self, storage: Storage, url: str, tag: str | None
    ) -> tuple[str, list[FileIdentity]]:
        resolved, tag_url = find_universal_tag(storage, url, tag)
        scan = _scan(storage, tag_url)
        return resolved, list(scan.identities)

    def read(
        self, storage: Storage, url: str, *, tag: str | None, options: ConvertOptions
    ) -> SourceLayout:
        return universal_layout(open_universal_checkpoint(storage, url, tag=tag), options)

    def lowp_witness(
        self, storage: Storage, source: SourceDescription, *, layout: SourceLayout | None = None
    ) -> LowpWitness:
        """The 16-bit module copies of the ZeRO-1/2 save it was made from (`ReadsLowpCopies`)."""
        ckpt = layout.native if layout is not None else None
        if not isinstance(ckpt, ZeroCheckpoint):
            ckpt = (
                open_universal_checkpoint(storage, source.tag_url)
                if source.tag_url
                else open_universal_checkpoint(storage, source.checkpoint, tag=source.tag)
            ).zero
        return zero_lowp_witness(ckpt)


# -- finding the folder -------------------------------------------------------------------------


def find_universal_tag(storage: Storage, ckpt_url: str, tag: str | None) -> tuple[str, str]:
    """Resolve `CKPT_DIR [--tag T]` to `(tag, universal folder URL)`.

    `ckpt_url` is the folder holding `latest_universal`, or a universal folder itself.

    Raises:
        CheckpointFormatError: If no universal folder can be found, saying what is there.
    """
    ckpt_url = normalize_url(ckpt_url)
    names = checkpoint_folder_names(storage, ckpt_url)
    if tag is not None:
        check_tag_name(ckpt_url, tag, "`--tag`")
        tag_url = join_url(ckpt_url, tag)
        if not storage.isdir(join_url(tag_url, ZERO_FOLDER)):
            tags = [n for n in names if storage.isdir(join_url(ckpt_url, n, ZERO_FOLDER))]
            raise CheckpointFormatError(
                f"{tag_url}: no universal folder '{tag}' (holding zero/) in {ckpt_url}; "
                f"universal folders there: {tags or 'none'}"
            )
        return tag, tag_url
    if ZERO_FOLDER in names:
        return ckpt_url.rstrip("/").rsplit("/", 1)[-1], ckpt_url
    if LATEST_UNIVERSAL in names:
        tag = _tag_from_latest_universal(storage, ckpt_url)
        tag_url = join_url(ckpt_url, tag)
        if not storage.isdir(join_url(tag_url, ZERO_FOLDER)):
            raise CheckpointFormatError(
                f"{ckpt_url}/{LATEST_UNIVERSAL} names '{tag}' but {tag_url}/{ZERO_FOLDER} does not "
                "exist; did ds_to_universal.py finish (it writes latest_universal last)? Pass "
                "--tag with the universal folder to convert."
            )
        return tag, tag_url
    raise CheckpointFormatError(
        f"{ckpt_url}: no '{LATEST_UNIVERSAL}' file and no '{ZERO_FOLDER}/' folder here, so this "
        "is not a DeepSpeed universal checkpoint; pass the folder ds_to_universal.py wrote "
        "(--output_folder), or its parent holding latest_universal."
    )


def _tag_from_latest_universal(storage: Storage, ckpt_url: str) -> str:
    url = join_url(ckpt_url, LATEST_UNIVERSAL)
    raw = storage.read_small(
        url,
        limit_bytes=TAG_NAME_MAX_BYTES,
        what=f"`{LATEST_UNIVERSAL}` (the name of the universal folder)",
        fix="replace it with the folder's name, or pass --tag with the universal folder",
    )
    try:
        tag = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        tag = ""
    if not tag:
        raise CheckpointFormatError(
            f"{url}: expected the name of the universal folder (ds_to_universal.py's "
            f"--output_folder), found {'an empty file' if not raw.strip() else 'bytes not UTF-8'}. "
            "Pass --tag with the universal folder to convert."
        )
    check_tag_name(ckpt_url, tag, f"'{LATEST_UNIVERSAL}'")
    return tag


@dataclass(frozen=True, kw_only=True, slots=True)
class _ScanResult:
    """What the listings say about a universal folder (no file opened)."""

    model_urls: dict[int, str]
    """By data-parallel rank: one file (rank 0) for ZeRO-1/2, one per rank for ZeRO-3."""
    stage3: bool
    masters: dict[str, FileIdentity]
    """Folder (param) name -> its `zero/<name>/fp32.pt`, by name."""
    identities: list[FileIdentity]
    """Every `fp32.pt` (by name), then the model states (by rank): the job's identity."""


def _scan(storage: Storage, tag_url: str, max_workers: int = 8) -> _ScanResult:
    names = storage.listdir(tag_url)
    z12: dict[int, str] = {}
    z3: dict[int, str] = {}
    for name in names:
        if _LAYER_RE.match(name):
            raise UnsupportedCheckpointError(
                f"{tag_url}/{name}: a universal checkpoint of a pipeline-parallel or MoE run; "
                "not supported yet (zerosafe converts universal checkpoints of data-parallel runs)"
            )
        mp = None
        if m := _Z3_MODEL_RE.match(name):
            mp = int(m.group(2))
            z3[int(m.group(1))] = join_url(tag_url, name)
        elif m := _Z12_MODEL_RE.match(name):
            mp = int(m.group(1))
            z12[0] = join_url(tag_url, name)
        if mp:
            raise UnsupportedCheckpointError(
                f"{tag_url}/{name}: a universal checkpoint of a tensor-parallel run "
                f"(mp_rank_{mp:02d}); not supported yet: ds_to_universal merges tensor-parallel "
                "slices by name patterns that the copied model states (one per rank) do not "
                "describe. Convert a checkpoint saved with model parallel size 1."
            )
    if z12 and z3:
        raise CheckpointFormatError(
            f"{tag_url}: both mp_rank_00_model_states.pt (ZeRO-1/2) and "
            "zero_pp_rank_*_model_states.pt (ZeRO-3) are here; files of two conversions are "
            "mixed. Run ds_to_universal.py again into an empty folder."
        )
    if not z12 and not z3:
        raise CheckpointFormatError(
            f"{tag_url}: no '*_model_states.pt' file beside {ZERO_FOLDER}/; ds_to_universal.py "
            "copies the ZeRO tag's model states there, and they hold the param shapes, frozen "
            "params and buffers. The copy is incomplete: copy the whole universal folder."
        )
    zero_url = join_url(tag_url, ZERO_FOLDER)
    candidates = [n for n in storage.listdir(zero_url) if n not in _NOT_PARAMS]
    with ThreadPoolExecutor(max_workers=max_workers) as pool:
        found = list(pool.map(lambda n: _master_identity(storage, zero_url, n), candidates))
    masters = {n: i for n, i in zip(candidates, found, strict=True) if i is not None}
    model_urls = z3 or z12
    identities = [*masters.values(), *(storage.identity(model_urls[r]) for r in sorted(model_urls))]
    return _ScanResult(
        model_urls=model_urls, stage3=bool(z3), masters=masters, identities=identities
    )


def _master_identity(storage: Storage, zero_url: str, name: str) -> FileIdentity | None:
    try:
        return storage.identity(join_url(zero_url, name, MASTER_FILE))
    except (FileNotFoundError, NotADirectoryError, CheckpointFormatError):
        return None  # a folder without master weights: named in the error if a param needs it


# -- reading ------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class UniversalCheckpoint:
    """A universal checkpoint: its model states as a `ZeroCheckpoint` (no optimizer files;
    `optim_files` holds the `fp32.pt` files) and where each trained param's masters are."""

    storage: Storage
    zero: ZeroCheckpoint
    masters: dict[str, tuple[LoadedFile, TensorRecord]]
    """Trained param -> its `fp32.pt` and the tensor in it."""
    identities: list[FileIdentity]
    unread_masters: list[str]
    """Folders whose `fp32.pt` is not read: module copies ds_to_universal wrote for frozen
    params, buffers, tied aliases and zero-element params (upcast), or stray ones."""


def open_universal_checkpoint(
    storage: Storage, ckpt_url: str, *, tag: str | None = None, max_workers: int = 8
) -> UniversalCheckpoint:
    """Read and check the metadata of a universal checkpoint. Reads pickles only.

    Args:
        storage: Where the checkpoint lives.
        ckpt_url: The folder holding `latest_universal`, or a universal folder.
        tag: The universal folder to read inside `ckpt_url`; by default `latest_universal`'s.
        max_workers: Files read at once.

    Raises:
        CheckpointFormatError: Missing or foreign files (a trained param without `fp32.pt`).
        UnsupportedCheckpointError: Tensor-parallel, pipeline or MoE universal checkpoints, and
            ones converted from a ZeRO-1/2 checkpoint trained with `round_robin_gradients`.
        LayoutMismatchError: An `fp32.pt` that does not hold its param's elements.
    """
    ckpt_url = normalize_url(ckpt_url)
    tag, tag_url = find_universal_tag(storage, ckpt_url, tag)
    scan = _scan(storage, tag_url, max_workers)
    with ThreadPoolExecutor(max_workers=max_workers) as pool:
        model_by_rank = dict(
            zip(
                sorted(scan.model_urls),
                pool.map(
                    lambda r: load_file(storage, scan.model_urls[r], "model", r),
                    sorted(scan.model_urls),
                ),
                strict=True,
            )
        )
    model0 = model_by_rank[min(model_by_rank)]
    stage = 3 if scan.stage3 else _zero12_stage(model0)
    world_size = _world_size(model0, len(model_by_rank))
    if stage == 3:
        check_ranks(tag_url, "model states", model_by_rank, world_size, stage)
    model_files = [model_by_rank[r] for r in sorted(model_by_rank)]
    _check_parallelism(model0)
    check_one_save(tag_url, [], model_files)
    param_groups = read_param_groups(model_files, stage)
    param_names = [n for g in param_groups for n, _ in g]
    _check_round_robin(model0, stage)
    missing = [n for n in param_names if n not in scan.masters]
    if missing:
        shown = ", ".join(missing[:5]) + (
            f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        )
        raise CheckpointFormatError(
            f"{tag_url}/{ZERO_FOLDER}: no {MASTER_FILE} for {len(missing)} trained param(s) named "
            f"in 'param_shapes' of {model0.url.rsplit('/', 1)[-1]}: {shown}. ds_to_universal.py "
            "did not finish or the copy is incomplete: run it again, or copy the whole folder."
        )
    shapes = {n: s for g in param_groups for n, s in g}
    with ThreadPoolExecutor(max_workers=max_workers) as pool:
        loaded = list(
            pool.map(lambda n: _load_master(storage, scan.masters[n], n, shapes[n]), param_names)
        )
    masters = {n: (f, t) for n, (f, t) in zip(param_names, loaded, strict=True)}
    ds_version = model0.obj.get("ds_version")
    zero = ZeroCheckpoint(
        ckpt_url=ckpt_url, tag=tag, tag_url=tag_url, stage=stage, optimizer_kind="zero",
        world_size=world_size, train_dtype=train_dtype_of(model0.obj, param_names),
        ds_version=str(ds_version) if ds_version is not None else None,
        optim_files=[f for f, _ in loaded], model_files=model_files, param_groups=param_groups,
        fp32_partitions=[], frozen=[], buffers=[], shared={}, module_order=[],
    )  # fmt: skip
    zero.master_dtype = _master_dtype(masters)
    zero.optimizer_name = _optimizer_name(model0)
    read_module_side(zero)
    _notes(zero, masters)
    return UniversalCheckpoint(
        storage=storage,
        zero=zero,
        masters=masters,
        identities=scan.identities,
        unread_masters=sorted(set(scan.masters) - set(masters)),
    )


def _zero12_stage(model0: LoadedFile) -> int:
    """ZeRO-1 or 2, from the saved config (the optimizer files are not in a universal folder)."""
    cfg = model0.obj.get("ds_config")
    zero = cfg.get("zero_optimization") if isinstance(cfg, Mapping) else None
    stage = zero.get("stage") if isinstance(zero, Mapping) else None
    if stage in (1, 2):
        return int(stage)
    if stage in (0, False, None) and isinstance(zero, Mapping):
        raise UnsupportedCheckpointError(
            f"{model0.url}: saved with ZeRO stage {stage!r}; a universal checkpoint of a ZeRO "
            "stage 1, 2 or 3 run is expected"
        )
    return 1  # no config saved: stages 1 and 2 have the same files


def _world_size(model0: LoadedFile, files: int) -> int:
    ws = model0.obj.get("dp_world_size")
    return int(ws) if isinstance(ws, int) and ws > 0 else files


def _check_parallelism(model0: LoadedFile) -> None:
    """Refuse universal checkpoints of tensor-parallel, pipeline or AutoEP (MoE) runs."""
    obj = model0.obj
    mp = obj.get("mp_world_size")
    dims = obj.get("checkpoint_parallel_dimensions")
    tp = dims.get("tp_degree") if isinstance(dims, Mapping) else None
    pp = dims.get("pp_degree") if isinstance(dims, Mapping) else None
    if (isinstance(mp, int) and mp > 1) or (isinstance(tp, int) and tp > 1):
        raise UnsupportedCheckpointError(
            f"{model0.url}: saved with tensor parallelism (mp_world_size={mp}, tp_degree={tp}); "
            "universal checkpoints of tensor-parallel runs are not supported yet"
        )
    if (isinstance(pp, int) and pp > 1) or not isinstance(obj.get("module"), Mapping):
        raise UnsupportedCheckpointError(
            f"{model0.url}: saved by a pipeline-parallel run (pp_degree={pp}, no 'module'); "
            "universal checkpoints of pipeline-parallel runs are not supported yet"
        )
    if any(obj.get(k) is not None for k in _AUTOEP_KEYS):
        raise UnsupportedCheckpointError(
            f"{model0.url}: holds AutoEP (MoE expert) metadata; universal checkpoints of MoE runs "
            "are not supported yet"
        )


def _check_round_robin(model0: LoadedFile, stage: int) -> None:
    """ds_to_universal places ZeRO-1/2 params by `param_slice_mappings`, whose names do not
    match the partitions' contents under `round_robin_gradients` (docs/formats.md, "Traps"):
    its `fp32.pt` files then hold other params' elements. Seen on a real checkpoint."""
    cfg = model0.obj.get("ds_config")
    zero = cfg.get("zero_optimization") if isinstance(cfg, Mapping) else None
    if stage < 3 and isinstance(zero, Mapping) and zero.get("round_robin_gradients"):
        raise UnsupportedCheckpointError(
            f"{model0.url}: the ZeRO-{stage} run used `round_robin_gradients`, and "
            "ds_to_universal.py (which places params by 'param_slice_mappings', whose names "
            "do not match the partitions under round robin) wrote fp32.pt files holding other "
            "params' elements. Convert the original ZeRO checkpoint instead: zerosafe places "
            "its params by 'param_shapes'."
        )


def _load_master(
    storage: Storage, identity: FileIdentity, name: str, shape: tuple[int, ...]
) -> tuple[LoadedFile, TensorRecord]:
    """Open one `fp32.pt`: its zip directory, pickle and the local header of its storage
    record (so the slot needs no further read), then close it."""
    url = identity.url
    source = storage.open_source(url)
    try:
        zf = open_torch_file(source)
        raw = zf.load()
        t = _master_tensor(url, name, raw)
        numel = math.prod(shape)
        if t.numel != numel:
            vocab = isinstance(raw, Mapping) and raw.get("vocab_tensor")
            raise LayoutMismatchError(
                f"{url}: holds {t.numel} elements (shape {list(t.shape)}) but '{name}' has shape "
                f"{list(shape)} ({numel} elements) in 'param_shapes'"
                + (
                    "; ds_to_universal cut its vocabulary padding off (vocab_tensor), so it no "
                    "longer fits the model: not supported"
                    if vocab
                    else "; the universal folder and its model states come from different "
                    "checkpoints"
                )
            )
        if t.numel:
            zf.data_offset(zf.storage_record(t.storage.key))  # cached for the slot
    finally:
        source.close()
    obj = dict(raw) if isinstance(raw, Mapping) else {"param": raw}
    return LoadedFile(url=url, role="fp32", rank=0, identity=identity, zip=zf, obj=obj), t


def _master_tensor(url: str, name: str, raw: Any) -> TensorRecord:
    if isinstance(raw, Mapping):
        unknown = sorted(str(k) for k in raw if k not in _PARAM_KEYS)
        if unknown:
            raise UnsupportedCheckpointError(
                f"{url}: the fp32.pt of '{name}' holds {unknown} besides the param; an expert "
                "(MoE) param or a layout newer than DeepSpeed 0.19.8's is not supported yet"
            )
        t = raw.get("param")
    else:
        t = raw
    if not isinstance(t, TensorRecord):
        raise CheckpointFormatError(
            f"{url}: expected the master weights of '{name}' (a tensor, or a dict with 'param'), "
            f"found {type(t).__name__}"
        )
    if t.dtype not in MASTER_DTYPES:
        raise CheckpointFormatError(
            f"{url}: the master weights of '{name}' are {t.dtype}; expected one of "
            f"{', '.join(MASTER_DTYPES)}"
        )
    if not t.is_contiguous():
        raise CheckpointFormatError(
            f"{url}: the master weights of '{name}' are not contiguous (stride {list(t.stride)} "
            f"for shape {list(t.shape)}); ds_to_universal writes contiguous ones"
        )
    return t


def _master_dtype(masters: Mapping[str, tuple[LoadedFile, TensorRecord]]) -> str:
    dtypes = sorted({t.dtype for _, t in masters.values()})
    return dtypes[0] if len(dtypes) == 1 else "/".join(dtypes) if dtypes else "float32"


def _optimizer_name(model0: LoadedFile) -> str:
    cfg = model0.obj.get("ds_config")
    opt = cfg.get("optimizer") if isinstance(cfg, Mapping) else None
    kind = opt.get("type") if isinstance(opt, Mapping) else None
    return str(kind) if kind else "unknown"


def _notes(zero: ZeroCheckpoint, masters: Mapping[str, tuple[LoadedFile, TensorRecord]]) -> None:
    if zero.ds_version is None or not zero.ds_version.startswith(TESTED_DEEPSPEED_VERSIONS):
        zero.warnings.append(
            f"checkpoint trained with DeepSpeed {zero.ds_version or 'of unknown version'}; "
            "zerosafe is tested with universal checkpoints of DeepSpeed "
            f"{', '.join(v + 'x' for v in TESTED_DEEPSPEED_VERSIONS)}. Run `zerosafe verify "
            "--against` on the output."
        )
    copies = [n for n, (f, _) in masters.items() if zero.stage < 3 and "cat_dim" not in f.obj]
    if copies:
        zero.warnings.append(
            f"{len(copies)} trained param(s) have an fp32.pt that ds_to_universal.py made from "
            f"the module's {zero.train_dtype} copy (no master fragment was found for them), so "
            "they hold that copy upcast, not the master weights: " + ", ".join(copies[:8])
        )
    if zero.frozen:
        zero.notes.append(
            f"{len(zero.frozen)} frozen param(s) are read from the copied model states in "
            f"{zero.train_dtype}, as from the original checkpoint (ds_to_universal's fp32.pt of "
            "a frozen param, where it wrote one, is the same values upcast)"
        )
    master_notes(zero)


# -- the layout ---------------------------------------------------------------------------------


def universal_layout(uckpt: UniversalCheckpoint, options: ConvertOptions) -> SourceLayout:
    """Slots and fragments of every tensor: each trained param one slot, its whole
    `fp32.pt`; frozen params and buffers as the ZeRO reader places them."""
    ckpt = uckpt.zero
    builder = _FolderSlots(ckpt, identities=uckpt.identities)
    tensors: dict[str, SourceTensor] = {}
    for name, shape in (p for g in ckpt.param_groups for p in g):
        loaded, t = uckpt.masters[name]
        slot = builder.add(loaded, "fp32", f"fp32/{name}", t)
        tensors[name] = SourceTensor(
            name=name, shape=shape, dtype=t.dtype, role="param",
            fragments=((slot, 0, t.numel, 0),) if t.numel else (),
        )  # fmt: skip
    for name, shape, dtype in ckpt.empty_params:
        tensors[name] = SourceTensor(
            name=name, shape=shape, dtype=dtype, role="param", fragments=()
        )
    for fp in ckpt.frozen:
        tensors[fp.name] = (
            SourceTensor(name=fp.name, shape=fp.shape, dtype=fp.dtype, role="frozen", fragments=())
            if options.exclude_frozen
            else frozen_tensor(ckpt, builder, fp.name, fp.shape, fp.dtype, fp.pieces)
        )
    for name, t in ckpt.buffers:
        tensors[name] = buffer_tensor(ckpt, builder, name, t)
    return SourceLayout(
        format=FORMAT_NAME, where=ckpt.tag_url, tag=ckpt.tag, files=builder.files,
        slots=builder.resolve(), tensors=tensors, order=list(ckpt.module_order),
        aliases=dict(ckpt.shared), source=_source_block(uckpt), facts=_facts(uckpt),
        metadata_bytes=metadata_bytes_of(ckpt.files),
        notes=list(ckpt.notes), warnings=list(ckpt.warnings),
        checks=(functools.partial(check_masters_sample, uckpt),),
        native=ckpt, lowp_missing=lowp_copy_missing(ckpt),
    )  # fmt: skip


@dataclass
class _FolderSlots(SlotBuilder):
    """The ZeRO reader's slot builder over the universal folder's files: every `fp32.pt` (read
    or not: `quick_identities` lists them all, from listings), then the model states."""

    identities: list[FileIdentity] = field(default_factory=list)

    def __post_init__(self) -> None:
        model = {f.url: f for f in self.ckpt.model_files}
        for ident in self.identities:
            m = model.get(ident.url)
            self._file_index[ident.url] = len(self.files)
            self.files.append(
                SourceFile(
                    index=len(self.files), url=ident.url, role=m.role if m else "fp32",
                    rank=m.rank if m else 0, size_bytes=ident.size_bytes, version=ident.version,
                )
            )  # fmt: skip


@dataclass(frozen=True, kw_only=True, slots=True)
class UniversalSource:
    """A universal folder's own fields of the manifest's `source` block (`SourceDetails`)."""

    ORDER: ClassVar[tuple[str, ...]] = (
        "format", "checkpoint", "tag", "tag_url", "stage", "world_size", "train_dtype",
        "master_dtype", "optimizer_name", "ds_version", "num_params", "checkpoint_bytes",
        "files", "content_sha256",
    )  # fmt: skip

    stage: int
    world_size: int
    train_dtype: str
    master_dtype: str
    optimizer_name: str
    ds_version: str | None

    @property
    def order(self) -> tuple[str, ...]:
        return self.ORDER

    def fields(self) -> dict[str, object]:
        return {
            "stage": self.stage,
            "world_size": self.world_size,
            "train_dtype": self.train_dtype,
            "master_dtype": self.master_dtype,
            "optimizer_name": self.optimizer_name,
            "ds_version": self.ds_version,
        }

    def headline(self, common: SourceDescription) -> str:
        return f"(tag {common.tag}, ZeRO-{self.stage}, world size {self.world_size})"


def _source_block(uckpt: UniversalCheckpoint) -> SourceDescription:
    ckpt = uckpt.zero
    return SourceDescription(
        format=FORMAT_NAME,
        checkpoint=ckpt.ckpt_url,
        tag=ckpt.tag,
        tag_url=ckpt.tag_url,
        num_params=sum(math.prod(s) for g in ckpt.param_groups for _, s in g),
        checkpoint_bytes=sum(i.size_bytes for i in uckpt.identities),
        files=tuple(uckpt.identities),
        content_sha256=content_fingerprint(uckpt),
        details=UniversalSource(
            stage=ckpt.stage,
            world_size=ckpt.world_size,
            train_dtype=ckpt.train_dtype,
            master_dtype=ckpt.master_dtype,
            optimizer_name=ckpt.optimizer_name,
            ds_version=ckpt.ds_version,
        ),
    )


def _facts(uckpt: UniversalCheckpoint) -> InspectFacts:
    """`inspect`'s section (keys shared with the ZeRO reader's where they mean the same)."""
    ckpt = uckpt.zero
    total = sum(i.size_bytes for i in uckpt.identities)
    about = [
        f"Checkpoint  {ckpt.ckpt_url}  (DeepSpeed universal, folder {ckpt.tag})",
        f"  converted by ds_to_universal.py from a ZeRO stage {ckpt.stage} checkpoint, trained "
        f"in {ckpt.train_dtype}, data-parallel world size {ckpt.world_size}, DeepSpeed "
        f"{ckpt.ds_version or 'unknown'}",
        f"  master weights in {ckpt.master_dtype}, one fp32.pt per trained param "
        f"({len(uckpt.masters)}), optimizer {ckpt.optimizer_name}",
        f"  files: {len(uckpt.masters)} fp32.pt read + {len(ckpt.model_files)} model states"
        + (f" ({len(uckpt.unread_masters)} other fp32.pt not read)" if uckpt.unread_masters else "")
        + f", {format_bytes(total)} in all",
    ]
    fields: dict[str, object] = {
        "checkpoint": ckpt.ckpt_url,
        "tag": ckpt.tag,
        "zero_stage": ckpt.stage,
        "train_dtype": ckpt.train_dtype,
        "master_dtype": ckpt.master_dtype,
        "optimizer_name": ckpt.optimizer_name,
        "world_size": ckpt.world_size,
        "deepspeed_version": ckpt.ds_version,
        "zero_element_params": [n for n, _, _ in ckpt.empty_params],
        "fp32_files": len(uckpt.masters),
        "unread_fp32_files": uckpt.unread_masters,
        "files": {
            "fp32": len(uckpt.masters),
            "model_states": len(ckpt.model_files),
            "total_bytes": total,
        },
    }
    labels = ReadLabels(
        main="fp32.pt masters"
        if ckpt.master_dtype == "float32"
        else f"fp32.pt masters ({ckpt.master_dtype})",
        other="frozen params and buffers",
        metadata="pickles and zip directories",
        never="the moments (exp_avg.pt, exp_avg_sq.pt) and optimizer_state.pt are never read",
    )
    return InspectFacts(fields=fields, about=about, read_labels=labels)


def content_fingerprint(uckpt: UniversalCheckpoint) -> str:
    """SHA-256 over (file path in the folder, record name, size, CRC-32) of every record of
    every file read: from the zip directories alone, the same after copies and moves, and
    changed by any stored tensor (`verify --against` compares it)."""
    ckpt = uckpt.zero
    h = hashlib.sha256()
    prefix = ckpt.tag_url.rstrip("/") + "/"
    for f in ckpt.files:
        h.update(f.url.removeprefix(prefix).encode() + b"\0")
        for name, record in sorted(f.zip.records.items()):
            short = name.split("/", 1)[-1]
            h.update(f"{short}\0{record.size_bytes}\0{record.crc32}\n".encode())
    return h.hexdigest()


def check_masters_sample(uckpt: UniversalCheckpoint, plan: Plan | None = None) -> None:
    """ZeRO-1/2: the module's copy of the first params must equal their `fp32.pt` masters, cast
    as DeepSpeed casts them after each step. Catches a universal folder whose `fp32.pt` files
    and model states come from different saves, or whose params ds_to_universal misplaced.
    Reads a few hundred bytes.

    Raises:
        LayoutMismatchError: Naming the param, its `fp32.pt` and the model states file.
    """
    ckpt = uckpt.zero
    module = ckpt.model_files[0].obj.get("module") if ckpt.stage < 3 else None
    if not isinstance(module, Mapping):
        return
    import torch

    from zerosafe.dtypes import torch_dtype

    model = ckpt.model_files[0]
    checked = 0
    for name in ckpt.param_names:
        if checked >= SAMPLE_PARAMS:
            break
        loaded, t = uckpt.masters[name]
        copy = module.get(name)
        if not isinstance(copy, TensorRecord) or copy.numel != t.numel or not t.numel:
            continue
        if not copy.is_contiguous() or copy.dtype not in ("bfloat16", "float16", "float32"):
            continue
        count = min(t.numel, SAMPLE_ELEMENTS)
        start = loaded.zip.tensor_offset(t)
        source = uckpt.storage.open_source(loaded.url)  # closed after its metadata was read
        try:
            master = source.read_range(start, start + count * t.itemsize)
        finally:
            source.close()
        begin = model.zip.tensor_offset(copy)
        saved = model.zip.source.read_range(begin, begin + count * copy.itemsize)
        cast = torch.frombuffer(bytearray(master), dtype=torch_dtype(t.dtype))
        cast = cast.to(torch_dtype(copy.dtype)).contiguous()
        checked += 1
        if cast.view(torch.uint8).numpy().tobytes() != saved:
            raise LayoutMismatchError(
                f"{loaded.url}: the master weights of '{name}' differ from its {copy.dtype} copy in "
                f"{model.url.rsplit('/', 1)[-1]}, which DeepSpeed keeps equal; the fp32.pt files "
                "and the model states come from different saves, or ds_to_universal.py placed "
                "this param wrongly. Convert the original ZeRO checkpoint, or run "
                "ds_to_universal.py again into an empty folder."
            )
