"""The master weights of a ZeRO checkpoint: their dtype, where NVMe offload keeps them, and
which optimizer trained them (docs/formats.md, "DeepSpeed ZeRO").

- Low-precision masters. With `bf16: {bf16_master_weights_and_grads: true}` or
  `fp16: {fp16_master_weights_and_grads: true}` (DeepSpeed `runtime/base_optimizer.py`,
  `_configure_master_weights`), the groups still named `fp32` (`single_partition_of_fp32_groups`,
  `fp32_flat_groups`) hold bfloat16 or float16 tensors. The dtype is read off every partition,
  never assumed; a checkpoint whose partitions disagree is refused.
- NVMe offload (`zero_optimization.offload_optimizer.device: nvme`, ZeRO-3 only). A sub-group
  of at least `max(1 MiB, aio.block_size)` bytes of masters lives in a swap file, and its
  tensor in `fp32_flat_groups` is saved empty. `save_checkpoint` copies each rank's swap folder
  to `<tag>/offloaded_tensors/rank<NN>/` (gradients left out). The masters of a sub-group are
  `<first ds_id>_<last ds_id>.tensor.swp` (the ds_ids of the sub-group's first and last
  params), the raw elements in the master dtype from byte 0, padded to a multiple of
  `1024 * aio.intra_op_parallelism` bytes; its moments are `exp_avg-<same>.tensor.swp` and
  the like, never read. ds_ids number the params in `module.parameters()` order from a
  counter that is not saved, so the files are matched to sub-groups by finding the one
  offset that names a file of the right size for every swapped sub-group on every rank.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

from zerosafe.dtypes import dtype_info
from zerosafe.errors import LayoutMismatchError, UnsupportedCheckpointError
from zerosafe.formats.deepspeed.types import SwapFile, ZeroCheckpoint
from zerosafe.io.storage import Storage, join_url

__all__ = [
    "MASTER_DTYPES",
    "config_master_dtype",
    "find_swap_files",
    "is_master_swap",
    "master_dtype_of",
    "optimizer_name_of",
    "swap_folder_url",
]

MASTER_DTYPES = ("float32", "bfloat16", "float16")
"""The dtypes DeepSpeed keeps master weights in (`_configure_master_weights`)."""

SWAP_FOLDER = "offloaded_tensors"
_MASTER_SWAP_RE = re.compile(r"^(\d+)_(\d+)\.tensor\.swp$")
_SWAP_ALIGN_BYTES = 1024
"""`AIO_ALIGNED_BYTES`: swap files are padded to a multiple of this times intra_op_parallelism."""


def _config(ckpt: ZeroCheckpoint) -> Mapping[str, Any]:
    cfg = ckpt.model_files[0].obj.get("ds_config") if ckpt.model_files else None
    return cfg if isinstance(cfg, Mapping) else {}


def config_master_dtype(cfg: Mapping[str, Any]) -> str | None:
    """The master dtype the DeepSpeed config asks for, or None when it says nothing."""
    for section, key, dtype in (
        ("bf16", "bf16_master_weights_and_grads", "bfloat16"),
        ("bfloat16", "bf16_master_weights_and_grads", "bfloat16"),
        ("fp16", "fp16_master_weights_and_grads", "float16"),
    ):
        value = cfg.get(section)
        if isinstance(value, Mapping) and value.get("enabled") and value.get(key):
            return dtype
    return None


def master_dtype_of(ckpt: ZeroCheckpoint, key: str) -> str:
    """The one dtype of every saved (non-empty) master partition; the config's when all are
    empty (every sub-group swapped to NVMe).

    Raises:
        LayoutMismatchError: If partitions of one checkpoint hold different dtypes.
    """
    seen: dict[str, str] = {}
    for f, groups in zip(ckpt.optim_files, ckpt.fp32_partitions, strict=True):
        for g, t in enumerate(groups):
            if t.numel:
                seen.setdefault(t.dtype, f"{f.url.rsplit('/', 1)[-1]} group {g}")
    if len(seen) > 1:
        found = ", ".join(f"{d} ({where})" for d, where in seen.items())
        raise LayoutMismatchError(
            f"{ckpt.tag_url}: the master partitions '{key}' hold different dtypes: {found}; "
            "one save keeps all masters in one dtype, so files of different runs are mixed. "
            "Copy the whole tag folder of one save."
        )
    if seen:
        return next(iter(seen))
    return config_master_dtype(_config(ckpt)) or "float32"


def optimizer_name_of(ckpt: ZeroCheckpoint) -> str:
    """The torch optimizer DeepSpeed wrapped, from `ds_config` and the optimizer state's keys
    (`exp_avg`/`exp_avg_sq`: Adam; `momentum_buffer`: Muon or SGD)."""
    cfg = _config(ckpt).get("optimizer")
    name = str(cfg.get("type")) if isinstance(cfg, Mapping) and cfg.get("type") else ""
    osd = ckpt.optim_files[0].obj.get("optimizer_state_dict") if ckpt.optim_files else None
    keys: set[str] = set()
    if isinstance(osd, Mapping):
        base = osd.get("optimizer_state_dict", osd.get("base_optimizer_state"))
        state = base.get("state") if isinstance(base, Mapping) else base
        entries = state.values() if isinstance(state, Mapping) else state
        for entry in entries if isinstance(entries, (list, tuple, type({}.values()))) else ():
            if isinstance(entry, Mapping):
                keys |= {str(k) for k in entry if k != "step"}
    if not name:
        name = "Muon or SGD" if "momentum_buffer" in keys else "Adam" if "exp_avg" in keys else ""
    state_text = f"state {', '.join(sorted(keys))}" if keys else "no state saved"
    return f"{name or 'unknown optimizer'} ({state_text})"


def is_master_swap(name: str) -> bool:
    """`<ds_id>_<ds_id>.tensor.swp`: a sub-group's masters (not `exp_avg-...`, a moment)."""
    return _MASTER_SWAP_RE.match(name) is not None


