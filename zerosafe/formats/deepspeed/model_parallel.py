"""DeepSpeed checkpoints whose files carry model-parallel ranks (`mp_rank_01` and up).

Three layouts share those names; `zerosafe.formats.deepspeed.reader.open_tag` and
`open_model_parallel` tell them apart (docs/formats.md, "Model-parallel ranks"):

- Pipeline parallelism: `layer_XX-model_states.pt` files beside one `mp_rank_XX` per stage
  (`zerosafe.formats.deepspeed.pipeline`).
- Sequence parallelism before DeepSpeed's checkpoint naming fix (Ulysses; DeepSpeed PR 8226):
  every rank's files are named with its sequence-parallel rank as `mp_rank_XX`, though the
  model is not split (`mp_world_size` 1). The data-parallel ranks (`zero_pp_rank_D`) still
  run 0..N-1 once each across the suffixes: converted as one data-parallel group.
- Tensor parallelism: the same data-parallel ranks again under each `mp_rank_XX`, the same
  param names, different contents, and nothing that says how each param is split. Refused,
  naming what is missing, unless every `mp_rank_XX` file is a byte-for-byte copy of the
  `mp_rank_00` one (every zip record's size and CRC-32 equal): replicated ranks, converted
  once.
"""

from __future__ import annotations

from collections.abc import Mapping

from zerosafe.errors import UnsupportedCheckpointError
from zerosafe.formats.deepspeed.files import load_all
from zerosafe.formats.deepspeed.rank_files import open_rank_files
from zerosafe.formats.deepspeed.types import LoadedFile, TagFiles, ZeroCheckpoint
from zerosafe.io.storage import Storage

__all__ = [
    "model_parallel_urls",
    "open_model_parallel",
    "parallel_dims",
    "tensor_parallel_refusal",
]

# ---------------------------------------------------------------------------------------------
# Which files, in which order (listing only)


def model_parallel_urls(found: TagFiles) -> list[str]:
    """The files a conversion of a checkpoint with `mp_rank_XX` files reads, in the order of
    the layout's files, from the listing alone (`quick_identities`)."""
    mps = sorted({*found.optim, *found.model})
    if found.layers:
        urls = []
        for mp in mps:
            optim, model = found.optim.get(mp, {}), found.model.get(mp, {})
            urls += [optim[r] for r in sorted(optim)] + [model[r] for r in sorted(model)]
        return urls + [found.layers[i] for i in sorted(found.layers)]
    renamed = _renamed_ranks(found)
    if renamed is not None:
        optim, model = renamed
    else:  # replicas: mp_rank_00's files are the ones converted
        optim, model = found.optim[0], found.model.get(0, {})
    return [optim[r] for r in sorted(optim)] + [model[r] for r in sorted(model)]


def _renamed_ranks(found: TagFiles) -> tuple[dict[int, str], dict[int, str]] | None:
    """Optimizer and model files by rank when every data-parallel rank appears under one
    `mp_rank_XX` only (sequence-parallel ranks named as model-parallel); else None."""
    optim: dict[int, str] = {}
    for by_rank in found.optim.values():
        for r, url in by_rank.items():
            if r in optim:
                return None
            optim[r] = url
    zero12 = any(
        url.rsplit("/", 1)[-1].startswith("mp_rank_")
        for by_rank in found.model.values()
        for url in by_rank.values()
    )
    if zero12:  # ZeRO-1/2: one model states file, which only data-parallel rank 0 writes
        return (optim, dict(found.model[0])) if set(found.model) == {0} else None
    model: dict[int, str] = {}
    for by_rank in found.model.values():
        for r, url in by_rank.items():
            if r in model:
                return None
            model[r] = url
    return optim, model


# ---------------------------------------------------------------------------------------------
# Opening


def open_model_parallel(
    storage: Storage, ckpt_url: str, tag: str, found: TagFiles, *, max_workers: int = 8
) -> ZeroCheckpoint:
    """Read a tag folder with `mp_rank_XX` files beyond `mp_rank_00` and no pipeline layer
    files (see the module docstring; a folder with layer files is `open_pipeline`'s).

    Raises:
        UnsupportedCheckpointError: Tensor parallelism, naming the information the checkpoint
            lacks.
        CheckpointFormatError, LayoutMismatchError: Missing or mixed files.
    """
    renamed = _renamed_ranks(found)
    if renamed is not None:
        return _open_renamed(storage, ckpt_url, tag, found, renamed, max_workers)
    return _open_replicas(storage, ckpt_url, tag, found, max_workers)


def parallel_dims(f: LoadedFile) -> tuple[int | None, int | None]:
    """`(pp_degree, tp_degree)` DeepSpeed 0.19 records in the model states (None: older)."""
    dims = f.obj.get("checkpoint_parallel_dimensions")
    if not isinstance(dims, Mapping):
        return None, None
    pp, tp = dims.get("pp_degree"), dims.get("tp_degree")
    return (pp if isinstance(pp, int) else None), (tp if isinstance(tp, int) else None)


def tensor_parallel_refusal(url: str, mp: int, why: str) -> UnsupportedCheckpointError:
    return UnsupportedCheckpointError(
        f"{url}: tensor-parallel checkpoints (mp_rank_{mp:02d}) are not supported yet: {why}. "
        "The checkpoint does not record how each parameter is split across the model-parallel "
        "ranks (along which dimension, or replicated): no AutoTP or universal-checkpoint "
        "metadata (`universal_checkpoint_info`). Merge the tensor-parallel shards with the "
        "training framework's own tool, or convert a checkpoint saved with model parallel "
        "size 1."
    )


