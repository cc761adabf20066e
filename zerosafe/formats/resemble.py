"""What a folder no reader claims looks like, from its listing alone, for the one-line refusal.

A folder that holds none of the formats zerosafe reads used to get DeepSpeed's "no 'latest'
file" message, the original format's, even when it was plainly something else (a Megatron-LM
save, a folder of `.bin` weights, a Trainer folder without a model save). `resemblance` names
the layout the listing most resembles, the names that show it, and what to do; DeepSpeed's
own message is kept for folders that look like DeepSpeed (`looks_like_deepspeed`), where it
says precisely what is missing. Nothing is opened: names, and whether a few are folders.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from zerosafe.io.storage import Storage, join_url

__all__ = ["LAYOUTS", "Layout", "looks_like_deepspeed", "resemblance"]

_DEEPSPEED = re.compile(
    r"^(latest|latest_universal|zero_to_fp32\.py|global_step\d+(_universal)?|"
    r".*_(model|optim)_states\.pt)$"
)
_PT2ST = "each is one `torch.save` file: `zerosafe pt2st FILE OUT.safetensors` reads it without running its code"


@dataclass(frozen=True, kw_only=True, slots=True)
class Layout:
    """A layout zerosafe does not read as a checkpoint folder, recognised by its names."""

    what: str
    """What the folder looks like."""
    names: Callable[[Sequence[str], Callable[[str], bool]], list[str]]
    """The names that show it (empty: not this layout), given the listing and `isdir`."""
    fix: str
    """What to do instead."""


def _files(pattern: str) -> Callable[[Sequence[str], Callable[[str], bool]], list[str]]:
    regex = re.compile(pattern)
    return lambda names, isdir: [n for n in names if regex.fullmatch(n)]


def _folders(pattern: str) -> Callable[[Sequence[str], Callable[[str], bool]], list[str]]:
    regex = re.compile(pattern)
    return lambda names, isdir: [f"{n}/" for n in names if regex.fullmatch(n) and isdir(n)]


LAYOUTS: tuple[Layout, ...] = (
    Layout(
        what="a zerosafe output still being written (no `zerosafe-complete.json` yet)",
        names=_folders(r"\.zerosafe-work"),
        fix="let its conversion finish (run it again to resume), then pass it",
    ),
    Layout(
        what="a Megatron-LM checkpoint",
        names=lambda names, isdir: (
            _files(r"latest_checkpointed_iteration\.txt")(names, isdir)
            + _folders(r"iter_\d{7}|mp_rank_\d\d(_\d{3})?")(names, isdir)
        ),
        fix="zerosafe reads Megatron-LM's `torch_dist` saves (an `iter_NNNNNNN/` holding "
        "`.metadata`), not its legacy `torch` format (`mp_rank_NN/`); save with "
        "`--ckpt-format torch_dist`, or convert with Megatron's own checkpoint converter",
    ),
    Layout(
        what="a Hugging Face model folder of PyTorch `.bin` weights",
        names=_files(r"pytorch_model(-\d+-of-\d+)?\.bin"),
        fix=_PT2ST,
    ),
    Layout(
        what="PyTorch Lightning checkpoint files",
        names=_files(r".+\.ckpt"),
        fix=_PT2ST,
    ),
    Layout(
        what="an HF Trainer checkpoint folder without a model save zerosafe reads",
        names=lambda names, isdir: (
            _files(r"trainer_state\.json")(names, isdir) + [f"{n}/" for n in names if isdir(n)]
        ),
        fix="pass the folder of the save itself (a DeepSpeed folder holding `latest`, a DCP "
        "folder holding `.metadata`); an `optimizer_N/` folder holds optimizer state, no weights",
    ),
    Layout(
        what="files written by `torch.save`",
        names=_files(r".+\.(pt|pth|bin)"),
        fix=_PT2ST,
    ),
    Layout(
        what="safetensors files without a `model.safetensors.index.json`",
        names=_files(r".+\.safetensors"),
        fix="with several files, the index says which tensors each holds: add it (as "
        "`save_pretrained` writes it), or pass a folder holding one file",
    ),
    Layout(
        what="GGUF files (llama.cpp)",
        names=_files(r".+\.gguf"),
        fix="GGUF is an inference format, not a training checkpoint; convert the checkpoint "
        "the run saved",
    ),
    Layout(
        what="TensorFlow, Keras or Flax weights",
        names=_files(r".+\.(h5|keras|msgpack)"),
        fix="zerosafe reads PyTorch training checkpoints only",
    ),
)
"""The layouts named, most telling first."""


def looks_like_deepspeed(names: Sequence[str]) -> bool:
    """Whether a listing shows anything of DeepSpeed's (`latest`, a `global_stepN` tag, a
    `*_model_states.pt`, `zero_to_fp32.py`): then DeepSpeed's reader says what is missing."""
    return any(_DEEPSPEED.fullmatch(n) for n in names)


def resemblance(storage: Storage, url: str, names: Sequence[str]) -> str:
    """One sentence: what the folder at `url` (listed as `names`) looks like, the names that
    show it, and what to do."""
    listed = sorted(names)
    if not listed:
        return "an empty folder"

    def isdir(name: str) -> bool:
        return storage.isdir(join_url(url, name))

    for layout in LAYOUTS:
        found = layout.names(listed, isdir)
        if found:
            shown = ", ".join(found[:4]) + (f" and {len(found) - 4} more" if len(found) > 4 else "")
            return f"it looks like {layout.what} ({shown}); {layout.fix}"
    shown = ", ".join(listed[:5]) + (f" and {len(listed) - 5} more" if len(listed) > 5 else "")
    return f"nothing in it is a checkpoint zerosafe recognises ({shown})"
