"""The job's fields, one row each: the one list the command's flags, the flow's parameters, the
flag names in messages and the job config's conversion to the engine's options come from.

A row names a `JobConfig` field (`zerosafe_app.flows.config`), which is also a parameter of
the flow `convert` (`flows/convert.py`) and, where `engine` is set, a `ConvertOptions` field
of the same name (`zerosafe.config`). What each consumer makes of it:

- `zerosafe convert` and `zerosafe inspect` (`zerosafe_app.cli`): the flag, its type, default,
  choices and help (`add_job_flags`), and the `ConvertOptions` the parsed flags give
  (`options_values`).
- The flow's JSON parameters for a command's options (`flow_parameters`), and what the flow
  hands the job config.
- The flags a `ConfigError` from the engine names in place of its fields (`FLAG_OF_FIELD`).
- `JobConfig`: which fields are sizes and URLs (its validators), and its `options()`.

The flow's signature and `JobConfig`'s declarations (types and documentation, for Prefect's
parameter schema, which `Flow.from_source` parses from the source file, and for mypy) are
written out; tests/app/test_option_table.py keeps both equal to
this table, names, order, defaults and types. `conf/example.yaml` documents every field.

This module is imported at the command's start-up: it imports nothing heavy.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from zerosafe.config import DEFAULT_MAX_SHARD_BYTES, DEFAULT_MEMORY_BYTES, Mode
from zerosafe_app.arg_types import int_at_least, positive_size, size_argument

__all__ = [
    "FLAG_OF_FIELD",
    "JOB_FIELDS",
    "Kind",
    "Scope",
    "add_job_flags",
    "field_named",
    "fields_of_kind",
    "options_values",
]


class Kind(StrEnum):
    """What a field holds, which decides its flag's parsing and its JSON form."""

    TEXT = "text"
    """A string, or None."""
    URL = "url"
    """A path or URL, normalized (`ckpt`, `./ckpt` and `/abs/ckpt` are one job)."""
    CHOICE = "choice"
    """One of `choices`."""
    SWITCH = "switch"
    """A boolean: a flag that turns it on (or, with a default of true, off)."""
    COUNT = "count"
    """A whole number of at least 1."""
    SIZE = "size"
    """Bytes, written `5GB` or `64MiB` (`zerosafe.units.parse_size`); a string in the flow's
    JSON parameters, so sizes above 2**53 keep every digit."""
    PATTERNS = "patterns"
    """A list of strings, the flag repeatable."""
    MAPPING = "mapping"
    """A mapping (`storage_options`)."""


class Scope(StrEnum):
    """Which commands take a field's flag."""

    PLAN = "plan"
    """`inspect` and `convert`: it changes the plan."""
    CONVERT = "convert"
    """`convert` only: it changes how a run goes, not what it plans."""
    NONE = "none"
    """No generated flag (the flow's and the job file's only, or a flag the command adds
    itself, such as `--storage-option` or `inspect --simulate`'s `--extract-part-size`)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class JobField:
    """One field of a job."""

    name: str
    """The `JobConfig` field and flow parameter (and `ConvertOptions` field, with `engine`)."""
    kind: Kind
    default: Any
    """`JobConfig`'s default, and the flag's (a size in bytes)."""
    engine: bool = False
    """A `ConvertOptions` field of the same name (lists become tuples there)."""
    flag: str | None = None
    """The command's flag, as messages name it; None: the command has none."""
    scope: Scope = Scope.NONE
    help: str = ""
    """The flag's help (argparse's `%(default)s` is the default it shows)."""
    metavar: str | None = None
    choices: tuple[str, ...] = ()
    parse: Callable[[str], Any] | None = None
    """The flag's argparse `type=`, where it is not the kind's."""
    group: str | None = None
    """Flags of one group are mutually exclusive."""


