"""Hugging Face model files beside the weights: `config.json`, `generation_config.json`, the
tokenizer's and processor's files.

The HF Trainer and accelerate save them with `save_pretrained` into the checkpoint folder,
the folder above `global_stepN/` (the one holding `latest`); `zerosafe convert` copies them
next to the weights, so `AutoModelForCausalLM.from_pretrained(OUT)` works as is. Only the
names below are copied: never pickles (`training_args.bin`, `rng_state*.pth`), code
(`zero_to_fp32.py`, remote-code `*.py`), trainer state or the Trainer's own weights. The
names are those transformers 5 writes (`PreTrainedConfig.save_pretrained`,
`GenerationConfig.save_pretrained`, `PreTrainedTokenizerBase.save_pretrained` and the
`vocab_files_names` of its tokenizer classes, `ProcessorMixin.save_pretrained`):
https://huggingface.co/docs/transformers/main_classes/tokenizer

Copies go through the job's pending folder and are moved into place by publish with the
shards, before the completion marker (`zerosafe.stages.output.publish`).

What is copied is only what belongs to the folder, as a regular file (issue 24). On a local
filesystem a name that is a FIFO, a device, a socket or a folder is skipped with a warning
(reading it would hang or never end), and so is a symbolic link whose target lies outside
the folder: such a link can pull a private file (a 0600 key, another user's data) into an
output that is about to be uploaded. Skipping rather than refusing keeps the conversion going,
since none of these files is needed for the weights; the warning names each one and the fix.
A link that stays inside the folder is copied as the file it points to. A copy never gets a
wider mode than its source (a 0600 file stays 0600), and every file is streamed in bounded
chunks; `config.json` is parsed only up to `CONFIG_MAX_BYTES`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import posixpath
import stat
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from zerosafe.config import ConvertOptions
from zerosafe.dtypes import ALIASES
from zerosafe.errors import CheckpointFormatError, ConfigError
from zerosafe.io.storage import (
    Storage,
    file_kind,
    is_local,
    join_url,
    local_path,
    normalize_url,
)
from zerosafe.plan.adapter import ADAPTER_CONFIG_NAME

if TYPE_CHECKING:
    from zerosafe.formats.base import SourceDescription

__all__ = [
    "CHAT_TEMPLATES_DIR",
    "CONFIG_MAX_BYTES",
    "MODEL_FILE_NAMES",
    "check_against_generated",
    "check_model_config",
    "check_model_files_outside",
    "copy_model_files",
    "find_model_files",
    "list_model_files",
    "model_files_folder",
    "model_files_report",
    "not_copied_because",
]

log = logging.getLogger(__name__)

MODEL_FILE_NAMES = (
    # the model's config and its generation defaults
    "config.json",
    "generation_config.json",
    # every tokenizer: the fast tokenizer, its settings, special and added tokens, chat template
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    # vocabularies of the slow tokenizers (BPE, WordPiece, SentencePiece, tiktoken)
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
    "sentencepiece.model",
    "spm.model",
    "bpe.codes",
    "tiktoken.model",
    # processors of multimodal models
    "processor_config.json",
    "preprocessor_config.json",
    "video_preprocessor_config.json",
)
"""Files copied when present, by exact name."""
CHAT_TEMPLATES_DIR = "additional_chat_templates"
"""Named chat templates (`additional_chat_templates/NAME.jinja`): copied too."""
CONFIG_MAX_BYTES = 16 * 2**20
"""The largest `config.json` parsed for the plan-time checks. Real configs are kilobytes
(the largest on the Hub, with long `id2label` tables, a few MB); a bigger one is copied but
not read, so a huge or endless file cannot exhaust memory."""
COPY_CHUNK_BYTES = 8 * 2**20
"""Bytes per read when copying or hashing a model file, unless the job's budget gives less."""


