"""Options of one conversion, as the engine sees them (plain dataclasses, no pydantic).

The flows validate user input (CLI flags, YAML job files, Prefect parameters) into
`zerosafe_app.flows.config.JobConfig` and hand the engine a `ConvertOptions`.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import Any, Literal

from zerosafe.dtypes import dtype_info, output_dtype
from zerosafe.errors import ConfigError

__all__ = [
    "DEFAULT_MAX_SHARD_BYTES",
    "DEFAULT_MEMORY_BYTES",
    "ConvertOptions",
    "Mode",
    "choose_mode",
    "environ_during",
    "usable_cores",
]

DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
DEFAULT_MEMORY_BYTES = 1 * 10**9
PIPELINE_BUFFERS = 8
"""Chunk buffers one running task holds at most (reads in flight, cast output, write queue)."""
TASK_OVERHEAD_BYTES = 32 * 2**20
"""What a task holds besides its chunk buffers (plan, headers, Python objects)."""
MIN_CHUNK_BYTES = 1 * 2**20
MAX_CHUNK_BYTES = 64 * 2**20


def _dotted_prefix(field: str, prefix: str) -> str:
    """A key prefix without the dots around it (`model.` is `model`).

    Raises:
        ConfigError: If nothing is left: `.` is no prefix, and matching on it selected or
            stripped every name (issue 24: `--strip-prefix .` cut each name's first letter).
    """
    name = prefix.strip(".")
    if not name:
        raise ConfigError(
            f"`{field}` '{prefix}' is empty once its dots are removed, expected a key prefix "
            "such as 'model' or 'optim.state'; name one (the top-level keys are listed by "
            "`zerosafe inspect`)"
            + (", or leave it out for the default" if field == "select" else "")
        )
    return name


class Mode(StrEnum):
    """How merges read the fp32 masters (`--mode`, a job's `mode`). Both ways resume: each
    merge task is cached and restartable either way."""

    AUTO = "auto"
    """By where the checkpoint is (`choose_mode`): `direct` for a local or NFS path, `staged`
    for an object store."""
    DIRECT = "direct"
    """In place, from the checkpoint's own fp32 records, with no intermediate copy (local or
    NFS paths only)."""
    STAGED = "staged"
    """From intermediates that one extract per rank part writes first."""


def choose_mode(source_url: str, mode: Mode | str = Mode.AUTO) -> tuple[bool, str]:
    """`(direct, why)` for a checkpoint at `source_url` and a requested `mode`.

    `auto` reads a local or NFS checkpoint in place: its ranged reads are cheap, so the
    extract stage's extra copy of every fp32 byte only costs time. An object store answers
    many small ranged reads slowly, so there one sequential extract per rank part comes first.

    Raises:
        ConfigError: For an unknown mode, or `direct` on an object store.
    """
    from zerosafe.io.storage import is_local

    try:
        mode = Mode(mode)
    except ValueError:
        raise ConfigError(f"`mode` must be one of {', '.join(Mode)} (got '{mode}')") from None
    local = is_local(source_url)
    if mode is Mode.DIRECT:
        if not local:
            raise ConfigError(
                f"`mode: direct` reads the checkpoint in place and needs a local or NFS path, "
                f"not '{source_url}'; use `mode: staged` (or `auto`) for object stores"
            )
        return True, "direct, as asked"
    if mode is Mode.STAGED:
        return False, "staged, as asked"
    if local:
        return True, (
            "direct (auto): the checkpoint is on a local or NFS path, so merges read its fp32 "
            "ranges in place, with no intermediate copy"
        )
    return False, (
        "staged (auto): the checkpoint is in an object store, where one sequential extract "
        "per rank part costs less than many ranged reads per merge"
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class ConvertOptions:
    """How to convert. Fields that change output bytes are part of the job's identity."""

    dtype: str = "float32"
    """Output dtype of every floating tensor (params, frozen params, float buffers)."""
    max_shard_size: int = DEFAULT_MAX_SHARD_BYTES
    """Largest output file's tensor bytes; a bigger single tensor gets a file of its own."""
    tied: Literal["dedupe", "copy"] = "dedupe"
    """`dedupe`: store a tied alias once and record it; `copy`: write it as a real tensor."""
    exclude_frozen: bool = False
    """Leave frozen (requires_grad=False) params out of the output."""
    direct: bool = False
    """Merge straight from the source's fp32 records (local/NFS), with no intermediate copy."""
    mode_reason: str = ""
    """Why `direct` is what it is (`choose_mode`), for `inspect` and the run summary."""
    memory: int = DEFAULT_MEMORY_BYTES
    """Memory budget of one worker: the tasks it runs at once hold at most this much."""
    max_parallel_tasks: int = 2
    """Tasks one worker runs at once (further bounded by `memory`)."""
    extract_part_size: int = 2 * 10**9
    """Staged mode: a rank's fp32 bytes are extracted in parts of at most this size."""
    overwrite: bool = False
    """Replace a complete output from another source or other options."""
    keep_work: bool = False
    """Keep the work area (plan, intermediates) after a verified publish."""
    allow_nonfinite: bool = False
    """Verify passes NaN/Inf values (they are counted either way); by default they fail it."""
    check_lowp: bool = False
    """ZeRO-1/2: before publishing, check each tensor cast to the training dtype equals the
    16-bit weight in the model states (reads those weights: 2 more bytes per parameter)."""
    file_sha256: bool = False
    """Record each output file's SHA-256 (what the Hugging Face Hub shows for an uploaded
    file) in the manifest, computed once, by verify's re-read of the file. Not part of the
    job's identity: the bytes do not change, so an output converted without it is re-verified
    to add the sums, never converted again."""
    keep_fp32: tuple[str, ...] = ()
    """Regular expressions on tensor names (`re.search`): matching floating tensors stay
    float32 whatever `dtype` says (router and norm weights a model needs in full precision)."""
    model_files: str | None = None
    """Folder to copy `config.json`, `generation_config.json` and the tokenizer files from
    (`zerosafe.stages.model_files`); None: the checkpoint folder above the tag."""
    copy_model_files: bool = True
    """Copy those files next to the weights, so `from_pretrained(OUT)` needs no extra step."""
    adapter: bool = False
    """Write the PEFT adapter the checkpoint holds (`zerosafe.plan.adapter`):
    `adapter_model.safetensors` with PEFT's names, one file, no base-model tensor, and
    `adapter_config.json` copied from the model-files folder."""

    quantize: str | None = None
    """Write the weights quantized in this scheme (`fp8-block`, `fp8-dynamic`, `nvfp4a16`:
    `zerosafe.quantize`); the tensors left unquantized (`quantize_skip_reason`) take `dtype`.
    None: no quantization."""
    quantize_ignore: tuple[str, ...] = ()
    """Regular expressions on tensor names (`re.search`): matching weights stay unquantized,
    and their modules are listed in `quantization_config` (`modules_to_not_convert`, or
    `ignore` for compressed-tensors)."""
    quantize_scale_fmt: str = "float"
    """`fp8-block`'s scale format, as transformers' `scale_fmt`: `float` (a float32
    `weight_scale_inv`) or `ue8m0` (powers of two, `float8_e8m0fnu`), which `--quantize-like`
    takes from a base release's `quantization_config`."""

    select: tuple[str, ...] = ()
    """PyTorch DCP: key prefixes to convert (`model`, `optim.state`); a prefix matches whole
    dotted components; dots around a prefix are ignored (`model.` is `model`) and one that is
    only dots is refused. Empty: the tensors under `model` (`model.` stripped), or every tensor
    without a `model` key. Formats that hold one state dict (DeepSpeed) refuse it."""
    strip_prefix: str | None = None
    """PyTorch DCP: a prefix removed from the output names (`model`); `""` strips nothing;
    None: `model` with the default selection, nothing with `select`. Dots around it are
    ignored; one that is only dots (`.`) is refused."""

    keep_names: bool = False
    """Megatron-LM: write Megatron's own tensor names, layers unstacked
    (`decoder.layers.0.self_attention.linear_qkv.weight`), nothing split or trimmed, no
    `config.json` generated; other formats refuse it."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", output_dtype(self.dtype))
        if isinstance(self.select, str) or not all(isinstance(p, str) for p in self.select):
            raise ConfigError(f"`select` must be a list of key prefixes (got {self.select!r})")
        object.__setattr__(self, "select", tuple(_dotted_prefix("select", p) for p in self.select))
        if self.strip_prefix:  # `""` keeps its meaning: strip nothing
            object.__setattr__(
                self, "strip_prefix", _dotted_prefix("strip_prefix", self.strip_prefix)
            )
        # JSON (Prefect parameters, the job dict tasks get) turns the tuple into a list.
        object.__setattr__(self, "keep_fp32", tuple(self.keep_fp32))
        for pattern in self.keep_fp32:
            try:
                re.compile(pattern)
            except re.error as e:
                raise ConfigError(
                    f"`keep_fp32` pattern '{pattern}' is not a regular expression ({e}); "
                    "quote it for the shell, e.g. 'router|norm'"
                ) from e
        self._check_quantize()
        if self.model_files is not None:
            from zerosafe.io.storage import normalize_url

            object.__setattr__(self, "model_files", normalize_url(self.model_files))
        if self.model_files is not None and not self.copy_model_files:
            raise ConfigError(
                "`model_files` names a folder to copy from but `copy_model_files` is off; "
                "give one or the other"
            )
        if self.tied not in ("dedupe", "copy"):
            raise ConfigError(f"`tied` must be 'dedupe' or 'copy' (got '{self.tied}')")
        if self.max_shard_size <= 0:
            raise ConfigError(f"`max_shard_size` must be positive (got {self.max_shard_size})")
        if self.max_parallel_tasks < 1:
            raise ConfigError(
                f"`max_parallel_tasks` must be at least 1 (got {self.max_parallel_tasks})"
            )
        if self.extract_part_size < MIN_CHUNK_BYTES:
            raise ConfigError(
                f"`extract_part_size` must be at least {MIN_CHUNK_BYTES} bytes "
                f"({MIN_CHUNK_BYTES // 2**20}MiB), got {self.extract_part_size}"
            )
        floor = TASK_OVERHEAD_BYTES + PIPELINE_BUFFERS * MIN_CHUNK_BYTES
        if self.memory < floor:
            raise ConfigError(
                f"`memory` budget {self.memory} bytes is below the minimum of {floor} "
                f"bytes ({floor // 2**20} MiB) that one task needs; give at least "
                f"{floor // 2**20}MiB"
            )

    def _check_quantize(self) -> None:
        """Refuse a `quantize` option the output cannot carry, before any I/O."""
        from zerosafe.quantize import QUANTIZE_SCHEMES, SCALE_FORMATS

        object.__setattr__(self, "quantize_ignore", tuple(self.quantize_ignore))
        if self.quantize_scale_fmt not in SCALE_FORMATS or (
            self.quantize_scale_fmt != "float" and self.quantize != "fp8-block"
        ):
            raise ConfigError(
                f"`quantize_scale_fmt` '{self.quantize_scale_fmt}': expected float, or ue8m0 "
                f"with `quantize` fp8-block (got `quantize` {self.quantize})"
            )
        if self.quantize is None:
            if self.quantize_ignore:
                raise ConfigError(
                    "`quantize_ignore` names weights to leave unquantized, but `quantize` is "
                    "not given; add `quantize` (fp8-block, fp8-dynamic, nvfp4a16) or drop "
                    "`quantize_ignore`"
                )
            return
        if self.quantize not in QUANTIZE_SCHEMES:
            raise ConfigError(
                f"`quantize` must be one of {', '.join(QUANTIZE_SCHEMES)} (got '{self.quantize}')"
            )
        if self.adapter:
            raise ConfigError(
                "`quantize` writes a quantized model release, `adapter` a PEFT adapter that "
                "PEFT loads in full precision; give one or the other"
            )
        if not self.copy_model_files:
            raise ConfigError(
                f"`quantize` {self.quantize} writes its `quantization_config` into the copied "
                "config.json (without it loaders read the weights unscaled), and with "
                "`copy_model_files` nothing is copied; drop it"
            )
        if self.dtype == "float16":
            raise ConfigError(
                f"`quantize` {self.quantize} keeps its unquantized tensors in bf16 or fp32, as "
                "the reference releases do, not in fp16 (`dtype` fp16); use `dtype` bf16"
            )
        for pattern in self.quantize_ignore:
            try:
                re.compile(pattern)
            except re.error as e:
                raise ConfigError(
                    f"`quantize_ignore` pattern '{pattern}' is not a regular expression ({e}); "
                    "quote it for the shell, e.g. 'mlp\\.down_proj'"
                ) from e

    def quantize_skip_reason(self, name: str, shape: tuple[int, ...], dtype: str) -> str | None:
        """Why the floating tensor `name` is not quantized under `quantize`, or None when it
        is: the one place that decides (the plan asks it for every tensor).

        Left unquantized, as the reference recipes leave them: anything but a 2-D `*.weight`
        (biases, norms, buffers), embeddings, the output head, norms and MoE routers/gates
        (`zerosafe.quantize.SKIPPED_MODULE`), weights named by `quantize_ignore` or kept in
        float32 by `keep_fp32`, and (`fp8-block`) weights whose shape does not divide into
        blocks."""
        from zerosafe.quantize import SKIPPED_MODULE, block_skip_reason

        if self.quantize is None:
            return "no `quantize`"
        if not dtype_info(dtype).is_floating:
            return f"a {dtype} tensor"
        if not name.endswith(".weight") or len(shape) != 2:
            return "not a 2-D weight"
        if SKIPPED_MODULE.search(name.removesuffix(".weight")):
            return "an embedding, output head, norm or router, never quantized"
        if any(re.search(p, name) for p in self.quantize_ignore):
            return "matches `quantize_ignore`"
        if self.keeps_fp32(name):
            return "kept in float32 (`keep_fp32`)"
        return block_skip_reason(self.quantize, shape)

    @property
    def parallel_tasks(self) -> int:
        """Tasks that fit the budget at once (at least 1)."""
        per_task_floor = TASK_OVERHEAD_BYTES + PIPELINE_BUFFERS * MIN_CHUNK_BYTES
        return max(1, min(self.max_parallel_tasks, self.memory // per_task_floor))

    @property
    def chunk_bytes(self) -> int:
        """Bytes per copy chunk, so `parallel_tasks` tasks fit in `memory`."""
        per_task = self.memory // self.parallel_tasks - TASK_OVERHEAD_BYTES
        chunk = per_task // PIPELINE_BUFFERS
        chunk = max(MIN_CHUNK_BYTES, min(MAX_CHUNK_BYTES, chunk))
        return chunk - chunk % 4096

    @property
    def task_memory_bytes(self) -> int:
        """What one running copy task holds at most."""
        return TASK_OVERHEAD_BYTES + PIPELINE_BUFFERS * self.chunk_bytes

    def keeps_fp32(self, name: str) -> bool:
        """Whether tensor `name` matches a `keep_fp32` pattern."""
        return any(re.search(p, name) for p in self.keep_fp32)

    def identity(self) -> dict[str, Any]:
        """The options that change output bytes (part of the job key). The keys are frozen:
        renaming one would change every job key, and outputs converted before would no
        longer count as done. So a newer option joins only when it is not at its default
        (`keep_fp32`, and DCP's `select` and `strip_prefix`: every DeepSpeed job keeps its key)."""
        ident: dict[str, Any] = {
            "dtype": self.dtype,
            "max_shard_bytes": self.max_shard_size,
            "tied": self.tied,
            "exclude_frozen": self.exclude_frozen,
        }
        if self.keep_fp32:
            ident["keep_fp32"] = list(self.keep_fp32)
        if self.select:
            ident["select"] = list(self.select)
        if self.strip_prefix is not None:
            ident["strip_prefix"] = self.strip_prefix
        if self.adapter:
            ident["adapter"] = True
        if self.keep_names:
            ident["keep_names"] = True
        if self.quantize is not None:
            ident["quantize"] = self.quantize
            ident["quantize_ignore"] = list(self.quantize_ignore)
        if self.quantize_scale_fmt != "float":
            ident["quantize_scale_fmt"] = self.quantize_scale_fmt
        # Not the model files: which are copied is checked apart, file by file, so changing
        # them (or `--model-files`) only copies again instead of converting again.
        return ident

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@contextlib.contextmanager
def environ_during(values: Mapping[str, str | None]) -> Iterator[None]:
    """This process's environment with `values` set for the block's duration (a None leaves
    that variable as it is), then every one of them as it was before, set or not."""
    before = {name: os.environ.get(name) for name in values}
    os.environ.update({name: value for name, value in values.items() if value is not None})
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask where the platform has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
