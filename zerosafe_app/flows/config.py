"""The job config: one validated model for YAML job files, flow parameters and CLI flags.

`conf/example.yaml` documents every field. Explicit flow parameters override the YAML file;
the result is validated before any work starts, and unknown keys or impossible combinations
are refused with a message naming the key. The fields are the rows of
`zerosafe_app.option_table.JOB_FIELDS` (tests/app/test_option_table.py keeps them equal):
which are sizes and URLs, how they become the engine's `ConvertOptions`, and the flow's JSON
parameters for a command's options come from there.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

from zerosafe.config import ConvertOptions, Mode, choose_mode
from zerosafe.dtypes import short_name
from zerosafe.errors import ConfigError
from zerosafe.io.s3 import find_secret_options
from zerosafe.io.storage import normalize_url
from zerosafe.units import parse_size
from zerosafe_app.option_table import JOB_FIELDS, Kind, fields_of_kind, options_values

__all__ = ["JobConfig", "flow_parameters", "load_job_config"]


class JobConfig(BaseModel):
    """One conversion job."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    source: str
    """The checkpoint's folder (path or URL, e.g. s3://...), of any format zerosafe reads
    (`zerosafe convert --help` lists them), or the folder above one save."""
    destination: str
    """The output folder (path or URL)."""
    tag: str | None = None
    """DeepSpeed: the tag to convert; by default the one `latest` names."""
    select: list[str] = Field(default_factory=list)
    """PyTorch DCP: key prefixes to convert (e.g. `[model]`, `[optim.state]`); empty: the
    tensors under `model`, or every tensor without a `model` key. Refused for DeepSpeed."""
    strip_prefix: str | None = None
    """PyTorch DCP: a prefix removed from the output names; null: `model` with the default
    selection, nothing with `select`; `""` strips nothing. Refused for DeepSpeed."""
    keep_names: bool = False
    """Megatron-LM: write Megatron's own names with the layers unstacked, nothing split, no
    `config.json` generated. Refused for other formats."""
    work_dir: str | None = None
    """Where the plan, intermediates and cached task results go (default: DESTINATION/.zerosafe-work)."""
    dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    """Output dtype of every floating tensor; integer buffers keep theirs."""
    max_shard_size: int = Field(default=5 * 10**9, gt=0)
    """Largest output file, e.g. `5GB`, `500MB` or `64MiB`."""
    memory: int = Field(default=10**9, gt=0)
    """Memory budget of one worker; the tasks it runs at once fit in it, e.g. `1GB`."""
    max_parallel_tasks: int = Field(default=2, ge=1)
    """Tasks one worker runs at once, further bounded by `memory`."""
    mode: Mode = Mode.AUTO
    """`direct` merges straight from a local or NFS checkpoint; `staged` copies each rank's
    fp32 partition to intermediates first (right for object stores); `auto` picks direct for
    local and NFS paths, staged otherwise. Both resume: each merge task is cached."""
    tied: Literal["dedupe", "copy"] = "dedupe"
    """`dedupe` stores a tied alias once and records it; `copy` writes it as a real tensor."""
    exclude_frozen: bool = False
    """Leave frozen parameters out of the output."""
    overwrite: bool = False
    """Replace a complete output of another source or other options."""
    keep_work: bool = False
    """Keep the work area after a verified publish."""
    allow_nonfinite: bool = False
    """Do not fail verification on NaN/Inf values."""
    check_lowp: bool = False
    """ZeRO-1/2: also check each tensor cast to the training dtype equals the 16-bit weight
    DeepSpeed saved beside it, before publishing (reads those weights too)."""
    file_sha256: bool = False
    """Record each weight file's SHA-256 (what the Hugging Face Hub shows) in the manifest,
    computed by verify's re-read; on a complete output without them, verify it again to add
    them (nothing is converted again)."""
    keep_fp32: list[str] = Field(default_factory=list)
    """Regular expressions on tensor names (`re.search`): matching floating tensors stay
    float32 under `dtype: bf16` or `fp16`, e.g. `['router', 'norm']`."""
    model_files: str | None = None
    """Folder to copy `config.json`, `generation_config.json` and the tokenizer files from;
    null: the checkpoint folder above the tag (where the HF Trainer saves them)."""
    copy_model_files: bool = True
    """Copy those files next to the weights, so `from_pretrained(destination)` works as is."""
    adapter: bool = False
    """Write the PEFT adapter the checkpoint holds: `adapter_model.safetensors` with PEFT's
    names and `adapter_config.json`, for `PeftModel.from_pretrained(base, destination)`."""
    quantize: Literal["fp8-block", "fp8-dynamic", "nvfp4a16"] | None = None
    """Write the weights quantized: `fp8-block` (float8_e4m3fn, a float32 `weight_scale_inv`
    per 128x128 block, as transformers' fine-grained FP8 writes it), `fp8-dynamic`
    (compressed-tensors' float-quantized, a float32 `weight_scale` per output channel, as
    llm-compressor's FP8_DYNAMIC writes it) or `nvfp4a16` (compressed-tensors'
    nvfp4-pack-quantized, as llm-compressor's NVFP4A16 writes it); null: not quantized."""
    quantize_ignore: list[str] = Field(default_factory=list)
    """With `quantize`: regular expressions on tensor names (`re.search`) left unquantized."""
    quantize_scale_fmt: Literal["float", "ue8m0"] = "float"
    """With `quantize` fp8-block: `float` (float32 `weight_scale_inv`) or `ue8m0` (powers of
    two as float8_e8m0fnu, transformers' `scale_fmt`; what `--quantize-like` reads)."""
    extract_part_size: int = Field(default=2 * 10**9, gt=0)
    """Staged mode: a rank's fp32 bytes are extracted in parts of at most this size."""
    runner: Literal["threads", "dask"] = "threads"
    """`threads` runs tasks on this machine; `dask` sends them to the Dask cluster at `dask_address`."""
    dask_address: str | None = None
    """Scheduler address of an existing Dask cluster, e.g. `tcp://10.0.0.5:8786`."""
    storage_options: dict[str, Any] = Field(default_factory=dict)
    """Options for remote paths: `endpoint_url`, `profile`, `region`, `anon`, other s3fs options,
    `part_size`/`range_size`/`max_requests` (transfers), and `credentials`, a reference to a
    Prefect block holding the keys (`secret/NAME` or `aws-credentials/NAME`). Never the keys
    themselves: parameters are stored and shown by the Prefect server."""
    timeout_seconds: int | None = Field(default=None, gt=0)
    """Fail the run if it takes longer than this."""

    _options: ConvertOptions | None = PrivateAttr(default=None)

    @field_validator(*fields_of_kind(Kind.SIZE), mode="before")
    @classmethod
    def _size(cls, value: Any) -> Any:
        if isinstance(value, str):
            try:
                return parse_size(value)
            except ValueError as e:
                raise ValueError(str(e)) from None
        return value

    @field_validator(*fields_of_kind(Kind.URL))
    @classmethod
    def _one_spelling(cls, value: str | None) -> str | None:
        # `ckpt`, `./ckpt` and `/abs/ckpt` are one job: identities use the normalized form.
        return normalize_url(value) if value else value

    @field_validator("storage_options")
    @classmethod
    def _no_secrets(cls, value: dict[str, Any]) -> dict[str, Any]:
        secrets = find_secret_options(value)
        if secrets:
            raise ValueError(
                f"{', '.join(secrets)}: credentials may not be job parameters (the Prefect "
                "server stores and shows them). Save them in a Prefect Secret block and set "
                "`storage_options.credentials: secret/NAME`, or give the workers AWS "
                "environment variables, a profile or an instance role."
            )
        ref = value.get("credentials")
        if ref is not None and (not isinstance(ref, str) or not ref):
            raise ValueError("`storage_options.credentials` must name a block, e.g. 'secret/NAME'")
        return value

    @model_validator(mode="after")
    def _combinations(self) -> JobConfig:
        if self._options is not None:
            # An instance validated before, handed on as is (pydantic runs "after" validators
            # on an instance it does not validate again: a subflow's parameter)
            return self
        if self.runner == "dask" and not self.dask_address:
            raise ValueError(
                "`runner: dask` needs `dask_address` (the scheduler's tcp://host:port)"
            )
        if self.source.rstrip("/") == self.destination.rstrip("/"):
            raise ValueError("`destination` must differ from `source`")
        # The engine's own checks (memory floor...), once: every later use gets this value.
        direct, why = choose_mode(self.source, self.mode)
        self._options = ConvertOptions(direct=direct, mode_reason=why, **options_values(dict(self)))
        return self

    def options(self) -> ConvertOptions:
        """The engine's options for this job, computed once, when the job was validated."""
        assert self._options is not None  # set by `_combinations`, which every instance passed
        return self._options