_MODE_HELP = (
    "how merges read the fp32 masters: direct (in place, local/NFS), staged (from "
    "intermediates an extract stage writes first), auto (direct for local/NFS paths, "
    "staged for object stores; default)"
)
_QUANTIZE_HELP = (
    "write the weights quantized: fp8-block is float8_e4m3fn with a float32 "
    "weight_scale_inv per 128x128 block, as transformers' fine-grained FP8 writes it; "
    "fp8-dynamic is compressed-tensors' float-quantized (a float32 weight_scale per "
    "output channel), as llm-compressor's FP8_DYNAMIC writes it; nvfp4a16 is "
    "compressed-tensors' nvfp4-pack-quantized (FP4 packed two a byte, float8 scales per "
    "16 values, a float32 global scale), as llm-compressor's NVFP4A16 writes it "
    "(embeddings, lm_head, norms, routers stay in --dtype)"
)
_PARALLEL_HELP = (
    "tasks at once, within the memory budget (default: half the usable cores, 2 to "
    "4; %(default)s here); ZEROSAFE_WORKERS=auto runs them as worker processes "
    "for a job of 2 GB or more"
)

JOB_FIELDS: tuple[JobField, ...] = (
    JobField(name="source", kind=Kind.URL, default=None),
    JobField(name="destination", kind=Kind.URL, default=None),
    JobField(
        name="tag", kind=Kind.TEXT, default=None, flag="--tag", scope=Scope.PLAN,
        help="DeepSpeed: the tag to convert (default: the one 'latest' names)",
    ),
    JobField(
        name="select", kind=Kind.PATTERNS, default=[], engine=True, flag="--select",
        scope=Scope.PLAN, metavar="PREFIX",
        help="PyTorch DCP: convert the tensors under this key prefix (repeatable; default: "
        "'model', or every tensor without a 'model' key)",
    ),
    JobField(
        name="strip_prefix", kind=Kind.TEXT, default=None, engine=True, flag="--strip-prefix",
        scope=Scope.PLAN, metavar="PREFIX",
        help="PyTorch DCP: remove this prefix from the output names (default: 'model' with "
        "the default selection, nothing with --select; '' strips nothing)",
    ),
    JobField(
        name="keep_names", kind=Kind.SWITCH, default=False, engine=True, flag="--keep-names",
        scope=Scope.PLAN,
        help="Megatron-LM: write Megatron's own names with the layers unstacked "
        "(decoder.layers.0.self_attention.linear_qkv.weight), nothing split, no config.json",
    ),
    JobField(
        name="dtype", kind=Kind.CHOICE, default="fp32", engine=True, flag="--dtype",
        scope=Scope.PLAN, choices=("fp32", "bf16", "fp16"),
        help="output dtype of floating tensors (default fp32)",
    ),
    JobField(
        name="max_shard_size", kind=Kind.SIZE, default=DEFAULT_MAX_SHARD_BYTES, engine=True,
        flag="--max-shard-size", scope=Scope.PLAN, metavar="SIZE", parse=positive_size,
        help="largest output file, e.g. 5GB, 500MB, 64MiB (default 5GB)",
    ),
    JobField(
        name="memory", kind=Kind.SIZE, default=DEFAULT_MEMORY_BYTES, engine=True,
        flag="--memory", scope=Scope.PLAN, metavar="SIZE",
        help="memory budget of a worker (default 1GB)",
    ),
    JobField(
        name="exclude_frozen", kind=Kind.SWITCH, default=False, engine=True,
        flag="--exclude-frozen", scope=Scope.PLAN, help="leave frozen parameters out",
    ),
    JobField(
        name="tied", kind=Kind.CHOICE, default="dedupe", engine=True, flag="--tied",
        scope=Scope.PLAN, choices=("dedupe", "copy"),
        help="store tied aliases once and record them (dedupe, default) or write copies",
    ),
    JobField(
        name="mode", kind=Kind.CHOICE, default=Mode.AUTO, flag="--mode", scope=Scope.PLAN,
        choices=tuple(Mode), help=_MODE_HELP,
    ),
    JobField(
        name="keep_fp32", kind=Kind.PATTERNS, default=[], engine=True, flag="--keep-fp32",
        scope=Scope.PLAN, metavar="PATTERN",
        help="keep floating tensors whose name matches this regular expression (re.search) in "
        "fp32 under --dtype bf16/fp16, e.g. 'router|norm' (repeatable)",
    ),
    JobField(
        name="model_files", kind=Kind.URL, default=None, engine=True, flag="--model-files",
        scope=Scope.PLAN, metavar="DIR", group="model files",
        help="copy config.json, generation_config.json and tokenizer files from DIR (default: "
        "the checkpoint folder above the tag)",
    ),
    JobField(
        name="copy_model_files", kind=Kind.SWITCH, default=True, engine=True,
        flag="--no-model-files", scope=Scope.PLAN, group="model files",
        help="do not copy config and tokenizer files next to the weights",
    ),
    JobField(
        name="adapter", kind=Kind.SWITCH, default=False, engine=True, flag="--adapter",
        scope=Scope.PLAN,
        help="write the PEFT adapter the checkpoint holds: adapter_model.safetensors with "
        "PEFT's names and adapter_config.json, for PeftModel.from_pretrained(base, OUT)",
    ),
    JobField(
        name="quantize", kind=Kind.CHOICE, default=None, engine=True, flag="--quantize",
        scope=Scope.PLAN, choices=("fp8-block", "fp8-dynamic", "nvfp4a16"), help=_QUANTIZE_HELP,
    ),
    JobField(
        name="quantize_ignore", kind=Kind.PATTERNS, default=[], engine=True,
        flag="--quantize-ignore", scope=Scope.PLAN, metavar="PATTERN",
        help="with --quantize: leave weights whose name matches this regular expression "
        "(re.search) unquantized, e.g. 'layers\\.0\\.' (repeatable)",
    ),
    JobField(
        name="quantize_scale_fmt", kind=Kind.CHOICE, default="float", engine=True,
        choices=("float", "ue8m0"),  # no flag: the command's `--quantize-like` sets it
    ),
    JobField(
        name="overwrite", kind=Kind.SWITCH, default=False, engine=True, flag="--overwrite",
        scope=Scope.CONVERT, help="replace an output of another source or other options",
    ),
    JobField(
        name="work_dir", kind=Kind.URL, default=None, flag="--work-dir", scope=Scope.CONVERT,
        help="where to keep the plan and intermediates (default: OUTPUT/.zerosafe-work)",
    ),
    JobField(
        name="keep_work", kind=Kind.SWITCH, default=False, engine=True, flag="--keep-work",
        scope=Scope.CONVERT, help="keep work files after a verified publish",
    ),
    JobField(
        name="allow_nonfinite", kind=Kind.SWITCH, default=False, engine=True,
        flag="--allow-nonfinite", scope=Scope.CONVERT, help="do not fail on NaN/Inf values",
    ),
    JobField(
        name="check_lowp", kind=Kind.SWITCH, default=False, engine=True, flag="--check-lowp",
        scope=Scope.CONVERT,
        help="ZeRO-1/2: also check the output against the 16-bit weights saved beside the "
        "fp32 ones",
    ),
    JobField(
        name="file_sha256", kind=Kind.SWITCH, default=False, engine=True, flag="--file-sha256",
        scope=Scope.CONVERT,
        help="record each weight file's SHA-256 (as the Hugging Face Hub shows it) in the "
        "manifest, hashed by verify's re-read; on a complete output without them, verify it "
        "again to add them",
    ),
    JobField(
        name="max_parallel_tasks", kind=Kind.COUNT, default=2, engine=True, flag="--parallel",
        scope=Scope.CONVERT, metavar="N", help=_PARALLEL_HELP,
    ),
    JobField(
        name="extract_part_size", kind=Kind.SIZE, default=2 * 10**9, engine=True,
        flag="--extract-part-size",  # `inspect --simulate` only (`zerosafe_app.cli`)
    ),
    JobField(name="runner", kind=Kind.CHOICE, default="threads", choices=("threads", "dask")),
    JobField(name="dask_address", kind=Kind.TEXT, default=None),
    JobField(
        name="storage_options", kind=Kind.MAPPING, default={},
        flag="--storage-option",  # added by the command itself: `verify` and `clean` take it too
    ),
    JobField(name="timeout_seconds", kind=Kind.COUNT, default=None),
)  # fmt: skip
"""Every job field; the flags of a scope come in this order."""