def swap_folder_url(tag_url: str, rank: int) -> str:
    """`<tag>/offloaded_tensors/rank<NN>` (DeepSpeed: `"rank" + dp_index_to_str(rank)`)."""
    return join_url(join_url(tag_url, SWAP_FOLDER), f"rank{rank:02d}")


def _param_order(ckpt: ZeroCheckpoint) -> dict[str, int]:
    """Each param's position in `module.parameters()` order (the ds_id order): the module
    state's keys less buffers and tied aliases."""
    obj = ckpt.model_files[0].obj
    module = obj.get("module")
    buffers = set(obj.get("buffer_names") or ())
    shared = set((obj.get("shared_params") or {}).keys())
    names = [k for k in (module if isinstance(module, Mapping) else {}) if isinstance(k, str)]
    params = [n for n in names if n not in buffers and n not in shared]
    return {n: i for i, n in enumerate(params)}


def _listing(storage: Storage, folder: str) -> dict[tuple[int, int], str]:
    if not storage.isdir(folder):
        return {}
    out = {}
    for name in storage.listdir(folder):
        if m := _MASTER_SWAP_RE.match(name):
            out[(int(m.group(1)), int(m.group(2)))] = name
    return out


def find_swap_files(
    storage: Storage, ckpt: ZeroCheckpoint, missing: dict[tuple[int, int], int]
) -> dict[tuple[int, int], SwapFile]:
    """The swap file of every `(rank, sub-group) -> numel` saved empty.

    Raises:
        UnsupportedCheckpointError: When the swap files are missing or cannot be matched to
            the sub-groups without doubt; never guesses, never writes zeros instead.
    """
    ranks = sorted({r for r, _ in missing})
    listings = {r: _listing(storage, swap_folder_url(ckpt.tag_url, r)) for r in ranks}
    order = _param_order(ckpt)
    ids = {}
    for _, g in missing:
        group = ckpt.param_groups[g]
        ids[g] = (order.get(group[0][0]), order.get(group[-1][0]))
    bases = _bases(missing, listings, ids)
    if len(bases) != 1:
        raise _missing_swap_error(ckpt, missing, listings, ids, ambiguous=len(bases) > 1)
    base = bases.pop()
    itemsize = dtype_info(ckpt.master_dtype).itemsize
    found = {}
    for (r, g), numel in sorted(missing.items()):
        first, last = ids[g]
        assert first is not None and last is not None
        url = join_url(swap_folder_url(ckpt.tag_url, r), listings[r][(base + first, base + last)])
        identity = storage.identity(url)
        _check_swap_size(ckpt, url, identity.size_bytes, numel * itemsize)
        found[(r, g)] = SwapFile(
            url=url, identity=identity, rank=r, numel=numel, dtype=ckpt.master_dtype
        )
    return found


