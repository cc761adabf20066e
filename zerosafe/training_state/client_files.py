"""The training client's own files beside a checkpoint, carried into a training-state output.

The HF Trainer saves, into `checkpoint-N/` beside DeepSpeed's `latest` and `global_stepN/`,
the state it resumes from besides the engine's: `trainer_state.json` (global step, epoch, log
history), `scheduler.pt`, `rng_state_R.pth` (one per rank; `rng_state.pth` from one
process), `scaler.pt` and `training_args.bin`, plus the model files (`config.json`, the
tokenizer). `Trainer.train(resume_from_checkpoint=OUT)` reads them from OUT itself
(transformers' `trainer.py`: `TRAINER_STATE_NAME`, `_load_rng_state`, `SCHEDULER_NAME`), so a
`--to universal` output without them resumes at step 0 with a fresh schedule: the user had to
copy them by hand.

They are copied as bytes, never unpickled (several are pickles), through the same checks as
the model files (`zerosafe.stages.model_files`: regular files inside the folder only, modes
never widened), and each is named in the summary with what another world size means for it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from zerosafe.io.storage import Storage, is_local, join_url
from zerosafe.stages.model_files import (
    copy_model_files,
    list_model_files,
    not_copied_because,
    sha256_of,
)

__all__ = [
    "CLIENT_FILES",
    "ClientFile",
    "carry_client_files",
    "check_carried",
    "find_client_files",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class ClientFile:
    """A kind of file the training client keeps beside the checkpoint."""

    pattern: str
    """Its name, as a full-match regex."""
    meaning: str
    """What it holds and what resuming at another world size means for it."""


CLIENT_FILES: tuple[ClientFile, ...] = (
    ClientFile(
        pattern=r"trainer_state\.json",
        meaning="the HF Trainer's global step, epoch and log history: the Trainer resumes its "
        "step count and schedule position from it; at another world size each step takes "
        "world size x per-device batch samples, so the epoch position shifts unless the "
        "global batch is kept",
    ),
    ClientFile(
        pattern=r"scheduler\.pt",
        meaning="the learning-rate scheduler's state (a pickle, copied unread): the same at "
        "any world size",
    ),
    ClientFile(
        pattern=r"scaler\.pt",
        meaning="the mixed-precision loss scaler's state: the same at any world size",
    ),
    ClientFile(
        pattern=r"training_args\.bin",
        meaning="the pickled TrainingArguments of the run (copied unread); the Trainer warns "
        "where the resumed run's arguments differ",
    ),
    ClientFile(
        pattern=r"rng_state\.pth",
        meaning="the random-number states of a one-process run: a resume at another world "
        "size reads `rng_state_R.pth` per rank instead",
    ),
    ClientFile(
        pattern=r"rng_state_\d+\.pth",
        meaning="one rank's random-number states, per rank of the saving run: at a larger "
        "world size the extra ranks find none and start fresh (the Trainer logs it); at a "
        "smaller one the extra files go unused; data order is then not reproduced exactly",
    ),
)
"""The client files carried, in copy order: the HF Trainer's (transformers 5)."""


def _kind_of(name: str) -> ClientFile | None:
    for kind in CLIENT_FILES:
        if re.fullmatch(kind.pattern, name):
            return kind
    return None


def find_client_files(storage: Storage, folder: str) -> tuple[list[str], list[str]]:
    """The client files (and model files) in `folder` to carry into the output, and a note
    for each: what it is and what another world size means for it.

    Only regular files inside `folder` are taken (a FIFO, a device or a link out of the
    folder is skipped with a note saying so), and nothing is opened here.

    Returns:
        `(names, notes)`: names relative to `folder`, in copy order.
    """
    listed = storage.listdir(folder)
    found = sorted((n for n in listed if _kind_of(n) is not None), key=_copy_order)
    names: list[str] = []
    notes: list[str] = []
    per_rank = []
    for name in found:
        why = not_copied_because(folder, name) if is_local(folder) else None
        if why is not None:
            notes.append(why)
            continue
        names.append(name)
        kind = _kind_of(name)
        assert kind is not None
        if kind.pattern == CLIENT_FILES[-1].pattern:
            per_rank.append(name)
            continue
        notes.append(f"carried `{name}`: {kind.meaning}")
    if per_rank:
        notes.append(
            f"carried {len(per_rank)} per-rank RNG file(s) (`{per_rank[0]}`...): "
            f"{CLIENT_FILES[-1].meaning}"
        )
    model_files, warnings = list_model_files(storage, folder)
    names += model_files
    notes += warnings
    if model_files:
        notes.append(f"carried the model files ({', '.join(model_files)})")
    return names, notes


def _copy_order(name: str) -> tuple[int, str]:
    kind = _kind_of(name)
    return (CLIENT_FILES.index(kind) if kind is not None else len(CLIENT_FILES), name)


def carry_client_files(
    storage: Storage, folder: str, names: list[str], out_url: str, *, chunk_bytes: int
) -> list[dict[str, Any]]:
    """Copy `names` from `folder` into `out_url`, byte for byte and unread.

    Returns:
        Per file: `file` (relative to both folders), `size_bytes` and `sha256`.
    """
    entries = copy_model_files(storage, folder, names, out_url, chunk_bytes=chunk_bytes)
    return [{"file": e.file, "size_bytes": e.size_bytes, "sha256": e.sha256} for e in entries]


def check_carried(
    storage: Storage, out_url: str, entries: list[dict[str, Any]]
) -> list[dict[str, str]]:
    """What differs in the carried files from what was copied (`verify`'s check): per file
    that differs, `file` and `error`."""
    problems = []
    for e in entries:
        url = join_url(out_url, e["file"])
        try:
            size, digest = sha256_of(storage, url)
        except OSError as missing:
            problems.append({"file": e["file"], "error": str(missing)})
            continue
        if (size, digest) != (e["size_bytes"], e["sha256"]):
            problems.append({
                "file": e["file"],
                "error": f"{url}: {size} bytes with SHA-256 {digest}; copied as "
                f"{e['size_bytes']} bytes with {e['sha256']}",
            })  # fmt: skip
    return problems