def model_files_folder(source: SourceDescription | None, options: ConvertOptions) -> str | None:
    """Where a job copies model files from: the folder `options.model_files` names, else the
    folder the reader names (`source.model_files`: verl's `huggingface/`), else the folder
    above the converted tag (the checkpoint folder holding `latest`); None when
    `copy_model_files` is off.

    Args:
        source: The plan's source description (`model_files_url`: its `tag_url`, else
            `checkpoint`).
        options: The job's options.
    """
    if not options.copy_model_files:
        return None
    if options.model_files is not None:
        return options.model_files
    if source is not None and source.model_files:  # where the format keeps them (verl)
        return source.model_files
    tag_url = source.model_files_url if source is not None else None
    if not tag_url:
        return None
    return posixpath.dirname(tag_url.rstrip("/")) or None


def find_model_files(storage: Storage, folder: str, *, adapter: bool = False) -> list[str]:
    """The model files in `folder` that are copied, as names relative to it (in copy order):
    regular files only, see `list_model_files`."""
    return list_model_files(storage, folder, adapter=adapter)[0]


def list_model_files(
    storage: Storage, folder: str, *, adapter: bool = False
) -> tuple[list[str], list[str]]:
    """The model files in `folder` to copy, and a warning for each one skipped.

    Only names in `MODEL_FILE_NAMES` (and `additional_chat_templates/*.jinja`) count, and,
    for a PEFT adapter output (`adapter`), `adapter_config.json` (never beside a whole model:
    transformers would read the folder as an adapter). On a
    local filesystem each must be a regular file, or a symbolic link to one inside `folder`:
    a FIFO, device or socket, and a link leaving `folder`, are skipped (see the module
    docstring). Object stores hold only plain objects.

    Returns:
        `(names, warnings)`: names relative to `folder`, in copy order.
    """
    names = set(storage.listdir(folder))
    wanted = (ADAPTER_CONFIG_NAME, *MODEL_FILE_NAMES) if adapter else MODEL_FILE_NAMES
    found = [n for n in wanted if n in names]
    if CHAT_TEMPLATES_DIR in names and storage.isdir(join_url(folder, CHAT_TEMPLATES_DIR)):
        found += [
            f"{CHAT_TEMPLATES_DIR}/{n}"
            for n in storage.listdir(join_url(folder, CHAT_TEMPLATES_DIR))
            if n.endswith(".jinja")
        ]
    kept, warnings = [], []
    for name in found:
        why = not_copied_because(folder, name) if is_local(folder) else None
        if why is None:
            kept.append(name)
        else:
            warnings.append(why)
    if "config.json" in kept:
        why = _not_a_transformers_config(storage, folder)
        if why is not None:
            kept.remove("config.json")
            warnings.append(why)
    return kept, warnings


def _not_a_transformers_config(storage: Storage, folder: str) -> str | None:
    """Why `folder/config.json` is not copied as the model's config, or None when it may be
    one. OLMo-core writes its experiment config under that name into each `stepN/` folder
    (`ConfigSaverCallback`: `json.dumps(config.as_config_dict())`, every section tagged with
    its `_CLASS_`, no `model_type`); copied beside the weights, from_pretrained would
    misread it. A file that is not JSON is left to `read_config` to report."""
    url = join_url(folder, "config.json")
    try:
        config = json.loads(
            storage.read_small(url, limit_bytes=CONFIG_MAX_BYTES, what="a transformers config")
        )
    except (ValueError, OSError):  # refused or not JSON: `read_config` reports it
        return None
    if not isinstance(config, dict) or "model_type" in config:
        return None
    sections = [config, *(v for v in config.values() if isinstance(v, dict))]
    classes = [c for s in sections if isinstance(c := s.get("_CLASS_"), str)]
    olmo = [c for c in classes if c.startswith("olmo_core.")]
    if not olmo:
        return None
    return (
        f"{url}: OLMo-core's experiment config (sections tagged `_CLASS_` '{olmo[0]}'), not a "
        "transformers config; not copied, since from_pretrained would misread it. The "
        "weights keep OLMo-core's own names; OLMo-core's Hugging Face conversion "
        "(examples/huggingface/convert_checkpoint_to_hf.py in its repository) maps them to a "
        "transformers model, or pass `--model-files DIR` with a transformers config"
    )


