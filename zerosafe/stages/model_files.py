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
"""

from __future__ import annotations

import hashlib
import json
import logging
import posixpath
from typing import Any

from zerosafe.config import ConvertOptions
from zerosafe.dtypes import ALIASES
from zerosafe.errors import CheckpointFormatError, ConfigError
from zerosafe.io.storage import Storage, is_local, join_url

__all__ = [
    "CHAT_TEMPLATES_DIR",
    "MODEL_FILE_NAMES",
    "check_model_config",
    "copy_model_files",
    "find_model_files",
    "model_files_folder",
    "model_files_report",
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


def model_files_folder(source: dict[str, Any], options: ConvertOptions) -> str | None:
    """Where a job copies model files from: the folder `options.model_files` names, else the
    folder above the converted tag (the checkpoint folder holding `latest`); None when
    `copy_model_files` is off.

    Args:
        source: The plan's `source` block (`tag_url`, else `checkpoint`).
        options: The job's options.
    """
    if not options.copy_model_files:
        return None
    if options.model_files is not None:
        return options.model_files
    tag_url = source.get("tag_url") or source.get("checkpoint")
    if not tag_url:
        return None
    return posixpath.dirname(str(tag_url).rstrip("/")) or None


def find_model_files(storage: Storage, folder: str) -> list[str]:
    """The model files in `folder`, as names relative to it (in copy order)."""
    names = set(storage.listdir(folder))
    found = [n for n in MODEL_FILE_NAMES if n in names]
    if CHAT_TEMPLATES_DIR in names:
        found += [
            f"{CHAT_TEMPLATES_DIR}/{n}"
            for n in storage.listdir(join_url(folder, CHAT_TEMPLATES_DIR))
            if n.endswith(".jinja")
        ]
    return found


def copy_model_files(
    storage: Storage, folder: str, names: list[str], dest: str
) -> list[dict[str, Any]]:
    """Copy `names` from `folder` into `dest` (each written atomically), byte for byte.

    Returns:
        Manifest entries: `file`, `size_bytes`, `sha256`, and `source`, `source_size_bytes`,
        `source_version` (what a later run compares to see the source changed).
    """
    entries = []
    for name in names:
        src = join_url(folder, name)
        ident = storage.identity(src)
        data = storage.read_bytes(src)
        target = join_url(dest, name)
        if is_local(target):
            storage.makedirs(posixpath.dirname(target))
        storage.write_bytes(target, data)
        entries.append(
            {
                "file": name,
                "size_bytes": len(data),
                "sha256": hashlib.sha256(data).hexdigest(),
                "source": src,
                "source_size_bytes": ident.size_bytes,
                "source_version": ident.version,
            }
        )
    return entries


def read_config(storage: Storage, folder: str) -> dict[str, Any] | None:
    """`folder/config.json` parsed, or None when there is none.

    Raises:
        CheckpointFormatError: If it is not a JSON object.
    """
    url = join_url(folder, "config.json")
    if not storage.exists(url):
        return None
    try:
        config = json.loads(storage.read_bytes(url))
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
    config: dict[str, Any], where: str, *, out_dtype: str, aliases: dict[str, str]
) -> list[str]:
    """Where `config.json` disagrees with the output: its dtype, and `tie_word_embeddings`
    against the tied aliases the checkpoint has. One warning per disagreement.

    Args:
        config: The parsed config.
        where: Its URL, for the messages.
        out_dtype: The output dtype (torch name).
        aliases: Tied aliases of the checkpoint, alias -> target.
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
    if tie is True and not aliases:
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


def model_files_report(
    storage: Storage, source: dict[str, Any], options: ConvertOptions, *, aliases: dict[str, str]
) -> tuple[list[str], list[str]]:
    """Plan-time notes and warnings about the model files a job copies.

    Raises:
        ConfigError: If a folder named by `model_files` is missing or holds no model file.
        CheckpointFormatError: If its `config.json` is not a JSON object.
    """
    folder = model_files_folder(source, options)
    if folder is None:
        return [], []
    names = find_model_files(storage, folder)
    if options.model_files is not None and not names:
        what = "is not a folder" if not storage.isdir(folder) else "holds none of them"
        raise ConfigError(
            f"{folder}: `--model-files` expects a folder with config.json or tokenizer files "
            f"(as save_pretrained writes), but it {what}; pass the folder holding them, or "
            "`--no-model-files`"
        )
    if not names:
        return [
            f"no config.json or tokenizer files in {folder} to copy; from_pretrained needs a "
            "config: pass `--model-files DIR`"
        ], []
    notes = [f"copies {len(names)} model file(s) from {folder}: {', '.join(names)}"]
    config = read_config(storage, folder)
    if config is None:
        notes.append(f"no config.json in {folder}; from_pretrained needs one")
        return notes, []
    where = join_url(folder, "config.json")
    warnings = check_model_config(config, where, out_dtype=options.dtype, aliases=aliases)
    if config.get("auto_map"):
        notes.append(f"{where} names remote code (`auto_map`); its *.py files are not copied")
    return notes, warnings
