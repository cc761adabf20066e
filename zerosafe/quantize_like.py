"""`--quantize-like DIR`: quantize as a base release is quantized, from the
`quantization_config` of its `config.json` (a local folder or an fsspec URL, S3 included).

What is read, and how it maps onto `zerosafe.quantize`'s schemes:

- `quant_method: fp8` (transformers' `FineGrainedFP8Config`, DeepSeek-V3's and the Qwen FP8
  releases' keys): `fp8-block`, with `scale_fmt` (`float` or `ue8m0`); `fmt` must be `e4m3`,
  `activation_scheme` `dynamic` and `weight_block_size` `[128, 128]`.
- `quant_method: compressed-tensors` with `format: float-quantized` or `nvfp4-pack-quantized`:
  `fp8-dynamic` or `nvfp4a16`, when its one config group is exactly what llm-compressor's
  `FP8_DYNAMIC` or `NVFP4A16` writes (`zerosafe.quantize.quantization_config`), without
  sparsity, transforms or a KV-cache scheme.
- The ignore list (`modules_to_not_convert`, `ignored_layers`, or compressed-tensors'
  `ignore`, whose `re:` entries are regular expressions matched at a module name's start)
  becomes `quantize_ignore` patterns on weight names; the output lists the modules it left
  unquantized, by name.

Anything else is refused in one line naming the field, so a release is never written in a
scheme that only resembles the base's.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from zerosafe.errors import ConfigError
from zerosafe.io.storage import Storage, join_url
from zerosafe.quantize import FP8_BLOCK, SCALE_FORMATS, quantization_config

__all__ = ["QuantizeLike", "quantize_like", "read_quantize_like"]

_CONFIG_MAX_BYTES = 2**24
_CT_FORMATS = {"float-quantized": "fp8-dynamic", "nvfp4-pack-quantized": "nvfp4a16"}
"""compressed-tensors' formats `--quantize` writes, and its scheme for each."""
_CT_EMPTY = ("sparsity_config", "transform_config", "kv_cache_scheme", "moe_sparsity_config")
"""compressed-tensors keys that must be empty: zerosafe writes none of these."""


@dataclass(frozen=True, kw_only=True, slots=True)
class QuantizeLike:
    """The options a base release's `quantization_config` asks for."""

    quantize: str
    """The scheme (`zerosafe.quantize.QUANTIZE_SCHEMES`)."""
    scale_fmt: str = "float"
    """`fp8-block`'s scale format (`ConvertOptions.quantize_scale_fmt`)."""
    ignore: tuple[str, ...] = ()
    """`quantize_ignore` patterns (weight names) for the base's ignore list."""


def read_quantize_like(storage: Storage, url: str) -> QuantizeLike:
    """The options that write weights quantized as the release at `url` is.

    Raises:
        ConfigError: If `url` has no `config.json` with a `quantization_config`, or the
            config asks for something zerosafe cannot write exactly (the field is named).
    """
    config_url = join_url(url, "config.json")
    if not storage.exists(config_url):
        raise ConfigError(
            f"{config_url}: `quantize_like` reads the base release's config.json, found none; "
            "pass the folder of a quantized release (its config.json holds `quantization_config`)"
        )
    raw = storage.read_small(
        config_url, limit_bytes=_CONFIG_MAX_BYTES, what="a model's config.json"
    )
    try:
        config = json.loads(raw)
    except ValueError as e:
        raise ConfigError(f"{config_url}: not valid JSON ({e})") from e
    scheme = config.get("quantization_config") if isinstance(config, dict) else None
    if not isinstance(scheme, dict):
        raise ConfigError(
            f"{config_url}: expected a `quantization_config` to reproduce, found none (not a "
            "quantized release); give `quantize` (fp8-block, fp8-dynamic, nvfp4a16) instead"
        )
    return quantize_like(scheme, where=config_url)