def not_copied_because(folder: str, name: str) -> str | None:
    """Why the local model file `folder/name` is not copied, or None when it is a regular
    file (or a link to one) inside `folder`. Decided from `lstat`/`stat`, never by opening
    it: opening a FIFO blocks until a writer comes."""
    path = os.path.join(local_path(folder), name)
    try:
        st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode):
            target = os.path.realpath(path)
            root = os.path.realpath(local_path(folder))
            if os.path.commonpath([root, target]) != root:
                return (
                    f"{path}: a symbolic link to '{target}', outside {folder}; not copied, so "
                    "no file from elsewhere lands in the output. If it belongs to the model, "
                    "copy the file itself into the folder (`cp -L`)"
                )
            st = os.stat(path)
    except OSError as e:  # a dangling link, or removed meanwhile
        return f"{path}: cannot be read ({e.strerror}); not copied"
    if not stat.S_ISREG(st.st_mode):
        return (
            f"{path}: not a regular file (a {file_kind(st.st_mode)}); not copied. Replace it "
            "with the file itself, or remove it"
        )
    return None


def check_model_files_outside(folder: str, out_url: str) -> None:
    """Refuse to copy model files from the output folder itself or from inside it.

    Publishing removes the copies an output already holds before moving the new ones in,
    so copying from there would delete them (issue 24: `--model-files OUT` removed the
    output's config.json and tokenizer, and the run still succeeded).

    Raises:
        ConfigError: If `folder` is `out_url` or inside it.
    """
    inner, outer = normalize_url(folder), normalize_url(out_url)
    if inner != outer and not inner.startswith(outer.rstrip("/") + "/"):
        return
    raise ConfigError(
        f"{folder}: expected the folder model files are copied from (`--model-files`, by "
        f"default the checkpoint folder) to be outside the output, found it inside the output "
        f"{out_url} (or the output itself); publishing replaces the model files there, so they "
        "would be removed, not copied. Pass `--model-files DIR` with the folder holding "
        "config.json and the tokenizer files, convert into another output folder, or pass "
        "`--no-model-files`"
    )