def field_named(name: str) -> JobField:
    """The row of field `name`."""
    for field in JOB_FIELDS:
        if field.name == name:
            return field
    raise KeyError(name)


def fields_of_kind(*kinds: Kind) -> tuple[str, ...]:
    """The names of the fields of these kinds (for `JobConfig`'s validators)."""
    return tuple(f.name for f in JOB_FIELDS if f.kind in kinds)


def _flag_names() -> dict[str, str]:
    names: dict[str, str] = {}
    for field in JOB_FIELDS:
        if field.flag is None:
            continue
        names[f"`{field.name}`"] = f"`{field.flag}`"
        for choice in field.choices:
            names[f"`{field.name}: {choice}`"] = f"`{field.flag} {choice}`"
    return names


FLAG_OF_FIELD: Mapping[str, str] = _flag_names()
"""A field as the engine's messages name it (`` `memory` ``, `` `mode: direct` ``) -> the
flag a user of the command typed (`` `--memory` ``, `` `--mode direct` ``)."""


def add_job_flags(
    parser: argparse.ArgumentParser,
    scope: Scope,
    *,
    only: Iterable[str] | None = None,
    skip: Iterable[str] = (),
    defaults: Mapping[str, Any] | None = None,
) -> None:
    """Add the flags of the fields of `scope` to `parser`, in the table's order.

    Args:
        only: Just these fields (in the table's order); None: every field of `scope`.
        skip: Not these fields.
        defaults: A default other than the table's, for the command (`--parallel`'s depends
            on the machine).
    """
    wanted = None if only is None else set(only)
    groups: dict[str, Any] = {}
    for field in JOB_FIELDS:
        if field.scope != scope or field.name in skip:
            continue
        if wanted is not None and field.name not in wanted:
            continue
        assert field.flag is not None, field.name  # a scoped field has a flag
        target: Any = parser
        if field.group is not None:
            if field.group not in groups:
                groups[field.group] = parser.add_mutually_exclusive_group()
            target = groups[field.group]
        target.add_argument(field.flag, dest=field.name, help=field.help, **_argparse_of(field))
        if defaults and field.name in defaults:
            parser.set_defaults(**{field.name: defaults[field.name]})