def flow_parameters(
    source: str,
    destination: str,
    options: ConvertOptions,
    *,
    mode: Mode | str,
    tag: str | None = None,
    work_dir: str | None = None,
    storage_options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The flow `convert`'s parameters for a job whose options the command line built: the
    Prefect edge, where the options become plain JSON (sizes as byte counts in strings, the
    dtype as `fp32|bf16|fp16`, the mode as asked); `load_job_config(None, **params).options()`
    gives `options` back.

    Args:
        mode: The mode as asked (`auto` included); `options.direct` is what it chose here.
    """
    given = {
        "tag": tag, "work_dir": work_dir, "storage_options": storage_options,
        "mode": Mode(mode).value,
    }  # fmt: skip
    params: dict[str, Any] = {"source": source, "destination": destination}
    for field in JOB_FIELDS:
        if field.engine:
            params[field.name] = _json_value(field.kind, getattr(options, field.name))
        elif field.name in given:
            params[field.name] = given[field.name]
    params["dtype"] = short_name(options.dtype)
    return params


def _json_value(kind: Kind, value: Any) -> Any:
    """A `ConvertOptions` value as the flow's JSON parameters hold it."""
    if kind is Kind.SIZE:
        return str(value)  # a JSON number loses digits above 2**53
    if kind is Kind.PATTERNS:
        return list(value)
    return value


def _readable(e: ValidationError) -> str:
    parts = []
    for err in e.errors():
        key = ".".join(str(x) for x in err["loc"]) or "config"
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown key (see conf/example.yaml for the keys)"
        parts.append(f"`{key}`: {msg}")
    return "; ".join(parts)


def load_job_config(conf: str | None = None, **overrides: Any) -> JobConfig:
    """Validate a job from a YAML file (optional) and explicit values (which win).

    Args:
        conf: Path of a YAML job file; relative paths resolve from the working directory.
        overrides: Field values; None means "not given" and leaves the file's value.

    Raises:
        ConfigError: Naming each bad or unknown key.
    """
    data: dict[str, Any] = {}
    if conf:
        path = Path(conf)
        if not path.is_file():
            raise ConfigError(f"{conf}: job file not found")
        loaded = yaml.safe_load(path.read_text()) or {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{conf}: a job file must be a mapping of keys to values")
        data.update(loaded)
    data.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return JobConfig(**data)
    except ValidationError as e:
        where = f"{conf}: " if conf else ""
        raise ConfigError(f"{where}invalid job config: {_readable(e)}") from None