def quantize_like(scheme: dict[str, Any], *, where: str) -> QuantizeLike:
    """`read_quantize_like` on a parsed `quantization_config` (`where`: its file, for errors).

    Raises:
        ConfigError: If a field asks for what zerosafe cannot write exactly.
    """
    method = scheme.get("quant_method")
    if method == "fp8":
        fmt = scheme.get("scale_fmt") or "float"
        if fmt not in SCALE_FORMATS:
            _refuse(where, "scale_fmt", " or ".join(SCALE_FORMATS), fmt)
        expected = {"fmt": "e4m3", "activation_scheme": "dynamic",
                    "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}  # fmt: skip
        for key, want in expected.items():
            got = scheme.get(key, want if key != "weight_block_size" else None)
            got = list(got) if isinstance(got, (list, tuple)) else got
            if got != want:
                _refuse(where, key, want, got)
        ignore = scheme.get("modules_to_not_convert") or scheme.get("ignored_layers") or []
        if scheme.get("modules_to_convert"):
            _refuse(where, "modules_to_convert", None, scheme["modules_to_convert"])
        return QuantizeLike(quantize="fp8-block", scale_fmt=fmt, ignore=_patterns(ignore))
    if method != "compressed-tensors":
        _refuse(where, "quant_method", "fp8 or compressed-tensors", method)
    form = str(scheme.get("format"))
    if form not in _CT_FORMATS:
        _refuse(where, "format", " or ".join(_CT_FORMATS), scheme.get("format"))
    ours = quantization_config(_CT_FORMATS[form], [])
    for key in _CT_EMPTY:
        if scheme.get(key):
            _refuse(where, key, "none", scheme[key])
    groups = scheme.get("config_groups") or {}
    if len(groups) != 1:
        _refuse(where, "config_groups", "one group", sorted(groups))
    (name, group), want = next(iter(groups.items())), ours["config_groups"]["group_0"]
    for key in ("targets", "weights", "input_activations", "output_activations"):
        got = _without_defaults(group.get(key)) if key.endswith("s") else group.get(key)
        if got != _without_defaults(want[key]):
            _refuse(where, f"config_groups.{name}.{key}", want[key], group.get(key))
    return QuantizeLike(quantize=_CT_FORMATS[form], ignore=_patterns(scheme.get("ignore") or []))


def _without_defaults(value: Any) -> Any:
    """A quantization args dict without what does not change the stored bytes, so releases
    of other compressed-tensors versions compare: keys left null or empty (older versions
    write every field), a min-max observer (the statistic zerosafe computes; any other
    stays and is refused), a symmetric scheme's zero-point dtype, and NVFP4's FP8 scale
    dtype (its only one, which older versions do not write)."""
    if not isinstance(value, dict):
        return value
    dropped = {
        "observer": ("minmax", "memoryless_minmax", "static_minmax"),
        "zp_dtype": (value.get("zp_dtype"),) if value.get("symmetric") else (),
        "scale_dtype": ("torch.float8_e4m3fn",),
    }
    return {
        k: v for k, v in value.items()
        if v not in (None, {}) and v not in dropped.get(k, ())
    }  # fmt: skip


def _patterns(modules: list[str]) -> tuple[str, ...]:
    """`quantize_ignore` patterns (re.search on tensor names) for an ignore list of module
    names and compressed-tensors' `re:` expressions (matched at the name's start; their `$`,
    the module name's end, becomes the place before `.weight`)."""
    out = []
    for module in modules:
        if module.startswith("re:"):
            expression = re.sub(r"(?<!\\)\$", r"(?=\\.weight$)", module[3:])
            out.append(rf"^(?:{expression}).*\.weight$")
        else:
            out.append(rf"^{re.escape(module)}\.weight$")
    return tuple(out)


def _refuse(where: str, field: str, expected: Any, found: Any) -> None:
    raise ConfigError(
        f"{where}: `quantization_config.{field}` cannot be reproduced exactly: expected "
        f"{json.dumps(expected)}, found {json.dumps(found)}; give `quantize` instead of "
        "`quantize_like` to write zerosafe's nearest scheme"
    )