def _bases(
    missing: dict[tuple[int, int], int],
    listings: dict[int, dict[tuple[int, int], str]],
    ids: dict[int, tuple[int | None, int | None]],
) -> set[int]:
    """The ds_id offsets that name an existing swap file for every swapped sub-group."""
    if any(a is None or b is None for a, b in ids.values()):
        return set()
    (r0, g0), *_ = sorted(missing)
    first0 = ids[g0][0]
    assert first0 is not None
    candidates = {a - first0 for a, _ in listings.get(r0, {})}
    good = set()
    for base in candidates:
        if all(
            (base + ids[g][0], base + ids[g][1]) in listings.get(r, {})  # type: ignore[operator]
            for r, g in missing
        ):
            good.add(base)
    return good


def _check_swap_size(ckpt: ZeroCheckpoint, url: str, size: int, need: int) -> None:
    cfg = _config(ckpt).get("aio")
    parallel = cfg.get("intra_op_parallelism", 1) if isinstance(cfg, Mapping) else 1
    align = _SWAP_ALIGN_BYTES * max(int(parallel or 1), 1)
    padded = math.ceil(need / align) * align
    if not need <= size <= padded:
        raise LayoutMismatchError(
            f"{url}: expected {need} bytes of {ckpt.master_dtype} master weights (padded to "
            f"{padded}), found {size}; the swap file does not belong to this save. Copy the "
            "tag folder's offloaded_tensors/ of the same save."
        )


def _missing_swap_error(
    ckpt: ZeroCheckpoint,
    missing: dict[tuple[int, int], int],
    listings: dict[int, dict[tuple[int, int], str]],
    ids: dict[int, tuple[int | None, int | None]],
    *,
    ambiguous: bool,
) -> UnsupportedCheckpointError:
    (r, g), *_ = sorted(missing)
    optim = ckpt.optim_files[r].url.rsplit("/", 1)[-1]
    folder = swap_folder_url(ckpt.tag_url, r)
    found = sorted(listings.get(r, {}).values())
    want = f"<ds_id of {ckpt.param_groups[g][0][0]}>_<ds_id of {ckpt.param_groups[g][-1][0]}>"
    what = (
        "several sets of swap files fit, so which holds which sub-group is not certain"
        if ambiguous
        else f"its swap files are missing ({len(found)} master swap file(s) in {folder}: "
        f"{found[:6] or 'none'})"
    )
    return UnsupportedCheckpointError(
        f"{ckpt.optim_files[r].url}: {len(missing)} master partition(s) were offloaded to NVMe "
        f"(ZeRO-3 offload_optimizer device nvme; e.g. sub-group {g} of rank {r} is saved empty "
        f"in {optim}) and {what}. zerosafe needs {folder}/{want}.tensor.swp and the like for "
        "every rank, as DeepSpeed's save_checkpoint copies them into <tag>/offloaded_tensors/; "
        "copy that folder with the tag, or load the checkpoint with DeepSpeed and save it "
        "without NVMe offload. Nothing was written."
    )