# ---------------------------------------------------------------------------------------------
# Sequence-parallel ranks named as model-parallel, and replicated ranks


def _open_renamed(
    storage: Storage,
    ckpt_url: str,
    tag: str,
    found: TagFiles,
    renamed: tuple[dict[int, str], dict[int, str]],
    max_workers: int,
) -> ZeroCheckpoint:
    optim_urls, model_urls = renamed
    jobs = [(u, "optim", r) for r, u in optim_urls.items()]
    jobs += [(u, "model", r) for r, u in model_urls.items()]
    loaded = load_all(storage, jobs, max_workers)
    mps = sorted(mp for mp in {*found.optim, *found.model} if mp != 0)
    for f in loaded.values():
        if f.role != "model":
            continue
        _, tp = parallel_dims(f)
        mp_world_size = f.obj.get("mp_world_size")
        recorded = [v for v in (tp, mp_world_size) if isinstance(v, int)]
        if any(v > 1 for v in recorded):
            raise tensor_parallel_refusal(
                f.url,
                mps[0],
                f"the model states record a model-parallel world size of {max(recorded)}",
            )
    ckpt = open_rank_files(
        ckpt_url, tag, found.tag_url, storage,
        {r: loaded[u] for r, u in sorted(optim_urls.items())},
        {r: loaded[u] for r, u in sorted(model_urls.items())},
    )  # fmt: skip
    ckpt.notes.append(
        f"the rank files are named with mp_rank_00..mp_rank_{mps[-1]:02d} though the model was not "
        "split (mp_world_size 1, every data-parallel rank 0.."
        f"{ckpt.world_size - 1} once): sequence-parallel ranks named as model-parallel, as "
        "DeepSpeed did before its Ulysses checkpoint naming fix; converted as one data-parallel "
        f"group of {ckpt.world_size} ranks"
    )
    return ckpt


def _records(f: LoadedFile) -> dict[str, tuple[int, int | bytes]]:
    """Every zip record of a file by its name inside the archive: `(size, CRC-32)`, or
    `(size, bytes)` for records without a CRC (legacy torch files)."""
    out: dict[str, tuple[int, int | bytes]] = {}
    for name, record in f.zip.records.items():
        short = name.split("/", 1)[-1]  # the archive folder is the save's file stem
        if record.has_crc:
            out[short] = (record.size_bytes, record.crc32)
        else:
            out[short] = (record.size_bytes, f.zip.read_record(record, check_crc=False))
    return out


def _open_replicas(
    storage: Storage, ckpt_url: str, tag: str, found: TagFiles, max_workers: int
) -> ZeroCheckpoint:
    """The same data-parallel ranks under several `mp_rank_XX`: converted once when every
    file is a copy of mp_rank_00's, else refused as tensor parallelism."""
    mps = sorted(mp for mp in {*found.optim, *found.model} if mp != 0)
    base = {("optim", r): u for r, u in found.optim[0].items()}
    base |= {("model", r): u for r, u in found.model.get(0, {}).items()}
    for mp in mps:
        mine = {("optim", r): u for r, u in found.optim.get(mp, {}).items()}
        mine |= {("model", r): u for r, u in found.model.get(mp, {}).items()}
        if set(mine) != set(base):
            url = next(iter(sorted(mine.values()) or sorted(base.values())))
            lacks = sorted(base.keys() - mine.keys())
            raise tensor_parallel_refusal(
                url, mp,
                f"mp_rank_{mp:02d} has {len(mine)} file(s) but mp_rank_00 has {len(base)}"
                + (f" (mp_rank_{mp:02d} lacks the {lacks[0][0]} file of rank {lacks[0][1]})" if lacks else ""),
            )  # fmt: skip
    jobs = [(u, role, r) for (role, r), u in base.items()]
    for mp in mps:
        jobs += [(found.optim[mp][r] if role == "optim" else found.model[mp][r], role, r)
                 for role, r in base]  # fmt: skip
    loaded = load_all(storage, jobs, max_workers)
    for f in loaded.values():
        _, tp = parallel_dims(f)
        if tp is not None and tp > 1:
            raise tensor_parallel_refusal(
                f.url, mps[0], f"the model states record tensor-parallel degree {tp}"
            )
    for mp in mps:
        for role, r in sorted(base):
            ref = loaded[base[(role, r)]]
            other = loaded[found.optim[mp][r] if role == "optim" else found.model[mp][r]]
            a, b = _records(ref), _records(other)
            differ = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
            if differ:
                raise tensor_parallel_refusal(
                    other.url,
                    mp,
                    f"its contents differ from {ref.url.rsplit('/', 1)[-1]} (record "
                    f"'{differ[0]}' and {len(differ) - 1} more), so the model-parallel ranks "
                    "hold different parts of the same params",
                )
    ckpt = open_rank_files(
        ckpt_url, tag, found.tag_url, storage,
        {r: loaded[u] for (role, r), u in sorted(base.items()) if role == "optim"},
        {r: loaded[u] for (role, r), u in sorted(base.items()) if role == "model"},
        model_parallel=1 + mps[-1],
    )  # fmt: skip
    ckpt.notes.append(
        f"mp_rank_01..mp_rank_{mps[-1]:02d} are byte-for-byte copies of mp_rank_00's files "
        "(every zip record's size and CRC-32 equal): replicated ranks, not tensor-parallel "
        "shards (sequence-parallel ranks named as model-parallel); converted once, from mp_rank_00"
    )
    return ckpt