def copy_model_files(
    storage: Storage,
    folder: str,
    names: list[str],
    dest: str,
    *,
    chunk_bytes: int = COPY_CHUNK_BYTES,
    config_update: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """Copy `names` from `folder` into `dest` (each written atomically), byte for byte, in
    reads of at most `chunk_bytes`. A local copy's mode is never wider than its source's.
    A name that stopped being a regular file inside `folder` since it was listed is skipped
    with a warning, as `list_model_files` would.

    `config_update`: keys `config.json` gets (a quantized release's `quantization_config`):
    that copy is written, not copied, as JSON with every other key as it was, in its order.

    Returns:
        Manifest entries: `file`, `size_bytes`, `sha256`, and `source`, `source_size_bytes`,
        `source_version` (what a later run compares to see the source changed).

    Raises:
        CheckpointFormatError: If a file shrinks while it is copied.
    """
    entries = []
    for name in names:
        src = join_url(folder, name)
        max_mode = None
        if is_local(folder):
            why = not_copied_because(folder, name)
            if why is not None:
                log.warning("%s", why)
                continue
            max_mode = stat.S_IMODE(os.stat(local_path(src)).st_mode)
        ident = storage.identity(src)
        target = join_url(dest, name)
        if is_local(target):
            storage.makedirs(posixpath.dirname(target))
        if name == "config.json" and config_update is not None:
            entries.append(
                _write_config(storage, folder, target, config_update, max_mode=max_mode)
                | {"source": src, "source_size_bytes": ident.size_bytes,
                   "source_version": ident.version}
            )  # fmt: skip
            continue
        digest = hashlib.sha256()
        source = storage.open_source(src)
        try:
            with storage.sink(target, max_mode=max_mode) as sink:
                for start in range(0, source.size_bytes, chunk_bytes):
                    data = source.read_range(start, min(start + chunk_bytes, source.size_bytes))
                    digest.update(data)
                    sink.write(data)
            size_bytes = source.size_bytes
        finally:
            source.close()
        entries.append(
            {
                "file": name,
                "size_bytes": size_bytes,
                "sha256": digest.hexdigest(),
                "source": src,
                "source_size_bytes": ident.size_bytes,
                "source_version": ident.version,
            }
        )
    return entries


def _write_config(
    storage: Storage, folder: str, target: str, update: dict[str, Any], *, max_mode: int | None
) -> dict[str, Any]:
    """Write `folder/config.json` with `update`'s keys set (added last where new) to
    `target`, indented as `save_pretrained` writes it; its `file`, `size_bytes`, `sha256`.

    Raises:
        CheckpointFormatError: If the source config is not a JSON object (`read_config`).
    """
    config = read_config(storage, folder)
    if config is None:
        raise CheckpointFormatError(
            f"{join_url(folder, 'config.json')}: removed while the conversion ran; run it again"
        )
    data = (json.dumps({**config, **update}, indent=2) + "\n").encode()
    with storage.sink(target, max_mode=max_mode) as sink:
        sink.write(data)
    return {"file": "config.json", "size_bytes": len(data),
            "sha256": hashlib.sha256(data).hexdigest()}  # fmt: skip


def sha256_of(
    storage: Storage, url: str, *, chunk_bytes: int = COPY_CHUNK_BYTES
) -> tuple[int, str]:
    """`(size_bytes, sha256 hex digest)` of a file, read in chunks of `chunk_bytes`."""
    digest = hashlib.sha256()
    source = storage.open_source(url)
    try:
        for start in range(0, source.size_bytes, chunk_bytes):
            digest.update(source.read_range(start, min(start + chunk_bytes, source.size_bytes)))
        return source.size_bytes, digest.hexdigest()
    finally:
        source.close()


def read_config(storage: Storage, folder: str) -> dict[str, Any] | None:
    """`folder/config.json` parsed, or None when there is none.

    Raises:
        CheckpointFormatError: If it is not a regular file, is larger than `CONFIG_MAX_BYTES`
            or is not a JSON object.
    """
    url = join_url(folder, "config.json")
    if not storage.exists(url):
        return None
    try:
        raw = storage.read_small(
            url,
            limit_bytes=CONFIG_MAX_BYTES,
            what="a transformers config",
            fix="fix or remove it, pass `--model-files DIR` with a good one, or `--no-model-files`",
        )
    except FileNotFoundError:  # removed since
        return None
    try:
        config = json.loads(raw)
    except ValueError as e:
        raise CheckpointFormatError(
            f"{url}: expected a transformers config (JSON), found invalid JSON ({e}); fix or "
            "remove it, pass `--model-files DIR` with a good one, or `--no-model-files`"
        ) from e
    if not isinstance(config, dict):
        raise CheckpointFormatError(
            f"{url}: expected a JSON object (a transformers config), found "
            f"{type(config).__name__}; pass `--model-files DIR` or `--no-model-files`"
        )
    return config


def check_model_config(
    config: dict[str, Any],
    where: str,
    *,
    out_dtype: str,
    aliases: dict[str, str],
    ties_by_config: bool = False,
) -> list[str]:
    """Where `config.json` disagrees with the output: its dtype, and `tie_word_embeddings`
    against the tied aliases the checkpoint has. One warning per disagreement.

    Args:
        config: The parsed config.
        where: Its URL, for the messages.
        out_dtype: The output dtype (torch name).
        aliases: Tied aliases of the checkpoint, alias -> target.
        ties_by_config: The checkpoint leaves tied weights to the config
            (`SourceLayout.ties_by_config`): `tie_word_embeddings` without an alias agrees.
    """
    warnings = []
    key = "dtype" if "dtype" in config else "torch_dtype"
    declared = config.get(key)
    if isinstance(declared, str) and declared != "auto":
        declared_name = ALIASES.get(declared, declared)
        if declared_name != out_dtype:
            warnings.append(
                f"{where}: `{key}` is '{declared}' but the weights are written in {out_dtype} "
                f"(--dtype); from_pretrained (dtype 'auto', the transformers 5 default) loads "
                f"them as {declared}. The copy is not edited: pass `dtype=` to from_pretrained, "
                "or fix the config in the checkpoint folder and convert again"
            )
    tie = config.get("tie_word_embeddings")
    ties = ", ".join(f"{a} -> {t}" for a, t in aliases.items())
    if tie is True and not aliases and not ties_by_config:
        warnings.append(
            f"{where}: `tie_word_embeddings` is true but the checkpoint ties no tensors (its "
            "output head was trained apart from the embeddings); a loader that ties them "
            "replaces the trained head. Set it to false in the config"
        )
    elif tie is False and aliases:
        warnings.append(
            f"{where}: `tie_word_embeddings` is false but the checkpoint ties {ties}; the "
            "alias is recorded, not written, so from_pretrained would initialize it at random. "
            "Set it to true in the config, or convert with `--tied copy`"
        )
    return warnings


ARCHITECTURE_FIELDS = (
    "num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
    "head_dim", "intermediate_size", "vocab_size", "rope_theta", "rms_norm_eps",
    "tie_word_embeddings", "qkv_bias", "qk_norm", "num_local_experts", "num_experts_per_tok",
)  # fmt: skip
"""What `check_against_generated` compares: the sizes and the choices that decide which
weights a transformers model has and how it reads them."""


def _architecture(config: Mapping[str, Any]) -> dict[str, object]:
    """`ARCHITECTURE_FIELDS` of a transformers config, with transformers' defaults where a
    field is absent; `qkv_bias` (Qwen2's always, else `attention_bias`) and `qk_norm`
    (Qwen3's) from its `model_type`."""
    heads, hidden = config.get("num_attention_heads"), config.get("hidden_size")
    rope = config.get("rope_parameters")
    model_type = config.get("model_type")
    default_head = hidden // heads if type(hidden) is int and type(heads) is int and heads else None
    return {
        "num_hidden_layers": config.get("num_hidden_layers"),
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": config.get("num_key_value_heads", heads),
        "head_dim": config.get("head_dim") or default_head,
        "intermediate_size": config.get("intermediate_size"),
        "vocab_size": config.get("vocab_size"),
        "rope_theta": _number(
            config.get("rope_theta")
            if "rope_theta" in config or not isinstance(rope, dict)
            else rope.get("rope_theta")
        ),
        "rms_norm_eps": _number(config.get("rms_norm_eps")),
        "tie_word_embeddings": config.get("tie_word_embeddings", False),
        "qkv_bias": model_type == "qwen2" or bool(config.get("attention_bias", False)),
        "qk_norm": model_type in ("qwen3", "qwen3_moe"),
        "num_local_experts": config.get("num_local_experts"),
        "num_experts_per_tok": config.get("num_experts_per_tok"),
    }


def _number(value: object) -> object:
    return (
        float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else value
    )


def check_against_generated(
    config: Mapping[str, Any], generated: Mapping[str, object], where: str
) -> None:
    """Refuse a `config.json` of another model than the one the reader's generated config
    (`SourceDescription.model_config`, from the checkpoint's own record) describes.

    Raises:
        ConfigError: Naming the first field that differs, both values, and the fix.
    """
    theirs, ours = _architecture(config), _architecture(generated)
    for field in ARCHITECTURE_FIELDS:
        if theirs[field] != ours[field]:
            raise ConfigError(
                f"{where}: `{field}` is {theirs[field]!r}, but the checkpoint gives "
                f"{ours[field]!r} (the {_architectures(dict(generated))} config generated "
                "from its saved args): "
                "this config is another model's, and from_pretrained would read these weights "
                "wrongly. Pass `--model-files DIR` with this model's config.json, or a folder "
                "without one to write the config generated from the checkpoint"
            )


def _architectures(config: dict[str, object] | None) -> str:
    names = (config or {}).get("architectures")
    return ", ".join(map(str, names)) if isinstance(names, list) else "no architecture"


def write_generated_config(
    storage: Storage, config: dict[str, object], dest: str, *, dtype: str
) -> dict[str, Any]:
    """Write `config` (a reader's `SourceDescription.model_config`) as `dest/config.json`,
    atomically, with `torch_dtype` the output's; its manifest entry (no `source`: it was made,
    not copied)."""
    data = (json.dumps({**config, "torch_dtype": dtype}, indent=2, sort_keys=True) + "\n").encode()
    with storage.sink(join_url(dest, "config.json")) as sink:
        sink.write(data)
    return {
        "file": "config.json",
        "size_bytes": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
        "source": None,
        "source_size_bytes": None,
        "source_version": None,
    }


def model_files_report(
    storage: Storage,
    source: SourceDescription,
    options: ConvertOptions,
    *,
    aliases: dict[str, str],
    ties_by_config: bool = False,
) -> tuple[list[str], list[str]]:
    """Plan-time notes and warnings about the model files a job copies (`ties_by_config`:
    see `check_model_config`).

    Raises:
        ConfigError: If a folder named by `model_files` is missing or holds no model file,
            or `quantize` finds no config.json to write its `quantization_config` into.
        CheckpointFormatError: If its `config.json` is not a JSON object.
    """
    folder = model_files_folder(source, options)
    if folder is None:
        return [], []
    names, skipped = list_model_files(storage, folder, adapter=options.adapter)
    if options.model_files is not None and not names:
        what = "is not a folder" if not storage.isdir(folder) else "holds none of them"
        raise ConfigError(
            f"{folder}: `--model-files` expects a folder with config.json or tokenizer files "
            f"(as save_pretrained writes), but it {what}; pass the folder holding them, or "
            "`--no-model-files`"
        )
    generated = (
        [f"config.json generated from the checkpoint ({_architectures(source.model_config)})"]
        if source.model_config is not None and not options.adapter
        else []
    )
    if options.quantize is not None and "config.json" not in names and not generated:
        raise ConfigError(
            f"{folder}: `quantize` {options.quantize} writes its `quantization_config` into the "
            "model's config.json, found none to copy (without it loaders read the FP8 weights "
            "unscaled); pass `--model-files DIR` with the model's config.json"
        )
    if not names:
        return generated or [
            f"no config.json or tokenizer files in {folder} to copy; from_pretrained needs a "
            "config: pass `--model-files DIR`"
        ], skipped
    notes = [f"copies {len(names)} model file(s) from {folder}: {', '.join(names)}"]
    if "config.json" not in names:
        if generated:
            notes += generated
        elif not options.adapter:  # an adapter loads onto the base model, with its config
            notes.append(f"no config.json in {folder}; from_pretrained needs one")
        return notes, skipped
    where = join_url(folder, "config.json")
    size_bytes = storage.identity(where).size_bytes
    if size_bytes > CONFIG_MAX_BYTES:
        return notes, [
            *skipped,
            f"{where}: {size_bytes} bytes, over the {CONFIG_MAX_BYTES // 2**20} MiB a "
            "transformers config can be; copied as is but not checked (dtype, tied weights). "
            "Is it the right file?",
        ]
    config = read_config(storage, folder)
    if config is None:  # removed since it was listed
        return notes, skipped
    if source.model_config is not None and not options.adapter:
        check_against_generated(config, source.model_config, where)
        notes.append(
            f"{where} used, not the config generated from the checkpoint: their architecture "
            f"fields agree ({', '.join(ARCHITECTURE_FIELDS)})"
        )
    warnings = check_model_config(
        config, where, out_dtype=options.dtype, aliases=aliases, ties_by_config=ties_by_config
    )
    if options.quantize is not None and "quantization_config" in config:
        warnings.append(
            f"{where}: has a `quantization_config` already; the copy gets the one of the "
            f"{options.quantize} weights written here instead"
        )
    elif options.quantize is not None:
        notes.append(f"config.json gets the `quantization_config` of {options.quantize}")
    if config.get("auto_map"):
        notes.append(f"{where} names remote code (`auto_map`); its *.py files are not copied")
    return notes, [*skipped, *warnings]
