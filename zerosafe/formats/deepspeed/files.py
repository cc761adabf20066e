"""The files of a DeepSpeed checkpoint folder: which tag, which files (from the listing
alone), and loading one file's pickle. Every DeepSpeed reader builds on these.

Folder layout (DeepSpeed `runtime/engine.py`, `save_checkpoint`): `CKPT_DIR/latest` holds the
tag; `CKPT_DIR/<tag>/` holds, per data-parallel rank r, `[bf16_]zero_pp_rank_{r}_mp_rank_00_
optim_states.pt`, plus `mp_rank_00_model_states.pt` (ZeRO-1/2) or one
`zero_pp_rank_{r}_mp_rank_00_model_states.pt` per rank (ZeRO-3), plus, for MoE models,
`layer_<L>_expert_<E>_mp_rank_00_model_states.pt` per expert (`zerosafe.formats.deepspeed.moe`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor

from zerosafe.errors import (
    CheckpointFormatError,
    LayoutMismatchError,
    UnsupportedCheckpointError,
)
from zerosafe.formats.deepspeed.engines import (
    explain_unreadable,
    nebula_placeholder_error,
    not_committed_error,
)
from zerosafe.formats.deepspeed.moe import check_moe_file_name
from zerosafe.formats.deepspeed.types import LoadedFile, TagFiles
from zerosafe.formats.torch_legacy import open_torch_file
from zerosafe.io.storage import TAG_NAME_MAX_BYTES, Storage, join_url, normalize_url

__all__ = [
    "LAYER_RE",
    "MODEL_RE",
    "OPTIM_RE",
    "Z3_MODEL_RE",
    "check_ranks",
    "check_tag_name",
    "checkpoint_folder_names",
    "find_tag_dir",
    "load_all",
    "load_file",
    "load_plain_files",
    "scan_files",
]


OPTIM_RE = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
Z3_MODEL_RE = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")
MODEL_RE = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")
LAYER_RE = re.compile(r"^layer_(\d+)(-model_(\d+))?-model_states\.pt$")


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
        CheckpointFormatError: If no tag can be found, with what the folder does hold
            (`lists_formats` set where it holds no DeepSpeed checkpoint at all).
    """
    ckpt_url = normalize_url(ckpt_url)
    names = checkpoint_folder_names(storage, ckpt_url)
    if tag is not None:
        check_tag_name(ckpt_url, tag, "`--tag`")
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
    subdirs = [n for n in names if storage.isdir(join_url(ckpt_url, n))]
    error = CheckpointFormatError(
        f"{ckpt_url}: no 'latest' file and no '*_model_states.pt' here, so this is not a "
        f"DeepSpeed checkpoint folder or tag folder. Folders inside: {subdirs or 'none'}; "
        "pass the folder that holds 'latest', or --tag TAG."
    )
    error.lists_formats = True  # the registry adds the formats zerosafe reads
    raise error


def check_tag_name(ckpt_url: str, tag: str, where: str) -> None:
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
    raw = storage.read_small(
        url,
        limit_bytes=TAG_NAME_MAX_BYTES,
        what="DeepSpeed's `latest` (the name of the tag to convert)",
        fix="replace it with the tag's name, or pass --tag TAG to convert a complete tag folder",
    )
    try:
        tag = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        tag = repr(raw[:40])
    if not tag:
        raise CheckpointFormatError(
            f"{url}: expected the name of the tag to convert (e.g. 'global_step1000'), found "
            "an empty file. Is training still saving? Pass --tag TAG to convert a tag folder "
            "that is complete."
        )
    check_tag_name(ckpt_url, tag, "'latest'")
    return tag


def scan_files(storage: Storage, tag_url: str) -> TagFiles:
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
        if m := LAYER_RE.match(name):
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
        if m := OPTIM_RE.match(name):
            rank, mp = int(m.group(2)), int(m.group(3))
            by_rank = optim.setdefault(mp, {})
            if rank in by_rank:
                raise CheckpointFormatError(
                    f"{tag_url}: two optimizer files for rank {rank}: "
                    f"'{by_rank[rank].rsplit('/', 1)[-1]}' and '{name}'; files from two runs "
                    "(bf16 and not) are mixed. Remove the stale one."
                )
            by_rank[rank] = join_url(tag_url, name)
        elif m := Z3_MODEL_RE.match(name):
            z3_model.setdefault(int(m.group(2)), {})[int(m.group(1))] = join_url(tag_url, name)
        elif m := MODEL_RE.match(name):
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


def load_file(storage: Storage, url: str, role: str, rank: int) -> LoadedFile:
    identity = storage.identity(url)
    source = storage.open_source(url)
    try:
        zf = open_torch_file(source)
        obj = zf.load()
    except CheckpointFormatError as e:  # another engine's file, or a save not finished?
        raise explain_unreadable(storage, source, e) from e
    placeholder = nebula_placeholder_error(url, obj)
    if placeholder is not None:
        raise placeholder
    if not isinstance(obj, dict):
        raise CheckpointFormatError(
            f"{url}: expected a dict at the top of the pickle, got {type(obj).__name__}"
        )
    return LoadedFile(url=url, role=role, rank=rank, identity=identity, zip=zf, obj=obj)


def load_plain_files(
    storage: Storage, found: TagFiles, max_workers: int
) -> tuple[dict[int, LoadedFile], dict[int, LoadedFile], dict[tuple[int, int], LoadedFile]]:
    """Every file of a plain data-parallel folder (mp_rank_00), its pickle read at once:
    optimizer and model states by rank, MoE expert files by `(layer, expert)`."""
    with ThreadPoolExecutor(max_workers=max_workers) as pool:
        model_futures = {
            r: pool.submit(load_file, storage, u, "model", r) for r, u in found.model[0].items()
        }
        optim_futures = {
            r: pool.submit(load_file, storage, u, "optim", r) for r, u in found.optim[0].items()
        }
        expert_futures = {
            k: pool.submit(load_file, storage, u, "expert", 0) for k, u in found.experts.items()
        }
        model_by_rank = {r: f.result() for r, f in sorted(model_futures.items())}
        optim_by_rank = {r: f.result() for r, f in sorted(optim_futures.items())}
        experts = {k: f.result() for k, f in sorted(expert_futures.items())}
    return optim_by_rank, model_by_rank, experts


def check_ranks(
    tag_url: str,
    what: str,
    by_rank: Mapping[int, LoadedFile],
    world_size: int,
    stage: int,
    mp: int = 0,
    storage: Storage | None = None,
) -> None:
    """Refuse missing or stale rank files; with `storage`, a missing file in a tag that
    `latest` does not name is a save not finished (an asynchronous writer's)."""
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
    if missing and storage is not None:
        unfinished = not_committed_error(
            storage, tag_url, f"{tag_url}: {what} file for rank(s) {missing} missing "
            f"({pattern.format(r=missing[0])})"
        )  # fmt: skip
        if unfinished is not None:
            raise unfinished
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


def load_all(
    storage: Storage, jobs: list[tuple[str, str, int]], max_workers: int
) -> dict[str, LoadedFile]:
    """`(url, role, rank)` -> loaded, the pickles read at once."""
    with ThreadPoolExecutor(max_workers=max_workers) as pool:
        futures = {
            url: pool.submit(load_file, storage, url, role, rank) for url, role, rank in jobs
        }
        return {url: f.result() for url, f in futures.items()}