def _argparse_of(field: JobField) -> dict[str, Any]:
    """How argparse reads `field`'s flag: action, type, default, choices and metavar."""
    spec: dict[str, Any] = {}
    if field.metavar is not None:
        spec["metavar"] = field.metavar
    if field.kind is Kind.SWITCH:
        spec["action"] = "store_false" if field.default else "store_true"
        return spec
    if field.kind is Kind.PATTERNS:
        spec["action"] = "append"  # None when not given: the engine's default
        return spec
    if field.choices:
        spec["choices"] = list(field.choices)
    spec["default"] = field.default
    parse = field.parse or {Kind.SIZE: size_argument, Kind.COUNT: int_at_least(1)}.get(field.kind)
    if parse is not None:
        spec["type"] = parse
    return spec


def options_values(values: Mapping[str, Any]) -> dict[str, Any]:
    """`ConvertOptions` keyword arguments from a job's `values` (parsed flags, or a job
    config's fields): each engine field given (not None), lists as tuples. A field left out
    keeps the engine's default (`inspect` has no `--overwrite`)."""
    options: dict[str, Any] = {}
    for field in JOB_FIELDS:
        value = values.get(field.name)
        if field.engine and value is not None:
            options[field.name] = tuple(value) if field.kind is Kind.PATTERNS else value
    return options
