"""Finding the save inside the folder a user has, from listings only.

Training stacks write the weights one level below the folder a user thinks of as "the
checkpoint": the HF Trainer with accelerate FSDP2 writes `checkpoint-N/pytorch_model_fsdp_0/`
(a DCP folder) beside `optimizer_0/`, `config.json` and the tokenizer; OLMo-core writes
`stepN/model_and_optim/`; verl `global_step_N/actor/`. When no reader claims the folder given,
each reader's `detect` is asked about its immediate subfolders: exactly one save there is
converted (and named in a note), several are refused with their list, and a folder holding
DCP chunk files without the global `.metadata` is refused saying what is missing. When a
reader does claim the folder, its subfolders are still asked about saves of the other formats
(`refuse_saves_beside`): a Trainer's `checkpoint-4/` holding DeepSpeed's `latest` and tag and
also `pytorch_model_fsdp_0/` is two saves, refused with their list.

The trainer's checkpoint folder above the steps works too where it says which step is the
latest: verl's trainer and ByteCheckpoint write `latest_checkpointed_iteration.txt` (the step
number N) beside `global_step_N/`; that step's save is converted (`find_latest_step`).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from dataclasses import dataclass

from zerosafe.config import ConvertOptions
from zerosafe.errors import CheckpointFormatError
from zerosafe.formats.base import FormatReader, SourceLayout
from zerosafe.formats.optimizer_state import is_optimizer_state
from zerosafe.io.storage import Storage, join_url

__all__ = [
    "IGNORED_SUBFOLDER",
    "LATEST_STEP_FILE",
    "OUTPUT_MARKER",
    "OUTPUT_WORK_DIR",
    "Found",
    "find_latest_step",
    "find_nested",
    "is_zerosafe_output",
    "refuse_optimizer_only",
    "refuse_partial_dcp",
    "refuse_saves_beside",
]

IGNORED_SUBFOLDER = re.compile(r"^(optimizer(_\d+)?|\..*)$")
"""Subfolders never taken for the save: accelerate's `save_fsdp_optimizer` writes the
optimizer state as its own DCP folder, `optimizer_N` (`OPTIMIZER_NAME`), beside the model's
`pytorch_model_fsdp_N`; it holds no weights (its keys are `optimizer.state.*` and
`optimizer.param_groups.*`), so it is no candidate. Hidden folders neither. A folder of
optimizer state under another name is a second candidate, so it is listed, never converted
silently."""
OUTPUT_WORK_DIR = ".zerosafe-work"
"""`zerosafe.stages.output.WORK_DIR_NAME`: the work folder of a zerosafe output (the stages
import the formats, not the other way round; tests/formats/safetensors_in checks they agree)."""
OUTPUT_MARKER = "zerosafe-complete.json"
"""`zerosafe.stages.output.MARKER_NAME`: written last into a finished zerosafe output."""
_PER_RANK = re.compile(r"(^|[_-])rank[_-]?\d+$")
_DISTCP = re.compile(r"^__\d+_\d+\.distcp$")
_DCP_METADATA = ".metadata"
LATEST_STEP_FILE = "latest_checkpointed_iteration.txt"
"""The latest step's number, as verl's trainer and ByteCheckpoint (`bytecheckpoint.save` with
`global_steps`) write it beside `global_step_N/`."""
_LATEST_MAX_BYTES = 64


@dataclass(frozen=True, kw_only=True, slots=True)
class Found:
    """Where the save is: the folder read and its reader, and the folder the user gave."""

    reader: FormatReader
    url: str
    """The folder read (and named in the job's identities)."""
    given: str
    """The folder the user passed; `url` itself unless the save was found one level down."""
    beside: tuple[str, ...] = ()
    """The other subfolders of the folder holding `url` (hidden ones aside), which are not
    read: optimizer state (`IGNORED_SUBFOLDER`) and folders no reader claims
    (ByteCheckpoint's `extra_state/`, a trainer's `huggingface/`)."""
    why: str = ""
    """How `url` was chosen, for the note; "" for `the only save in <given>`."""

    @property
    def nested(self) -> bool:
        return self.url != self.given

    @property
    def note(self) -> str:
        """`converting X/sub (the only save in X)`, for the plan's notes; "" if not nested."""
        if not self.nested:
            return ""
        why = self.why or f"the only save in {self.given}"
        return f"converting {self.url} ({why}: {self.reader.title})"

    @property
    def beside_note(self) -> str:
        """`not read, beside it in X: optimizer/, extra_state/`; "" if nothing is beside it."""
        if not self.nested or not self.beside:
            return ""
        folder = self.url.rsplit("/", 1)[0]
        return f"not read, beside it in {folder}: {', '.join(n + '/' for n in self.beside)}"


def _subfolders(storage: Storage, url: str) -> list[str]:
    return sorted(n for n in storage.listdir(url) if storage.isdir(join_url(url, n)))


def find_nested(storage: Storage, url: str, readers: Sequence[FormatReader]) -> Found | None:
    """The one save one level below `url`, or None where there is none.

    Raises:
        CheckpointFormatError: If several subfolders hold a save (listed, with how to pick
            one), or a folder holds DCP chunks without `.metadata` (`refuse_partial_dcp`).
    """
    if not storage.isdir(url):
        return None
    refuse_partial_dcp(storage, url)
    found: list[Found] = []
    ignored: list[str] = []
    for name in _subfolders(storage, url):
        sub = join_url(url, name)
        if IGNORED_SUBFOLDER.match(name) or is_zerosafe_output(storage, sub):
            ignored.append(name)
            continue
        reader = next((r for r in readers if r.detect(storage, sub)), None)
        if reader is not None:
            found.append(Found(reader=reader, url=sub, given=url))
    if len(found) > 1:
        listed = ", ".join(f"{f.url.rsplit('/', 1)[-1]}/ ({f.reader.title})" for f in found)
        names = [f.url.rsplit("/", 1)[-1] for f in found]
        if all(_PER_RANK.search(n) for n in names):  # rank_0/, rank_1/: not saves of a model
            raise CheckpointFormatError(
                f"{url}: {len(found)} folders that look like per-rank saves ({listed}): each "
                "holds one rank's part under an index of its own, and no global index says "
                "how they make the model. Save from all ranks into one folder (DCP: "
                "torch.distributed.checkpoint.save with the process group, which writes one "
                "global `.metadata`), then convert that folder"
            )
        raise CheckpointFormatError(
            f"{url}: holds {len(found)} saves one level down: {listed}; zerosafe converts one "
            f"save at a time: pass the folder of the one to convert (e.g. {found[0].url})"
        )
    if not found:
        _refuse_partial_dcp_below(storage, url, ignored)
        return None
    taken = found[0].url.rsplit("/", 1)[-1]
    beside = tuple(n for n in _subfolders(storage, url) if n != taken and not n.startswith("."))
    return dataclasses.replace(found[0], beside=beside)


def find_latest_step(storage: Storage, url: str, readers: Sequence[FormatReader]) -> Found | None:
    """The save of the step `latest_checkpointed_iteration.txt` in `url` names, or None where
    `url` has no such file.

    Raises:
        CheckpointFormatError: If the file holds no step number, its `global_step_N/` is
            missing, or that folder holds no save (or several: `find_nested`).
    """
    if not storage.isdir(url) or LATEST_STEP_FILE not in storage.listdir(url):
        return None
    folders = _subfolders(storage, url)
    if any(re.fullmatch(r"iter_\d{7}", n) for n in folders) and not any(
        n.startswith("global_step_") for n in folders
    ):
        return None  # Megatron-LM's layout, same file: `MegatronReader` claims the folder
    file_url = join_url(url, LATEST_STEP_FILE)
    text = storage.read_bytes(file_url)[:_LATEST_MAX_BYTES].decode("ascii", "replace").strip()
    if not (text.isascii() and text.isdecimal()):
        raise CheckpointFormatError(
            f"{file_url}: holds {text!r}, expected the number of the latest step (verl and "
            "ByteCheckpoint write e.g. '3' for global_step_3/); pass the global_step_N folder "
            "to convert"
        )
    step = f"global_step_{int(text)}"
    step_url = join_url(url, step)
    if not storage.isdir(step_url):
        steps = sorted(n for n in folders if n.startswith("global_step_"))
        raise CheckpointFormatError(
            f"{file_url}: names step {int(text)}, but {step_url} is not there (step folders "
            f"here: {steps}); that save did not finish or was not copied. Pass the "
            "global_step_N folder to convert"
        )
    named = f"the step {LATEST_STEP_FILE} names"
    reader = next((r for r in readers if r.detect(storage, step_url)), None)
    if reader is not None:
        return Found(reader=reader, url=step_url, given=url, why=f"{step}, {named}")
    found = find_nested(storage, step_url, readers)
    if found is None:
        err = CheckpointFormatError(
            f"{step_url}: {named} holds no checkpoint zerosafe reads (folders: "
            f"{_subfolders(storage, step_url)})."
        )
        err.lists_formats = True
        raise err
    return dataclasses.replace(found, given=url, why=f"the only save in {step}, {named}")


def refuse_saves_beside(storage: Storage, found: Found, readers: Sequence[FormatReader]) -> None:
    """Refuse a folder a reader claims that also holds, one level down, a save of a format
    that is no part of the claimed save (`FormatReader.parts_below`).

    Only the readers of those other formats are asked, from listings: a DeepSpeed folder's
    tag folders cost one listing per other reader, and nothing is read below them.

    Raises:
        CheckpointFormatError: Listing each save with its format, and how to pick one.
    """
    claimed = found.reader
    others = [r for r in readers if r.name not in claimed.parts_below]
    beside: list[Found] = []
    for name in _subfolders(storage, found.url):
        if IGNORED_SUBFOLDER.match(name):
            continue
        sub = join_url(found.url, name)
        if is_zerosafe_output(storage, sub):
            continue  # an output of zerosafe is no save of the run
        reader = next((r for r in others if r.detect(storage, sub)), None)
        if reader is not None:
            beside.append(Found(reader=reader, url=sub, given=found.url))
    if not beside:
        return
    names = [f"{f.url.rsplit('/', 1)[-1]}/" for f in beside]
    saves = [f"{found.url} itself ({claimed.title})"]
    saves += [f"{n} ({f.reader.title})" for n, f in zip(names, beside, strict=True)]
    itself = f"the {claimed.title} save in {found.url} itself"
    if claimed.tag_folders:
        pick = f", or, for {itself}, `--tag` naming its tag folder"
    else:  # nothing picks it but the folder alone
        pick = f"; to convert {itself}, move {', '.join(names)} out of it"
    raise CheckpointFormatError(
        f"{found.url}: holds {len(saves)} saves: {', '.join(saves[:-1])} and {saves[-1]}; "
        "zerosafe converts one save at a time: pass the folder of the one to convert "
        f"(e.g. {beside[0].url}){pick}"
    )


def is_zerosafe_output(storage: Storage, url: str) -> bool:
    """Whether `url` is a safetensors output of zerosafe, finished or being written: never a
    save to find one level down (converting `checkpoint-4` into `checkpoint-4/hf` again must
    find the same save as the first time). Passed itself, a finished one is a source."""
    names = storage.listdir(url)
    return OUTPUT_MARKER in names or OUTPUT_WORK_DIR in names


def refuse_partial_dcp(storage: Storage, url: str) -> None:
    """Refuse a folder of DCP chunk files (`__R_S.distcp`) without the global `.metadata`.

    Raises:
        CheckpointFormatError: Naming the chunks found and what is missing.
    """
    names = storage.listdir(url)
    chunks = sorted(n for n in names if _DISTCP.match(n))
    if not chunks or _DCP_METADATA in names:
        return
    shown = ", ".join(chunks[:4]) + (f" and {len(chunks) - 4} more" if len(chunks) > 4 else "")
    raise CheckpointFormatError(
        f"{url}: PyTorch DCP chunk files ({shown}) but no `.metadata`, the global index "
        "rank 0 writes last, after every rank's chunks: the save is not finished, or was "
        "copied without its hidden `.metadata` file (`cp *` skips it), or each rank saved on "
        "its own (no_dist). Copy `.metadata` too, or save with torch.distributed.checkpoint "
        "from all ranks into one folder, then convert that folder"
    )


def _refuse_partial_dcp_below(storage: Storage, url: str, ignored: Sequence[str]) -> None:
    """Refuse per-rank subfolders of DCP chunks without `.metadata` (`rank0/__0_0.distcp`),
    which no reader claims."""
    partial = []
    for name in _subfolders(storage, url):
        if name in ignored:
            continue
        names = storage.listdir(join_url(url, name))
        if _DCP_METADATA not in names and any(_DISTCP.match(n) for n in names):
            partial.append(name)
    if not partial:
        return
    raise CheckpointFormatError(
        f"{url}: {len(partial)} folder(s) of PyTorch DCP chunk files without a `.metadata` "
        f"({', '.join(p + '/' for p in partial[:6])}{' ...' if len(partial) > 6 else ''}): "
        "per-rank saves (or unfinished ones), with no global `.metadata` saying how the "
        "chunks make the tensors. Save with torch.distributed.checkpoint from all ranks into "
        "one folder (rank 0 writes its `.metadata`), or copy the missing `.metadata`, then "
        "convert that folder"
    )


def refuse_optimizer_only(layout: SourceLayout, options: ConvertOptions) -> None:
    """Refuse converting, by default, a save that holds optimizer state and no weights
    (accelerate's `optimizer_0/` passed itself): its moments would be written as the model.
    `--select` converts them on purpose.

    Raises:
        CheckpointFormatError: Naming the state found and the fixes.
    """
    names = [t.name for t in layout.tensors.values()]
    if options.select or not names or not all(is_optimizer_state(n) for n in names):
        return
    top = sorted(
        {n.split(".state.", 1)[0] + ".state" if ".state." in n else "state" for n in names}
    )
    raise CheckpointFormatError(
        f"{layout.where}: holds optimizer state only ({len(names)} tensors under "
        f"{', '.join(repr(t) for t in top)}, e.g. {names[0]}), no weights: accelerate "
        "writes the model's weights in `pytorch_model_fsdp_N/` beside `optimizer_N/`; pass "
        f"that folder, or `--select {top[0]}` to convert the optimizer state as it is"
    )
