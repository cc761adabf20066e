"""The outputs zerosafe writes (`zerosafe convert --to NAME`), the way
`zerosafe.formats.registry` lists the readers.

A new output is one target (`zerosafe.targets.base.OutputTarget`) and one line in `TARGETS`.
Entries name their code by import path, so listing them (the command's `--to` choices) imports
nothing heavy.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from zerosafe.errors import ConfigError
from zerosafe.targets.base import TargetName

__all__ = ["TARGETS", "Target", "get_target", "target_names"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Target:
    """One output zerosafe writes."""

    name: TargetName
    """The `--to` value."""
    title: str
    """What it writes, for help and messages."""
    convert: str
    """`module:function` that runs it in this process: `(source, destination, ...) -> summary`."""
    target: str | None
    """`module:class` of its `OutputTarget` (constructed `(storage, source, tag=..., ...)`),
    which `zerosafe.targets.lifecycle` runs in this process or as Prefect tasks; None where
    the target is the weights pipeline (`zerosafe.pipeline`)."""

    def load(self, what: str | None = None) -> Any:
        """The function (`convert`) or class (`target`) the entry names, imported now."""
        module, _, attr = (what or self.convert).partition(":")
        return getattr(importlib.import_module(module), attr)


TARGETS: tuple[Target, ...] = (
    Target(
        name="safetensors", title="verified safetensors weights (the default)",
        convert="zerosafe.driver:convert_checkpoint", target=None,
    ),
    Target(
        name="universal", title="a DeepSpeed universal checkpoint (masters and Adam moments)",
        convert="zerosafe.training_state.universal:convert_to_universal",
        target="zerosafe.training_state.universal:UniversalTarget",
    ),
    Target(
        name="dcp", title="a PyTorch DCP checkpoint of the model and AdamW state (FSDP2)",
        convert="zerosafe.training_state.dcp:convert_to_dcp",
        target="zerosafe.training_state.dcp:DcpTarget",
    ),
)  # fmt: skip


def target_names() -> tuple[str, ...]:
    """Every `--to` value, the default first."""
    return tuple(t.name for t in TARGETS)


def get_target(name: str) -> Target:
    """The target named `name`.

    Raises:
        ConfigError: No target has that name.
    """
    for t in TARGETS:
        if t.name == name:
            return t
    raise ConfigError(f"`--to {name}`: expected one of {', '.join(target_names())}, found '{name}'")
